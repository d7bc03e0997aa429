"""The static KV cache: buffers whose addresses never change, for a compiled decode step.

``torch.compile`` (and a CUDA graph even more so) wants every step to look the same: the
same tensors at the same addresses, the same shapes. The contiguous cache already
preallocates; what it still does per step is Python bookkeeping (``length += 1``) and slices
that grow by one every token — a new shape each step. Here instead:

* one sequence, ``[1, n_kv_heads, max_len, head_dim]`` per layer, allocated once;
* the positions being written arrive as a *tensor*, so the new keys land with
  ``index_copy_`` at an address computed on the device, not baked into the compiled code;
* attention reads a window of the first ``n_keys`` slots, rounded up to a multiple of
  ``window`` and masked beyond the current position. The window grows in steps of
  ``window`` tokens, so a compiler sees a handful of shapes, not one per token, while a
  step never reads much more of the cache than it needs (reading all ``max_len`` slots
  every step would cost as much memory traffic as the weights, for long contexts).

The host always knows how many tokens are cached (it counts the steps), so a decode step
never reads a value back from the device (only ``past_length``, which the checked prefill
asks for, does).
"""

from __future__ import annotations

import torch

from minillm.model.config import ModelConfig


class StaticKVCache:
    """Per-layer K/V buffers of one sequence, at fixed addresses, plus a table of positions."""

    def __init__(
        self,
        config: ModelConfig,
        max_len: int,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        window: int = 64,
    ) -> None:
        if max_len < 1 or max_len > config.max_position_embeddings:
            raise ValueError(f"max_len must be in 1..{config.max_position_embeddings}, got {max_len}")
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        shape = (1, config.n_kv_heads, max_len, config.head_dim)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(config.n_layers)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(config.n_layers)]
        for buffer in self.k + self.v:
            # Tell the compiler these tensors stay put: a CUDA graph may then read and write
            # them in place instead of copying them in and out around every replay.
            torch._dynamo.mark_static_address(buffer)
        self.positions = torch.arange(max_len, device=device)
        self.max_len = max_len
        self.window = window

    def at(self, start: int, q_len: int) -> StaticStep:
        """The view a forward pass writes ``q_len`` new tokens through, at positions
        ``start .. start + q_len - 1``; it attends over the window that covers them."""
        end = start + q_len
        if start < 0 or q_len < 1 or end > self.max_len:
            raise ValueError(
                f"the static KV cache holds {self.max_len} tokens; positions {start}..{end - 1} were asked for"
            )
        n_keys = min(self.max_len, -(-end // self.window) * self.window)
        return StaticStep(self, self.positions[start:end], self.positions[:n_keys])

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)


class StaticStep:
    """One forward pass's window onto a ``StaticKVCache`` (the model's ``KVCache`` protocol).

    ``write_positions`` [q_len] are where the new tokens go, ``key_positions`` [n_keys] the
    slots attention reads; both are views of the cache's position table, so a step
    allocates nothing and a compiled step can take them as inputs.
    """

    def __init__(self, cache: StaticKVCache, write_positions: torch.Tensor, key_positions: torch.Tensor) -> None:
        self.cache = cache
        self.write_positions = write_positions
        self.key_positions = key_positions

    @property
    def past_length(self) -> int:
        """Reads the first position back from the device: only the checked ``forward`` (the
        prefill) asks; the compiled step's ``run`` never does."""
        return int(self.write_positions[0])

    def positions(self, q_len: int) -> torch.Tensor:
        return self.write_positions[None, :q_len]

    def mask(self, attention_mask: torch.Tensor | None, q_len: int) -> torch.Tensor:
        """[1, 1, q_len, n_keys]: each new token sees the slots up to its own position."""
        if attention_mask is not None:
            raise ValueError("the static KV cache holds one unpadded sequence: attention_mask must be None")
        return (self.key_positions[None, :] <= self.write_positions[:, None])[None, None]

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        n_keys = self.key_positions.shape[0]
        self.cache.k[layer].index_copy_(2, self.write_positions, k)
        self.cache.v[layer].index_copy_(2, self.write_positions, v)
        return self.cache.k[layer][:, :, :n_keys], self.cache.v[layer][:, :, :n_keys]

    def advance(self, q_len: int) -> None:
        """Nothing to do: the caller, who chose the positions, knows the new length."""
