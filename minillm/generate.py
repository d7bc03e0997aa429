"""The simplest generation loop: greedy decoding by full recompute.

Every step runs the whole sequence through the model again and appends the most likely next
token. That costs O(t^2) work over t tokens — notebook 07 replaces it with a KV cache — but it
is the reference every faster loop must match token for token.
"""

from __future__ import annotations

import torch

from minillm.model.llama import Transformer


@torch.no_grad()
def greedy_recompute(
    model: Transformer,
    input_ids: list[int],
    max_new_tokens: int,
    eos_token_id: int | None = None,
) -> list[int]:
    """The new token ids, stopping after ``max_new_tokens`` or right after ``eos_token_id``."""
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    ids = torch.tensor([input_ids], device=model.device)
    new: list[int] = []
    for _ in range(max_new_tokens):
        next_id = int(model(ids)[0, -1].argmax())
        new.append(next_id)
        if next_id == eos_token_id:
            break
        ids = torch.cat([ids, torch.tensor([[next_id]], device=model.device)], dim=1)
    return new
