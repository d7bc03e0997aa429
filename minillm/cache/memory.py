"""How much memory inference needs: the weights plus the KV cache.

Per token, every layer stores one key and one value vector per KV head::

    kv_bytes_per_token = 2 * n_layers * n_kv_heads * head_dim * bytes_per_element

SmolLM2-135M in float32: 2 * 30 * 3 * 64 * 4 = 46,080 bytes (45 KiB) per token, so its full
8192-token context costs 360 MiB per sequence — more than half the weights (513 MiB). Grouped-
query attention is why it is not 3x that: 3 KV heads serve 9 query heads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from minillm.cache.base import KVShape


class ModelShape(KVShape, Protocol):
    """The sizes a parameter count needs (a ``ModelConfig`` has them all)."""

    vocab_size: int
    hidden_size: int
    n_heads: int
    intermediate_size: int
    attention_bias: bool
    tie_word_embeddings: bool


def free_memory(device: torch.device | str) -> int | None:
    """Bytes that can still be allocated on ``device`` (Linux's MemAvailable for the CPU), or None
    where it cannot be known. A pool larger than this is refused before it is allocated: the
    operating system hands out untouched pages freely, so an oversized ``torch.zeros`` would
    otherwise end in the process being killed while the pages are filled, not in an error."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    if device.type == "cpu":
        try:
            with open("/proc/meminfo") as f:
                for line in f:
                    if line.startswith("MemAvailable:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            pass
    return None


def bytes_per_element(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def kv_bytes_per_token(config: KVShape, dtype: torch.dtype = torch.float32) -> int:
    """Bytes of K and V that one token occupies across all layers."""
    return 2 * config.n_layers * config.n_kv_heads * config.head_dim * bytes_per_element(dtype)


def parameter_count(config: ModelShape) -> int:
    """Parameters of a Llama-family model with this config (tied embeddings counted once)."""
    d, kv = config.hidden_size, config.n_kv_heads * config.head_dim
    q = config.n_heads * config.head_dim
    attention = d * q + 2 * d * kv + q * d + (q + 2 * kv if config.attention_bias else 0)
    mlp = 3 * d * config.intermediate_size
    per_layer = attention + mlp + 2 * d
    embeddings = config.vocab_size * d * (1 if config.tie_word_embeddings else 2)
    return config.n_layers * per_layer + embeddings + d


@dataclass(frozen=True)
class MemoryBudget:
    """Bytes needed to serve ``batch_size`` sequences of ``seq_len`` tokens."""

    weights: int
    kv_cache: int
    kv_per_token: int

    @property
    def total(self) -> int:
        return self.weights + self.kv_cache

    def __str__(self) -> str:
        gib = 1024**3
        return (
            f"weights {self.weights / gib:.2f} GiB + KV cache {self.kv_cache / gib:.2f} GiB "
            f"({self.kv_per_token:,} B per token) = {self.total / gib:.2f} GiB"
        )


def memory_budget(config: ModelShape, batch_size: int, seq_len: int, dtype: torch.dtype = torch.float32) -> MemoryBudget:
    per_token = kv_bytes_per_token(config, dtype)
    return MemoryBudget(
        weights=parameter_count(config) * bytes_per_element(dtype),
        kv_cache=batch_size * seq_len * per_token,
        kv_per_token=per_token,
    )
