"""The KV cache, contiguous (notebook 07) and paged (notebook 08): the paged one is what the engine runs on."""

from minillm.cache.base import KVCache, OutOfBlocksError
from minillm.cache.contiguous import ContiguousKVCache
from minillm.cache.memory import MemoryBudget, kv_bytes_per_token, memory_budget, parameter_count
from minillm.cache.paged import BlockAllocator, BlockManager, PagedBatch, PagedKVCache

__all__ = [
    "BlockAllocator",
    "BlockManager",
    "ContiguousKVCache",
    "KVCache",
    "MemoryBudget",
    "OutOfBlocksError",
    "PagedBatch",
    "PagedKVCache",
    "kv_bytes_per_token",
    "memory_budget",
    "parameter_count",
]
