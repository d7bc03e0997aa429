"""The engine thread: the one loop that owns the ``Engine``, and the messages to and from it.

**Why one engine thread.** A step is one batched forward for every running request: the
whole point of continuous batching is that requests share it. So the engine runs one loop,
stepping while there is work and sleeping on the command queue when there is none, and the
web side only talks to it through messages: the Engine needs no lock, and a slow client can
never slow the batch down.

In: ``submit(job)`` and ``abort(job)``, from any thread, only queue a command; the loop runs
the queued commands between two steps. Out: each ``Job`` gets its events (``Accepted`` or
``Failed`` first, then ``Delta`` text and ``Finished`` per choice) on its asyncio queue,
put there by the event loop itself (``loop.call_soon_threadsafe``: asyncio is not thread-safe).
The loop reads the Engine only through its public API.

**Every job gets an end.** However the loop ends (``stop()``, Ctrl-C, a bug), each job it holds
or that is still queued gets a ``Failed``, and a job submitted after that is failed at once: no
HTTP handler can wait for an engine that has stopped.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Literal, Union

from minillm.engine import Engine
from minillm.engine.request import Request
from minillm.sampling import SamplingParams
from minillm.serve.metrics import EngineSnapshot, Metrics
from minillm.serve.protocol import FINISH_REASONS, ApiError, TokenLogprobs, shutting_down

log = logging.getLogger("minillm.serve")


# --------------------------------------------------------------------------- engine <-> HTTP messages
@dataclass(frozen=True)
class Accepted:
    """The engine queued every choice of the job: the response can start."""


@dataclass(frozen=True)
class Delta:
    index: int  # the choice
    text: str
    logprobs: list[TokenLogprobs] | None = None  # the tokens since the last Delta, when asked for


@dataclass(frozen=True)
class Finished:
    index: int
    finish_reason: str  # OpenAI's: "stop" or "length"
    completion_tokens: int
    logprobs: list[TokenLogprobs] | None = None  # tokens no Delta carried (held back text, the eos)


@dataclass(frozen=True)
class Failed:
    error: ApiError


Event = Union[Accepted, Delta, Finished, Failed]


@dataclass(eq=False)
class Job:
    """One HTTP request on its way through the engine: its choices and the way back to asyncio.

    ``choices[i]`` is choice ``i``'s (prompt ids, params); the engine thread fills ``requests``
    in the same order and sends events through ``send``, the only method it calls.
    """

    choices: list[tuple[list[int], SamplingParams]]
    loop: asyncio.AbstractEventLoop
    arrival: float  # time.perf_counter() when the HTTP request came in
    events: asyncio.Queue[Event] = field(default_factory=asyncio.Queue)
    requests: list[Request] = field(default_factory=list)
    # echo with logprobs: score these prompts (with this many alternatives) before generating;
    # the engine thread fills ``scores`` (one list per prompt) before it sends Accepted
    score_prompts: list[list[int]] = field(default_factory=list)
    score_top: int = 0
    scores: list[list[TokenLogprobs]] = field(default_factory=list)

    def send(self, event: Event) -> None:
        """Hand an event to the event loop (from the engine thread): the loop runs the put."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the loop is closed: the server is shutting down and nobody listens
            pass


# --------------------------------------------------------------------------- the engine thread
Command = tuple[Literal["add", "abort"], Job]


class EngineWorker:
    """Runs the Engine's loop on one thread; the rest of the server sends it commands.

    ``run()`` is the loop, on the calling thread, until ``stop()``; ``start()`` runs it on a new
    thread. ``submit`` and ``abort`` may be called from any thread: they only put a command on
    a queue, and the engine thread carries it out between two steps.
    """

    def __init__(self, engine: Engine, metrics: Metrics, warm_up: bool = True) -> None:
        self.engine = engine
        self.metrics = metrics
        self.warm_up = warm_up
        self.ready = threading.Event()  # set once the decode step is compiled: /health says "ok"
        self.error: str | None = None  # set if the engine thread itself failed: /health says why
        self._commands: queue.Queue[Command | None] = queue.Queue()  # None: stop
        self._owners: dict[Request, tuple[Job, int]] = {}  # unfinished engine request -> (its job, choice index)
        self._logprobs_sent: dict[Request, int] = {}  # how many of a request's logprobs went out
        self._first_token_at: dict[Request, float] = {}
        self._thread: threading.Thread | None = None  # set by start()
        self._closed = False  # stop() was called: submit() fails a job at once (under _lock, with the queue)
        self._lock = threading.Lock()
        self.ended_by_stop = 0  # the jobs still open when the loop stopped, ended with an error

    # -- called from other threads
    def start(self) -> None:
        """Run the engine loop on a new thread."""
        self._thread = threading.Thread(target=self.run, name="minillm-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """End the loop after the queued commands: each job still open ends with a 503 (waiting for
        the loop's thread if it has one). From then on, ``submit`` fails a job at once."""
        with self._lock:
            self._closed = True
            self._commands.put(None)
        if self._thread is not None:
            self._thread.join(timeout)

    def submit(self, job: Job) -> None:
        with self._lock:
            if not self._closed:
                self._commands.put(("add", job))
                return
        job.send(Failed(shutting_down()))

    def abort(self, job: Job) -> None:
        """Abort what is left of ``job`` (a no-op for the choices that finished)."""
        self._commands.put(("abort", job))

    # -- the engine thread
    def run(self) -> None:
        """The engine loop, on the calling thread, until ``stop()``."""
        try:
            self._serve()
        except Exception as err:  # a bug, or a failed warm-up: answer every job rather than leave it waiting
            log.exception("the engine thread failed")
            self.error = f"{type(err).__name__}: {err}"
            failure = Failed(ApiError(503, f"the engine stopped: {self.error}", type="server_error"))
            self._tell_all(failure)
            while (command := self._commands.get()) is not None:  # answer each later job, until stop()
                if command[0] == "add":
                    command[1].send(failure)
        finally:  # however it ended (Ctrl-C too): refuse later jobs, end the held and the queued ones
            with self._lock:
                self._closed = True
            self.ended_by_stop += self._tell_all(Failed(shutting_down()))
            while True:
                try:
                    command = self._commands.get_nowait()
                except queue.Empty:
                    break
                if command is not None and command[0] == "add":
                    command[1].send(Failed(shutting_down()))

    def _tell_all(self, failure: Failed) -> int:
        """Send ``failure`` to every job still running, without touching the engine; how many."""
        jobs = {job for job, _ in self._owners.values()}
        for job in jobs:
            job.send(failure)
        self._owners.clear()
        return len(jobs)

    def _serve(self) -> None:
        if self.warm_up:  # compile the decode step (one row; several rows) before the first user waits for it
            self.engine.generate(["Hello"], SamplingParams(max_new_tokens=2))
            self.engine.generate(["Hello", "Hi"], SamplingParams(max_new_tokens=2))
        self._publish()
        self.ready.set()
        while True:
            for command in self._next_commands():
                if command is None:  # stop(): end every job (their blocks go back to the pool), and return
                    jobs = {job for job, _ in self._owners.values()}
                    for job in jobs:
                        self._fail(job, shutting_down())
                    self.ended_by_stop += len(jobs)
                    self._publish()
                    return
                what, job = command
                if what == "add":
                    self._add(job)
                else:
                    self._abort(job)
            if self.engine.has_unfinished_requests():
                self._step()
            self._retire()
            self._publish()

    def _next_commands(self) -> list[Command | None]:
        """Every queued command; when the engine has nothing to do, wait for the first one."""
        commands = [] if self.engine.has_unfinished_requests() else [self._commands.get()]
        while True:
            try:
                commands.append(self._commands.get_nowait())
            except queue.Empty:
                return commands

    def _add(self, job: Job) -> None:
        try:
            decode = self.engine.tokenizer.decode_bytes
            for ids in job.score_prompts:  # (on this thread: the engine's model is used by no other)
                scored = self.engine.score(ids, job.score_top)
                job.scores.append([TokenLogprobs.of(t, None if lp is None else lp.logprob,
                                                    () if lp is None else lp.top, decode)
                                   for t, lp in zip(ids, scored)])
            for prompt_ids, params in job.choices:
                job.requests.append(self.engine.add_request(prompt_ids, params))
        except (TypeError, ValueError) as err:  # the engine's own checks: token ids, the KV pool's size
            for request in job.requests:
                self.engine.abort(request)
            job.send(Failed(ApiError(400, str(err))))
            return
        for index, request in enumerate(job.requests):
            self._owners[request] = (job, index)
        self.metrics.accepted(sum(len(ids) for ids, _ in job.choices))
        job.send(Accepted())

    def _abort(self, job: Job) -> None:
        for request in job.requests:
            if self._owners.pop(request, None) is not None:
                self.engine.abort(request)  # its blocks go back to the pool now
                self._first_token_at.pop(request, None)
                self.metrics.finish("abort")

    def _step(self) -> None:
        try:
            events = self.engine.step()
        except Exception as err:  # the engine has aborted and freed what this step was running
            log.exception("engine step failed")
            failed = {job for request, (job, _) in self._owners.items() if request.finish_reason == "abort"}
            for job in failed:
                self._fail(job, ApiError(500, f"the engine failed while generating: {err}", type="server_error"))
            return
        now = time.perf_counter()
        first_token_waits = []
        for request, text in events:
            job, index = self._owners[request]
            if request not in self._first_token_at:  # (a prefill's step also decodes: two tokens at once)
                self._first_token_at[request] = now
                first_token_waits.append(now - job.arrival)
            if text:  # empty while the detokenizer or a stop string holds text back
                job.send(Delta(index, text, self._new_logprobs(request)))
        self.metrics.step(now, len(events), first_token_waits)

    def _retire(self) -> None:
        """Tell each job which of its choices finished (and why), and count them."""
        now = time.perf_counter()
        for request, (job, index) in list(self._owners.items()):
            if request not in self._owners:  # (its job failed through another of its choices)
                continue
            if request.finish_reason == "error":  # this request alone failed: its job ends with the error
                self._fail(job, ApiError(500, f"generation failed: {request.error}", type="server_error"))
            elif request.finished:
                del self._owners[request]
                reason = FINISH_REASONS[request.finish_reason or "length"]
                first = self._first_token_at.pop(request, now)
                self.metrics.finish(reason, len(request.output_ids), now - first)
                job.send(Finished(index, reason, len(request.output_ids), self._new_logprobs(request)))
                self._logprobs_sent.pop(request, None)

    def _new_logprobs(self, request: Request) -> list[TokenLogprobs] | None:
        """The log-probabilities of the tokens ``request`` made since the last call (None if it
        did not ask for them), with each token's text and bytes for the wire."""
        if request.logprobs is None:
            return None
        sent = self._logprobs_sent.get(request, 0)
        self._logprobs_sent[request] = len(request.logprobs)
        decode = self.engine.tokenizer.decode_bytes
        return [TokenLogprobs.of(lp.token_id, lp.logprob, lp.top, decode) for lp in request.logprobs[sent:]]

    def _fail(self, job: Job, error: ApiError) -> None:
        for request in job.requests:
            if self._owners.pop(request, None) is not None:
                self.engine.abort(request)
                self._first_token_at.pop(request, None)
                self.metrics.finish("error")
        job.send(Failed(error))

    def _publish(self) -> None:
        """The engine's state for /metrics: the only place the worker reads the Engine's queues and pool."""
        engine, allocator = self.engine, self.engine.manager.allocator
        self.metrics.publish(EngineSnapshot(
            # a request whose prompt is being prefilled in chunks already holds its blocks: running
            running=len(engine.running) + len(engine.prefilling), waiting=len(engine.waiting),
            blocks_free=allocator.num_free, blocks_total=allocator.num_blocks, preemptions=engine.preemptions,
            # prompt tokens found in the prefix cache, of all prompt tokens admitted
            prefix_cache_hits=engine.cached_prompt_tokens,
            prefix_cache_queries=engine.prompt_tokens,
            drafts_proposed=engine.speculation_stats.proposed,
            drafts_accepted=engine.speculation_stats.accepted,
        ))

