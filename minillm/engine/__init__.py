"""The engine: requests, continuous batching on the paged KV cache, beam search, stop rules;
and the compiled batch-1 fast path."""

from minillm.engine.engine import Engine
from minillm.engine.fast import FastDecoder
from minillm.engine.request import Completion, StopStringFilter

__all__ = ["Completion", "Engine", "FastDecoder", "StopStringFilter"]
