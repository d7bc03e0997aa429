"""A batch of prompts as rectangles: ids padded to one length, the mask, and positions that count
real tokens only (notebook 02)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass
class BatchEncoding:
    """A padded batch: ``input_ids``, ``attention_mask`` (1 = real token) and ``position_ids``.

    Positions count real tokens only, so a left-padded prompt gets the same positions
    (0, 1, 2, ...) as the same prompt alone; pad slots get position 0 and mask 0.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor

    def __getitem__(self, key: str) -> torch.Tensor:
        return getattr(self, key)



def pad_batch(rows: Sequence[Sequence[int]], pad_id: int, padding_side: str = "left") -> BatchEncoding:
    """Pad lists of ids to one length: ``input_ids``, ``attention_mask``, ``position_ids``."""
    import torch

    width = max(len(row) for row in rows)
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
    position_ids = torch.zeros((len(rows), width), dtype=torch.long)
    for r, row in enumerate(rows):
        start = width - len(row) if padding_side == "left" else 0
        span = slice(start, start + len(row))
        input_ids[r, span] = torch.tensor(list(row), dtype=torch.long)
        attention_mask[r, span] = 1
        position_ids[r, span] = torch.arange(len(row))
    return BatchEncoding(input_ids, attention_mask, position_ids)
