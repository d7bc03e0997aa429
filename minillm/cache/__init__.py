"""The KV cache, contiguous and paged (notebooks 07 and 08), and static for a compiled step (10)."""

from minillm.cache.base import KVCache, OutOfBlocksError
from minillm.cache.contiguous import ContiguousKVCache
from minillm.cache.memory import MemoryBudget, kv_bytes_per_token, memory_budget, parameter_count
from minillm.cache.paged import BlockAllocator, PackedPrefill, PagedBatch, PagedKVCache
from minillm.cache.static import StaticKVCache, StaticStep

__all__ = [
    "BlockAllocator",
    "ContiguousKVCache",
    "KVCache",
    "MemoryBudget",
    "OutOfBlocksError",
    "PackedPrefill",
    "PagedBatch",
    "PagedKVCache",
    "StaticKVCache",
    "StaticStep",
    "kv_bytes_per_token",
    "memory_budget",
    "parameter_count",
]
