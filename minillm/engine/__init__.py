"""The engine: requests, continuous batching on the paged KV cache, beam search, stop rules,
all run by one compiled decode step (``ModelRunner``)."""

from minillm.engine.engine import Engine, prefill_chunk_sizes
from minillm.engine.request import Completion, StopStringFilter
from minillm.engine.runner import ModelRunner

__all__ = ["Completion", "Engine", "ModelRunner", "StopStringFilter", "prefill_chunk_sizes"]
