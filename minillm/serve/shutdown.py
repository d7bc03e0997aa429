"""How the server stops: refuse new requests, let the open ones finish, end what is left, exit.

On SIGINT (Ctrl-C) or SIGTERM, ``run_server`` calls ``Server.shutdown(grace)`` on the event loop:

1. ``Drain`` starts refusing: every new request is answered 503 with OpenAI's error JSON
   (while the socket still accepts connections, so nobody who arrives now is left unanswered);
2. the requests in flight get ``grace`` seconds (``--shutdown-timeout``) to finish on their own;
3. the engine loop stops: it ends every job still open, a stream with an error event and
   ``data: [DONE]``, a non-streaming request with a 503, and frees their KV blocks (a job that
   arrives later is refused at once: nothing waits for an engine that is gone);
4. uvicorn closes its socket and connections (waiting at most a second more), and the process exits.

The order is the point: the engine loop stops only once no new request can reach it. A second
signal does not wait: it stops at once, ending the open jobs the same way.
"""

from __future__ import annotations

import asyncio
import signal
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Protocol

from starlette.responses import JSONResponse

from minillm.serve.protocol import shutting_down


class Drain:
    """Counts the HTTP requests in flight, and once ``draining`` answers new ones 503.

    Its state is shared by the middleware (``DrainMiddleware``) and ``Server.shutdown``."""

    def __init__(self) -> None:
        self.draining = False
        self.in_flight = 0

    async def wait_idle(self, seconds: float) -> bool:
        """Wait until no request is in flight, at most ``seconds``; whether none is."""
        deadline = time.monotonic() + seconds
        while self.in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        return not self.in_flight


class DrainMiddleware:
    """The ASGI side of ``Drain``."""

    def __init__(self, app: Any, drain: Drain) -> None:
        self.app, self.drain = app, drain

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.drain.draining:
            error = shutting_down()
            response = JSONResponse(error.body(), status_code=error.status, headers={"Connection": "close"})
            await response(scope, receive, send)
            return
        self.drain.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.drain.in_flight -= 1


class _Worker(Protocol):
    ready: threading.Event  # set once the engine loop serves


class Stoppable(Protocol):
    """What ``SignalStop`` needs of ``app.Server``."""

    loop: asyncio.AbstractEventLoop | None
    worker: _Worker

    async def shutdown(self, grace: float) -> None: ...


class SignalStop:
    """SIGINT and SIGTERM for ``run_server``, whose main thread runs the engine loop.

    Python runs a signal handler on the main thread between two bytecodes, so not while a step
    is in a C++ or torch call: on a busy machine that can be a second. So the handler is the slow
    path. The fast one: Python's own C-level handler writes each signal's number to a socket at
    once (``signal.set_wakeup_fd``), where a small thread waits and hands the shutdown to the
    event loop (``call_soon_threadsafe``, safe from any thread). Python's handler (``__call__``)
    does the same, and raises KeyboardInterrupt on a second signal, or on one before the engine
    is ready (while it compiles: its loop would not see a stop before that ends), which stops
    the engine loop at once."""

    def __init__(self, server: Stoppable, grace: float) -> None:
        self.server, self.grace = server, grace
        self.signal: int | None = None  # the first signal received
        self.task: asyncio.Task[None] | None = None

    @contextmanager
    def installed(self) -> Iterator[None]:
        """Handle SIGINT and SIGTERM until the block ends (call it on the main thread)."""
        wake_read, wake_write = socket.socketpair()
        wake_write.setblocking(False)  # (the C handler must never block)
        previous = {sig: signal.signal(sig, self) for sig in (signal.SIGINT, signal.SIGTERM)}
        previous_fd = signal.set_wakeup_fd(wake_write.fileno(), warn_on_full_buffer=False)
        watcher = threading.Thread(target=self._watch, args=(wake_read,), name="minillm-signals", daemon=True)
        watcher.start()
        try:
            yield
        finally:
            signal.set_wakeup_fd(previous_fd)
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            wake_write.close()  # the watcher's recv returns b"": it ends
            watcher.join(5)
            wake_read.close()

    def _watch(self, wake: socket.socket) -> None:
        while data := wake.recv(64):
            if signal.SIGINT in data or signal.SIGTERM in data:
                self._schedule()

    def __call__(self, signum: int, frame: Any) -> None:
        first = self.signal is None
        self.signal = self.signal or signum
        if not first or self.server.loop is None or not self.server.worker.ready.is_set():
            raise KeyboardInterrupt
        self._schedule()  # (most likely done already by the watcher: the shutdown starts once)

    def _schedule(self) -> None:
        loop = self.server.loop
        if loop is None:  # not serving yet: __call__ interrupts the engine loop instead
            return
        try:
            loop.call_soon_threadsafe(self._begin)
        except RuntimeError:  # the event loop has closed: the server is stopping already
            pass

    def _begin(self) -> None:  # on the event loop
        if self.task is None:
            self.task = asyncio.get_running_loop().create_task(self.server.shutdown(self.grace))
