"""The engine: requests, continuous batching on the paged KV cache, beam search, stop rules,
every step planned by the scheduler and run by the model runner on one backend."""

from minillm.lazy import lazy_exports

__getattr__, __dir__ = lazy_exports(__name__, {
    "Completion": "request",
    "Engine": "engine",
    "ModelRunner": "runner",
    "StopStringFilter": "request",
    "prefill_chunk_sizes": "engine",
})
__all__ = __dir__()
