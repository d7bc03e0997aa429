"""The engine: requests, continuous batching on the paged KV cache, beam search, stop rules,
every step planned by the scheduler (pure Python) and run by the model runner on one backend.

Names are imported on first use, so ``import minillm.engine.scheduler`` stays torch-free.
"""

from minillm.lazy import lazy_exports

__getattr__, __dir__ = lazy_exports(__name__, {
    "Completion": "request",
    "DraftModel": "draft",
    "Engine": "engine",
    "ModelRunner": "runner",
    "PromptLookup": "speculation",
    "ScheduledBatch": "scheduler",
    "Scheduler": "scheduler",
    "SequenceGroup": "sequence",
    "StopStringFilter": "request",
    "prefill_chunk_sizes": "scheduler",
})
__all__ = __dir__()
