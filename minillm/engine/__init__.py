"""The engine: requests, continuous batching on the paged KV cache, beam search, stop rules."""

from minillm.engine.engine import Engine
from minillm.engine.request import Completion, StopStringFilter

__all__ = ["Completion", "Engine", "StopStringFilter"]
