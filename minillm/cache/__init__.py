"""The KV cache, contiguous (notebook 07) and paged (notebook 08): the paged one is what the engine runs on.

``block_manager`` is the paged cache's bookkeeping in pure Python (no torch: importing it loads
none); ``paged`` is its storage; ``contiguous`` the simple cache of notebook 07. Names are
imported on first use, so ``import minillm.cache.block_manager`` stays torch-free.
"""

from minillm.lazy import lazy_exports

__getattr__, __dir__ = lazy_exports(__name__, {
    "BlockAllocator": "block_manager",
    "BlockManager": "block_manager",
    "OutOfBlocksError": "block_manager",
    "ContiguousKVCache": "contiguous",
    "KVCache": "base",
    "MemoryBudget": "memory",
    "kv_bytes_per_token": "memory",
    "memory_budget": "memory",
    "parameter_count": "memory",
    "PagedKVCache": "paged",
    "PagedStep": "paged",
})
__all__ = __dir__()
