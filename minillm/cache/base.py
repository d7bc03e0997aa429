"""What the model asks of a KV cache: four small methods, whatever the memory layout.

During generation each new token needs the keys and values of *every* earlier token. A KV
cache stores them so that each step computes K and V for the new tokens only: decoding t
tokens costs O(t) projections instead of O(t^2). The model talks to any cache through this
protocol, so a contiguous buffer and a paged block pool are interchangeable.
"""

from __future__ import annotations

from typing import Protocol

import torch


class KVCache(Protocol):
    @property
    def past_length(self) -> int:
        """Tokens already cached per row (for a padded batch: columns, pads included)."""
        ...

    def positions(self, q_len: int) -> torch.Tensor:
        """Default ``position_ids`` [batch, q_len] of the next ``q_len`` tokens."""
        ...

    def mask(self, attention_mask: torch.Tensor | None, q_len: int) -> torch.Tensor:
        """Boolean [batch, 1, q_len, keys] mask for attention over cached + new keys."""
        ...

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the new ``k``, ``v`` [batch, n_kv_heads, q_len, head_dim] of ``layer``; return
        all keys and values to attend over."""
        ...

    def advance(self, q_len: int) -> None:
        """Called once per forward, after the last layer: the new tokens are now cached."""
        ...
