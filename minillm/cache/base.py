"""What the model asks of a KV cache: four small methods, whatever the memory layout.

During generation each new token needs the keys and values of *every* earlier token. A KV
cache stores them so that each step computes K and V for the new tokens only: decoding t
tokens costs O(t) projections instead of O(t^2). The model talks to any cache through this
protocol. (The paged cache is addressed differently: through an explicit step input, see
``paged.PagedStep``.) The mask over cached + new keys lives here too, because it is a question
about what the cache holds: which of its keys each new query may see.
"""

from __future__ import annotations

from typing import Protocol

import torch


class KVShape(Protocol):
    """What a cache needs to know of a model (a ``ModelConfig`` is one): how many layers, and the
    size of each layer's keys and values."""

    n_layers: int
    n_kv_heads: int
    head_dim: int
    max_position_embeddings: int


def build_mask(attention_mask: torch.Tensor | None, q_len: int, k_len: int, device: torch.device) -> torch.Tensor:
    """Boolean [batch or 1, 1, q_len, k_len] mask, True where a query may attend to a key.

    Causal: the queries are the *last* ``q_len`` of ``k_len`` positions, and each sees the keys
    up to itself. Padding: keys whose ``attention_mask`` is 0 are hidden from every query. A
    query row that would see nothing at all (a left-pad slot) is allowed to see everything
    instead, which keeps its (ignored) output finite rather than NaN.
    """
    q_pos = torch.arange(k_len - q_len, k_len, device=device)[:, None]
    k_pos = torch.arange(k_len, device=device)[None, :]
    mask = (k_pos <= q_pos)[None, None]
    if attention_mask is not None:
        mask = mask & attention_mask[:, None, None, -k_len:].bool()
        mask = mask | ~mask.any(dim=-1, keepdim=True)
    return mask


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
