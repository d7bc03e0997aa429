"""The KV cache, contiguous and paged: the engine's memory between steps (notebooks 07 and 08)."""

from minillm.cache.base import KVCache, OutOfBlocksError
from minillm.cache.contiguous import ContiguousKVCache
from minillm.cache.memory import MemoryBudget, kv_bytes_per_token, memory_budget, parameter_count
from minillm.cache.paged import BlockAllocator, PackedPrefill, PagedBatch, PagedKVCache

__all__ = [
    "BlockAllocator",
    "ContiguousKVCache",
    "KVCache",
    "MemoryBudget",
    "OutOfBlocksError",
    "PackedPrefill",
    "PagedBatch",
    "PagedKVCache",
    "kv_bytes_per_token",
    "memory_budget",
    "parameter_count",
]
