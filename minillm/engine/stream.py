"""A completion's text as it is generated: the iterator ``Engine.stream`` returns."""

from __future__ import annotations

from typing import Protocol

from minillm.engine.request import Completion, Request
from minillm.errors import GenerationError


class Engine(Protocol):
    """What a stream needs of the engine (``engine.Engine``, which imports this module)."""

    def step(self) -> object: ...

    def abort(self, unit: Request) -> None: ...


class TextStream:
    """One completion's text deltas, as the engine produces them.

    Each ``next()`` runs engine steps until this request has new text (other requests in the
    running batch advance too). Abandoning it (``break``, ``close()``, ``del``, an exception in
    the loop) aborts the request at once and returns its KV blocks. Once it is exhausted,
    ``completion`` holds the result.
    """

    def __init__(self, engine: Engine, request: Request) -> None:
        self._engine = engine
        self._request = request
        self._sent = 0  # characters of request.text already handed out
        self.completion: Completion | None = None

    def __iter__(self) -> TextStream:
        return self

    def __next__(self) -> str:
        request = self._request
        while len(request.text) == self._sent and not request.finished:
            self._engine.step()
        if len(request.text) > self._sent:
            delta, self._sent = request.text[self._sent :], len(request.text)
            return delta
        self.completion = request.completion()
        if request.finish_reason == "error":
            raise GenerationError(f"generation failed: {request.error}")
        raise StopIteration

    def close(self) -> None:
        self._engine.abort(self._request)  # a no-op once it has finished

    def __del__(self) -> None:
        self.close()
