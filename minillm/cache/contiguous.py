"""The contiguous KV cache: one preallocated buffer per layer, ``[batch, n_kv_heads, max_len, head_dim]``.

Simple and fast — a step writes its new keys at column ``past_length`` and attends over
``[:past_length + q_len]`` — but it reserves ``max_len`` slots for every row up front, even
for sequences that stop early. That waste is what the paged cache removes.

A batch of prompts of different lengths is left-padded (``Tokenizer.encode_batch``), so all
rows advance through the same columns together; ``attention_mask`` hides the pad columns.
"""

from __future__ import annotations

import torch

from minillm.cache.base import build_mask
from minillm.cache.memory import ModelShape, memory_budget


class ContiguousKVCache:
    def __init__(
        self,
        config: ModelShape,
        batch_size: int,
        max_len: int,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> None:
        if batch_size < 1 or max_len < 1:
            raise ValueError(f"batch_size and max_len must be >= 1, got {batch_size} and {max_len}")
        if max_len > config.max_position_embeddings:
            raise ValueError(f"max_len={max_len} exceeds the context window of {config.max_position_embeddings}")
        shape = (batch_size, config.n_kv_heads, max_len, config.head_dim)
        try:
            self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(config.n_layers)]
            self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(config.n_layers)]
        except (torch.cuda.OutOfMemoryError, RuntimeError) as err:
            if "memory" not in str(err) and "allocate" not in str(err):
                raise
            budget = memory_budget(config, batch_size, max_len, dtype)
            raise MemoryError(
                f"a contiguous KV cache for {batch_size} x {max_len} tokens does not fit on {device}: needs {budget}"
            ) from None
        self.batch_size = batch_size
        self.max_len = max_len
        self.length = 0

    @property
    def past_length(self) -> int:
        return self.length

    def positions(self, q_len: int) -> torch.Tensor:
        device = self.k[0].device
        return torch.arange(self.length, self.length + q_len, device=device).expand(self.batch_size, q_len)

    def mask(self, attention_mask: torch.Tensor | None, q_len: int) -> torch.Tensor:
        if self.length + q_len > self.max_len:
            raise ValueError(
                f"the KV cache holds {self.max_len} tokens per row; {self.length} are used and {q_len} more were asked for"
            )
        return build_mask(attention_mask, q_len, self.length + q_len, self.k[0].device)

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if k.dtype != self.k[layer].dtype:
            raise TypeError(f"the KV cache holds {self.k[layer].dtype} but the model computes in {k.dtype}: "
                            "build the cache with the model's dtype")
        end = self.length + k.shape[2]
        self.k[layer][:, :, self.length : end] = k
        self.v[layer][:, :, self.length : end] = v
        return self.k[layer][:, :, :end], self.v[layer][:, :, :end]

    def advance(self, q_len: int) -> None:
        self.length += q_len

    @property
    def nbytes(self) -> int:
        """Bytes reserved by the buffers (all of ``max_len``, used or not)."""
        return sum(t.numel() * t.element_size() for t in self.k + self.v)
