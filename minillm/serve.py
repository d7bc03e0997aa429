"""An OpenAI-compatible HTTP server around one ``Engine``: ``python -m minillm serve``.

The life of one request, from the socket to ``data: [DONE]``::

    HTTP POST /v1/chat/completions (asyncio: FastAPI + uvicorn, many connections at once)
      │ read the body (at most 8 MiB), parse and validate it: a bad field is a 400 with
      │ OpenAI's error JSON, an unknown model a 404, and nothing reaches the engine
      │ apply the chat template and tokenize (in a worker thread: a long prompt must not
      │ stall the other connections); a prompt past the context window is a 400
      ▼
    a Job (its prompts and SamplingParams, one engine request per choice: n > 1 is n
      │ requests) goes on a thread-safe queue of commands: the only door into the engine
      ▼
    the engine thread (one, owning the Engine: nothing else touches it; the main thread under
      │ ``python -m minillm serve``, see ``run_server``)
      │ between two steps it runs the queued commands: add_request() for each choice, or
      │ abort() for a job whose client left; the first event back is Accepted or Failed,
      │ so a request the engine refuses is still a plain 400
      │ step(): admit and prefill what fits, decode one token for every running request,
      │ retire what finished and free its KV blocks (continuous batching)
      │ each new piece of text goes back to its job's asyncio.Queue through
      │ loop.call_soon_threadsafe (asyncio objects are not thread-safe: the event loop
      │ itself must run the put)
      ▼
    the HTTP handler, awaiting that queue: with ``stream`` it writes each piece as a
      Server-Sent Event (``data: {chunk}``), then the finish reasons, then ``data: [DONE]``;
      without, it collects the text and answers one JSON object with ``usage``.

**Disconnects.** When a streaming client goes away, Starlette cancels the response; on its
way out it queues ``abort`` for the job, so the engine thread aborts its requests before the
next step and their KV blocks are back in the pool. A non-streaming request has a task that
waits for its client's disconnect and then does the same. Either way the other requests in
the batch never notice.

**Why one engine thread.** A step is one batched forward for every running request: the
whole point of continuous batching is that requests share it. So the engine runs one loop,
stepping while there is work and sleeping on the command queue when there is none, and the
web side only talks to it through messages: the Engine needs no lock, and a slow client can
never slow the batch down.

``GET /metrics`` shows the engine as Prometheus text (queue, batch, KV blocks, tokens/s,
time-to-first-token and time-per-output-token histograms), and ``GET /`` is a small chat page
that streams its answers from ``/v1/chat/completions``.
"""

from __future__ import annotations

import asyncio
import copy
import html
import json
import logging
import queue
import socket
import threading
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace
from importlib import resources
from typing import Annotated, Any, Literal, Optional, Union

import uvicorn
from fastapi import FastAPI
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request as HttpRequest

from minillm.engine import Engine
from minillm.engine.request import Request
from minillm.sampling import SamplingParams

log = logging.getLogger("minillm.serve")

MAX_BODY_BYTES = 8 * 2**20  # a request body larger than this is refused (413) before it is parsed
MAX_CHOICES = 128  # prompts x n of one request: each choice is an engine request with its own state
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions (chat: as many as fit)
# The engine's finish reasons in OpenAI's words: EOS and a stop string are both "stop".
FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length"}
TTFT_BUCKETS = (0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TPOT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5)
RATE_WINDOW_S = 10.0  # tokens/s is averaged over this many seconds


# --------------------------------------------------------------------------- errors
class ApiError(Exception):
    """A request the server refuses, answered as OpenAI does: ``{"error": {message, type, param, code}}``."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def _validation_error(err: ValidationError) -> ApiError:
    """The first problem pydantic found, named by its path in the request (``messages.0.role``)."""
    errors = err.errors(include_url=False)
    first = errors[0]
    if first["type"] == "json_invalid":
        return ApiError(400, f"the request body is not valid JSON: {first['msg']}")
    # A union (stop: a str or a list of str) reports one error per alternative: an error of
    # value ("too long") says more than one of type ("not a string").
    same_field = [e for e in errors if e["loc"][:1] == first["loc"][:1]]
    first = next((e for e in same_field if not e["type"].endswith("_type")), first)
    # The alternatives also appear in the path, as type names ("prompt.list[int].1"): drop them.
    path = [str(p) for p in first["loc"] if isinstance(p, int) or p.isidentifier()]
    param = ".".join(path) or None
    got = json.dumps(first.get("input"), default=str)
    got = got if len(got) <= 80 else got[:77] + "..."
    return ApiError(400, f"{param or 'the request body'}: {first['msg']} (got {got})", param=param)


# --------------------------------------------------------------------------- request bodies
class _Body(BaseModel):
    # strict: "5" is not a number and true is not 1; NaN and Infinity (which JSON parsers
    # accept) are refused; fields OpenAI clients send that change nothing here (user, store,
    # metadata...) are allowed and ignored, and the ones that would change the answer are
    # refused by name in _refuse_unsupported.
    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="allow")


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant"]
    content: Union[str, list[TextPart]]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class StreamOptions(_Body):
    include_usage: bool = False


StopString = Annotated[str, Field(min_length=1, max_length=256)]


class _GenerationBody(_Body):
    """The fields both endpoints share, with OpenAI's names and defaults (temperature 1)."""

    model: Optional[str] = None
    max_tokens: Optional[int] = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    n: int = Field(1, ge=1, le=MAX_CHOICES)
    stop: Union[StopString, Annotated[list[StopString], Field(max_length=4)], None] = None
    seed: Optional[int] = Field(None, ge=0, lt=2**64)
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # Not in OpenAI's API, as in vLLM: the engine's other sampling knobs.
    top_k: int = Field(0, ge=-1)  # -1 (vLLM's "off") or 0: every token
    min_p: float = Field(0.0, ge=0, le=1)
    repetition_penalty: float = Field(1.0, gt=0)
    ignore_eos: bool = False

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) != 0:
                raise ApiError(400, f"{name} is not supported: minillm's sampler has repetition_penalty "
                                    "(a multiplicative penalty on every token already seen, transformers' rule) "
                                    "instead; send that field, or leave this one at 0", param=name,
                               code="unsupported_parameter")
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        try:
            return SamplingParams(max_new_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p,
                                  top_k=max(self.top_k, 0), min_p=self.min_p,
                                  repetition_penalty=self.repetition_penalty, stop=stop, seed=self.seed,
                                  ignore_eos=self.ignore_eos)
        except (TypeError, ValueError) as err:  # the fields above are checked already: a second net
            raise ApiError(400, str(err)) from err


class ChatCompletionBody(_GenerationBody):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Optional[int] = Field(None, ge=1)  # the newer name of max_tokens


class CompletionBody(_GenerationBody):
    # a prompt, a list of prompts, token ids, or a list of token-id prompts (as OpenAI accepts)
    prompt: Union[str, list[str], list[int], list[list[int]]]

    def prompts(self) -> list[str | list[int]]:
        prompt = self.prompt
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            return [prompt]  # type: ignore[list-item]
        return list(prompt)  # type: ignore[arg-type]


# OpenAI fields this server cannot honour, with the values that mean "not used".
_UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "logprobs": (None, False), "top_logprobs": (None, 0), "logit_bias": (None, {}), "tools": (None, []),
    "tool_choice": (None, "none", "auto"), "functions": (None, []), "function_call": (None, "none", "auto"),
    "response_format": (None, {"type": "text"}), "best_of": (None, 1), "echo": (None, False), "suffix": (None, ""),
}


def _refuse_unsupported(body: BaseModel) -> None:
    for name, value in (body.model_extra or {}).items():
        if name in _UNSUPPORTED and value not in _UNSUPPORTED[name]:
            raise ApiError(400, f"{name} is not supported by this server", param=name, code="unsupported_parameter")


# --------------------------------------------------------------------------- engine <-> HTTP messages
@dataclass(frozen=True)
class Accepted:
    """The engine queued every choice of the job: the response can start."""


@dataclass(frozen=True)
class Delta:
    index: int  # the choice
    text: str


@dataclass(frozen=True)
class Finished:
    index: int
    finish_reason: str  # OpenAI's: "stop" or "length"
    completion_tokens: int


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

    def send(self, event: Event) -> None:
        """Hand an event to the event loop (from the engine thread): the loop runs the put."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the loop is closed: the server is shutting down and nobody listens
            pass


# --------------------------------------------------------------------------- metrics
class Histogram:
    """A Prometheus histogram: cumulative counts per upper bound, plus the sum and the count."""

    def __init__(self, buckets: Sequence[float]) -> None:
        self.buckets = tuple(buckets)
        self.counts = [0] * len(self.buckets)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        for i, bound in enumerate(self.buckets):
            if value <= bound:
                self.counts[i] += 1
        self.sum += value
        self.count += 1

    def lines(self, name: str) -> list[str]:
        rows = [f'{name}_bucket{{le="{b:g}"}} {c}' for b, c in zip(self.buckets, self.counts)]
        return rows + [f'{name}_bucket{{le="+Inf"}} {self.count}', f"{name}_sum {self.sum:.6f}",
                       f"{name}_count {self.count}"]


@dataclass(frozen=True)
class EngineSnapshot:
    """The engine's state after its latest loop iteration, published by the engine thread (one
    reference assignment), so ``/metrics`` and ``/health`` never read the Engine itself."""

    running: int = 0
    waiting: int = 0
    blocks_free: int = 0
    blocks_total: int = 0
    preemptions: int = 0
    prefix_cache_hits: int = 0  # prompt tokens found in the prefix cache
    prefix_cache_queries: int = 0  # prompt tokens looked up in it


class Metrics:
    """Counters and histograms written by the engine thread and read by ``/metrics``, under a lock."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.prompt_tokens = 0
        self.generated_tokens = 0
        self.finished: dict[str, int] = {"stop": 0, "length": 0, "abort": 0, "error": 0}
        self.ttft = Histogram(TTFT_BUCKETS)
        self.tpot = Histogram(TPOT_BUCKETS)
        self._recent: deque[tuple[float, int]] = deque()  # (when, tokens) of the last RATE_WINDOW_S

    def accepted(self, prompt_tokens: int) -> None:
        with self._lock:
            self.prompt_tokens += prompt_tokens

    def step(self, now: float, tokens: int, first_token_waits: list[float]) -> None:
        with self._lock:
            self.generated_tokens += tokens
            self._recent.append((now, tokens))
            for wait in first_token_waits:
                self.ttft.observe(wait)

    def finish(self, reason: str, tokens: int = 0, decode_seconds: float = 0.0) -> None:
        with self._lock:
            self.finished[reason] += 1
            if tokens > 1:  # time per output token: the decode after the first token, per token
                self.tpot.observe(decode_seconds / (tokens - 1))

    def render(self, engine: EngineSnapshot) -> str:
        """Prometheus' text format: ``# HELP`` and ``# TYPE`` lines, then ``name{labels} value``."""
        with self._lock:
            now = time.perf_counter()
            while self._recent and self._recent[0][0] < now - RATE_WINDOW_S:
                self._recent.popleft()
            rate = sum(tokens for _, tokens in self._recent) / RATE_WINDOW_S
            hits = engine.prefix_cache_hits / engine.prefix_cache_queries if engine.prefix_cache_queries else 0.0
            single: list[tuple[str, str, str, float]] = [
                ("minillm_requests_running", "gauge", "Requests in the running batch.", engine.running),
                ("minillm_requests_waiting", "gauge", "Requests queued for admission.", engine.waiting),
                ("minillm_kv_blocks_used", "gauge", "KV-cache blocks held by requests.",
                 engine.blocks_total - engine.blocks_free),
                ("minillm_kv_blocks_free", "gauge", "KV-cache blocks free.", engine.blocks_free),
                ("minillm_kv_blocks_total", "gauge", "KV-cache blocks in the pool.", engine.blocks_total),
                ("minillm_prefix_cache_hit_rate", "gauge",
                 "Share of prompt tokens found in the prefix cache (0 without one).", round(hits, 6)),
                ("minillm_prefix_cache_hit_tokens_total", "counter",
                 "Prompt tokens found in the prefix cache instead of computed.", engine.prefix_cache_hits),
                ("minillm_prefix_cache_query_tokens_total", "counter",
                 "Prompt tokens admitted (looked up in the prefix cache when it is on).", engine.prefix_cache_queries),
                ("minillm_preemptions_total", "counter",
                 "Requests sent back to the queue because the KV pool ran out.", engine.preemptions),
                ("minillm_prompt_tokens_total", "counter", "Prompt tokens accepted.", self.prompt_tokens),
                ("minillm_generated_tokens_total", "counter", "Tokens generated.", self.generated_tokens),
                ("minillm_generated_tokens_per_second", "gauge",
                 f"Tokens generated per second over the last {RATE_WINDOW_S:g} s.", round(rate, 3)),
            ]
            out: list[str] = []
            for name, kind, help, value in single:
                out += [f"# HELP {name} {help}", f"# TYPE {name} {kind}", f"{name} {value}"]
            name = "minillm_requests_finished_total"
            out += [f"# HELP {name} Engine requests (one per choice) finished, by reason.", f"# TYPE {name} counter"]
            out += [f'{name}{{reason="{reason}"}} {count}' for reason, count in self.finished.items()]
            for name, help, histogram in [
                ("minillm_time_to_first_token_seconds", "From the HTTP request to a choice's first token.", self.ttft),
                ("minillm_time_per_output_token_seconds", "Per choice: decode time after the first token, per token.",
                 self.tpot),
            ]:
                out += [f"# HELP {name} {help}", f"# TYPE {name} histogram", *histogram.lines(name)]
            return "\n".join(out) + "\n"


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
        self.snapshot = EngineSnapshot()
        self.ready = threading.Event()  # set once the decode step is compiled: /health says "ok"
        self.error: str | None = None  # set if the engine thread itself failed: /health says why
        self._commands: queue.Queue[Command | None] = queue.Queue()  # None: stop
        self._owners: dict[Request, tuple[Job, int]] = {}  # unfinished engine request -> (its job, choice index)
        self._first_token_at: dict[Request, float] = {}
        self._thread: threading.Thread | None = None  # set by start()

    # -- called from other threads
    def start(self) -> None:
        """Run the engine loop on a new thread."""
        self._thread = threading.Thread(target=self.run, name="minillm-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """End the loop once the queued commands are done (waiting for its thread if it has one)."""
        self._commands.put(None)
        if self._thread is not None:
            self._thread.join(timeout)

    def submit(self, job: Job) -> None:
        self._commands.put(("add", job))

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
            while (command := self._commands.get()) is not None:
                if command[0] == "add":
                    command[1].send(failure)
        except BaseException:  # Ctrl-C, on the main thread: end every open response on the way out
            self._tell_all(Failed(ApiError(503, "the server is shutting down", type="server_error")))
            raise

    def _tell_all(self, failure: Failed) -> None:
        """Send ``failure`` to every job still running, without touching the engine."""
        for job in {job for job, _ in self._owners.values()}:
            job.send(failure)
        self._owners.clear()

    def _serve(self) -> None:
        if self.warm_up:  # compile the decode step (one row; several rows) before the first user waits for it
            self.engine.generate(["Hello"], SamplingParams(max_new_tokens=2))
            self.engine.generate(["Hello", "Hi"], SamplingParams(max_new_tokens=2))
        self._publish()
        self.ready.set()
        while True:
            for command in self._next_commands():
                if command is None:  # shutting down: end every job, leaving the pool as it was
                    for job in {job for job, _ in self._owners.values()}:
                        self._fail(job, ApiError(503, "the server is shutting down", type="server_error"))
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
                job.send(Delta(index, text))
        self.metrics.step(now, len(events), first_token_waits)

    def _retire(self) -> None:
        """Tell each job which of its choices finished (and why), and count them."""
        now = time.perf_counter()
        for request, (job, index) in list(self._owners.items()):
            if request.finished:
                del self._owners[request]
                reason = FINISH_REASONS[request.finish_reason or "length"]
                first = self._first_token_at.pop(request, now)
                self.metrics.finish(reason, len(request.output_ids), now - first)
                job.send(Finished(index, reason, len(request.output_ids)))

    def _fail(self, job: Job, error: ApiError) -> None:
        for request in job.requests:
            if self._owners.pop(request, None) is not None:
                self.engine.abort(request)
                self._first_token_at.pop(request, None)
                self.metrics.finish("error")
        job.send(Failed(error))

    def _publish(self) -> None:
        engine, allocator = self.engine, self.engine.manager.allocator
        self.snapshot = EngineSnapshot(
            # a request whose prompt is being prefilled in chunks already holds its blocks: running
            running=len(engine.running) + len(engine.prefilling), waiting=len(engine.waiting),
            blocks_free=allocator.num_free, blocks_total=allocator.num_blocks, preemptions=engine.preemptions,
            # prompt tokens found in the prefix cache, of all prompt tokens admitted
            prefix_cache_hits=engine.cached_prompt_tokens,
            prefix_cache_queries=engine.prompt_tokens,
        )


# --------------------------------------------------------------------------- responses
@dataclass(frozen=True)
class _Reply:
    """Builds the OpenAI objects of one response: chat (``message``/``delta``) or text completion."""

    chat: bool
    model: str
    id: str = ""
    created: int = 0

    @classmethod
    def new(cls, chat: bool, model: str) -> _Reply:
        prefix = "chatcmpl" if chat else "cmpl"
        return cls(chat, model, f"{prefix}-{uuid.uuid4().hex}", int(time.time()))

    def _object(self, kind: str, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices,
                **extra}

    def chunk(self, index: int, text: str | None = None, finish_reason: str | None = None,
              role: bool = False) -> dict[str, Any]:
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {}
            if text is not None:
                delta["content"] = text
            choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
            return self._object("chat.completion.chunk", [choice])
        choice = {"index": index, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
        return self._object("text_completion", [choice])

    def usage_chunk(self, usage: dict[str, int]) -> dict[str, Any]:
        return self._object("chat.completion.chunk" if self.chat else "text_completion", [], usage=usage)

    def response(self, texts: list[str], finish_reasons: list[str], usage: dict[str, int]) -> dict[str, Any]:
        if self.chat:
            choices = [{"index": i, "message": {"role": "assistant", "content": t}, "logprobs": None,
                        "finish_reason": r} for i, (t, r) in enumerate(zip(texts, finish_reasons))]
            return self._object("chat.completion", choices, usage=usage)
        choices = [{"index": i, "text": t, "logprobs": None, "finish_reason": r}
                   for i, (t, r) in enumerate(zip(texts, finish_reasons))]
        return self._object("text_completion", choices, usage=usage)


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _sse(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


# --------------------------------------------------------------------------- the server
class _JobStream(StreamingResponse):
    """A streaming response that aborts its job however the response ends: finished (a no-op),
    the client gone (Starlette cancels the stream, even before its first chunk), or an error."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


class Server:
    """The HTTP side: validates requests, tokenizes them, hands jobs to the engine thread and
    turns the events that come back into OpenAI responses."""

    def __init__(self, engine: Engine, model_id: str, aliases: Sequence[str] = (), warm_up: bool = True) -> None:
        # Read before the engine thread starts; afterwards only that thread touches the engine.
        # The tokenizer is shared: encoding here only reads its tables (and its encode cache, a
        # dict whose single reads and writes are atomic), while the engine thread decodes.
        self.tokenizer = engine.tokenizer
        self.context = engine.model.config.max_position_embeddings
        # The most tokens one sequence can hold: the context, or the whole KV pool if smaller.
        self.longest = min(self.context, engine.manager.allocator.num_blocks * engine.cache.block_size)
        self.model_id = model_id
        self.model_names = {name.lower() for name in (model_id, *aliases, "minillm", "default")}
        self.metrics = Metrics()
        self.worker = EngineWorker(engine, self.metrics, warm_up)
        self.started = int(time.time())
        self.page = resources.files("minillm").joinpath("chat.html").read_text(encoding="utf-8")

    # -- routes
    async def chat_completions(self, request: HttpRequest) -> Response:
        arrival = time.perf_counter()
        body = ChatCompletionBody.model_validate_json(await _read_body(request))
        self._check(body)
        prompt_ids = await run_in_threadpool(self._encode_chat, body.messages)
        requested = body.max_completion_tokens or body.max_tokens
        max_tokens = requested if requested is not None else self.longest - len(prompt_ids)  # as long as it can
        self._check_fits(len(prompt_ids), max_tokens, "messages")
        return await self._generate(request, body, [prompt_ids], max_tokens, arrival, chat=True)

    async def completions(self, request: HttpRequest) -> Response:
        arrival = time.perf_counter()
        body = CompletionBody.model_validate_json(await _read_body(request))
        self._check(body)
        prompts = body.prompts()
        if not prompts:
            raise ApiError(400, "prompt: the list of prompts is empty", param="prompt")
        prompt_ids = await run_in_threadpool(lambda: [self._encode_text(p) for p in prompts])
        max_tokens = body.max_tokens if body.max_tokens is not None else COMPLETIONS_DEFAULT_MAX_TOKENS
        for ids in prompt_ids:
            self._check_fits(len(ids), max_tokens, "prompt")
        return await self._generate(request, body, prompt_ids, max_tokens, arrival, chat=False)

    async def models(self) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [
            {"id": self.model_id, "object": "model", "created": self.started, "owned_by": "minillm"}]})

    async def health(self) -> JSONResponse:
        if self.worker.error is not None:
            return JSONResponse({"status": "error", "error": self.worker.error}, status_code=503)
        if not self.worker.ready.is_set():  # compiling the decode step
            return JSONResponse({"status": "loading", "model": self.model_id}, status_code=503)
        return JSONResponse({"status": "ok", "model": self.model_id})

    async def metrics_text(self) -> PlainTextResponse:
        return PlainTextResponse(self.metrics.render(self.worker.snapshot), media_type="text/plain; version=0.0.4")

    async def chat_page(self) -> HTMLResponse:
        return HTMLResponse(self.page.replace("{{MODEL}}", html.escape(self.model_id)))

    # -- validation and tokenization
    def _check(self, body: _GenerationBody) -> None:
        if body.model is not None and body.model.lower() not in self.model_names \
                and body.model.rsplit("/", 1)[-1].lower() not in self.model_names:
            raise ApiError(404, f"The model '{body.model}' does not exist: this server serves '{self.model_id}'",
                           param="model", code="model_not_found")
        _refuse_unsupported(body)
        if body.stream_options is not None and not body.stream:
            raise ApiError(400, "stream_options is only allowed with stream: true", param="stream_options")

    def _refuse_by_size(self, text_bytes: int, param: str) -> None:
        # A token spans at most max_token_bytes bytes, so this many bytes cannot fit the context,
        # whatever the merges: refuse before spending seconds encoding megabytes (the Engine's rule).
        at_least = text_bytes // self.tokenizer.max_token_bytes
        if at_least > self.longest:
            raise ApiError(400, f"{self._limit()}, and the {param} hold at least {at_least} tokens. Please reduce "
                                f"the length of the {param}.", param=param, code="context_length_exceeded")

    def _limit(self) -> str:
        pool = "" if self.longest == self.context else f" (the KV cache's size; the model's context is {self.context})"
        return f"This model's maximum context length is {self.longest} tokens{pool}"

    def _encode_chat(self, messages: list[ChatMessage]) -> list[int]:
        # "developer" is OpenAI's newer name for the system role; chat templates know "system".
        plain = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in messages]
        self._refuse_by_size(sum(len(m["content"].encode("utf-8", "surrogatepass")) for m in plain), "messages")
        try:
            ids = self.tokenizer.apply_chat_template(plain, add_generation_prompt=True)
        except (TypeError, ValueError) as err:  # the template refused the conversation
            raise ApiError(400, f"messages: {err}", param="messages") from err
        assert isinstance(ids, list)
        return ids

    def _encode_text(self, prompt: str | list[int]) -> list[int]:
        if not isinstance(prompt, str):
            return prompt  # token ids: the engine checks them against the vocabulary
        self._refuse_by_size(len(prompt.encode("utf-8", "surrogatepass")), "prompt")
        return self.tokenizer.encode(prompt)  # as Engine.generate encodes a str prompt

    def _check_fits(self, prompt_tokens: int, max_tokens: int, param: str) -> None:
        if prompt_tokens == 0:
            raise ApiError(400, f"{param}: the prompt is empty: it needs at least one token", param=param)
        if max_tokens < 1 or prompt_tokens + max_tokens > self.longest:
            wanted = max(max_tokens, 1)
            raise ApiError(400, f"{self._limit()}. However, you requested {prompt_tokens + wanted} tokens "
                                f"({prompt_tokens} in the {param}, {wanted} in the completion). Please reduce the "
                                f"length of the {param} or completion.", param=param, code="context_length_exceeded")

    # -- generation
    async def _generate(self, request: HttpRequest, body: _GenerationBody, prompts: list[list[int]],
                        max_tokens: int, arrival: float, chat: bool) -> Response:
        if len(prompts) * body.n > MAX_CHOICES:
            raise ApiError(400, f"{len(prompts)} prompts x n={body.n} is more than {MAX_CHOICES} completions",
                           param="n")
        params = body.sampling_params(max_tokens)
        # Choice i of a prompt's n draws from seed + i, as Engine.generate numbers them.
        choices = [(ids, params if params.seed is None else replace(params, seed=(params.seed + i) % 2**64))
                   for ids in prompts for i in range(body.n)]
        job = Job(choices, asyncio.get_running_loop(), arrival)
        self.worker.submit(job)
        first = await job.events.get()
        if isinstance(first, Failed):
            raise first.error
        reply = _Reply.new(chat, self.model_id)
        prompt_tokens = sum(len(ids) for ids in prompts)
        if body.stream:
            include_usage = body.stream_options is not None and body.stream_options.include_usage
            return _JobStream(self._stream(job, reply, prompt_tokens, include_usage), lambda: self.worker.abort(job))
        return JSONResponse(await self._collect(job, reply, prompt_tokens, request))

    async def _stream(self, job: Job, reply: _Reply, prompt_tokens: int, include_usage: bool) -> AsyncIterator[str]:
        """The Server-Sent Events of one job: a role chunk per choice (chat), the text as it comes,
        a chunk with each choice's finish reason, the usage if asked for, then ``[DONE]``."""
        finished = completion_tokens = 0
        if reply.chat:
            for index in range(len(job.choices)):
                yield _sse(reply.chunk(index, role=True))
        while finished < len(job.choices):
            event = await job.events.get()
            if isinstance(event, Delta):
                yield _sse(reply.chunk(event.index, event.text))
            elif isinstance(event, Finished):
                finished += 1
                completion_tokens += event.completion_tokens
                yield _sse(reply.chunk(event.index, finish_reason=event.finish_reason))
            elif isinstance(event, Failed):  # the status line is sent already: the error goes in the stream
                yield _sse(event.error.body())
                break
        else:
            if include_usage:
                yield _sse(reply.usage_chunk(_usage(prompt_tokens, completion_tokens)))
        yield "data: [DONE]\n\n"

    async def _collect(self, job: Job, reply: _Reply, prompt_tokens: int, request: HttpRequest) -> dict[str, Any]:
        """The whole answer of a non-streaming request; aborted if the client disconnects meanwhile."""
        n = len(job.choices)
        texts, reasons = [""] * n, ["length"] * n
        finished = completion_tokens = 0
        watcher = asyncio.create_task(_end_on_disconnect(request, job))
        try:
            while finished < n:
                event = await job.events.get()
                if isinstance(event, Delta):
                    texts[event.index] += event.text
                elif isinstance(event, Finished):
                    finished += 1
                    completion_tokens += event.completion_tokens
                    reasons[event.index] = event.finish_reason
                elif isinstance(event, Failed):
                    raise event.error
        finally:
            watcher.cancel()
            if finished < n:
                self.worker.abort(job)
        return reply.response(texts, reasons, _usage(prompt_tokens, completion_tokens))


async def _end_on_disconnect(request: HttpRequest, job: Job) -> None:
    """Wait for the client of a non-streaming request to go away, then end the wait for its
    answer. (Its body is read: the only message still to come is the disconnect.)"""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    job.events.put_nowait(Failed(ApiError(499, "the client closed the connection")))


async def _read_body(request: HttpRequest) -> bytes:
    """The request body, refused (413) as soon as it grows past MAX_BODY_BYTES."""
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise ApiError(413, f"the request body is larger than {MAX_BODY_BYTES // 2**20} MiB",
                           code="request_too_large")
        chunks.append(chunk)
    return b"".join(chunks)


def create_app(engine: Engine, model_id: str = "SmolLM2-135M-Instruct", aliases: Sequence[str] = (),
               warm_up: bool = True, engine_thread: bool = True) -> FastAPI:
    """The FastAPI app serving ``engine``. The engine loop first compiles the decode step (unless
    ``warm_up=False``; ``/health`` is 503 until then). The app's lifespan starts it on a thread of
    its own, or, with ``engine_thread=False``, leaves it to the caller (``run_server``), and stops it.

    ``model_id`` is the name ``/v1/models`` lists; requests may name it, one of ``aliases``,
    ``"minillm"``, ``"default"``, or a path ending in one of those (``HuggingFaceTB/SmolLM2-135M-Instruct``).
    From the moment the app starts, ``engine`` belongs to the engine thread: do not use it elsewhere.
    """
    server = Server(engine, model_id, aliases, warm_up)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if engine_thread:
            server.worker.start()
        yield
        await run_in_threadpool(server.worker.stop)

    app = FastAPI(title="minillm", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = server
    app.post("/v1/chat/completions")(server.chat_completions)
    app.post("/v1/completions")(server.completions)
    app.get("/v1/models")(server.models)
    app.get("/health")(server.health)
    app.get("/metrics")(server.metrics_text)
    app.get("/")(server.chat_page)

    @app.exception_handler(ApiError)
    async def api_error(request: HttpRequest, err: ApiError) -> JSONResponse:
        return JSONResponse(err.body(), status_code=err.status)

    @app.exception_handler(ValidationError)
    async def invalid_body(request: HttpRequest, err: ValidationError) -> JSONResponse:
        error = _validation_error(err)
        return JSONResponse(error.body(), status_code=error.status)

    @app.exception_handler(HTTPException)
    async def http_error(request: HttpRequest, err: HTTPException) -> JSONResponse:  # unknown path, wrong method
        return JSONResponse(ApiError(err.status_code, str(err.detail)).body(), status_code=err.status_code)

    @app.exception_handler(Exception)
    async def server_error(request: HttpRequest, err: Exception) -> JSONResponse:  # a bug: still OpenAI's shape
        error = ApiError(500, f"internal error: {type(err).__name__}: {err}", type="server_error")
        return JSONResponse(error.body(), status_code=500)

    return app


def model_name(source: str | None) -> str:
    """The id ``/v1/models`` shows for a ``--model`` path: the file or folder name, without ``.gguf``."""
    if source is None:
        return "SmolLM2-135M-Instruct"
    name = str(source).rstrip("/\\").replace("\\", "/").rsplit("/", 1)[-1]
    return name[: -len(".gguf")] if name.lower().endswith(".gguf") else name


def run_server(engine: Engine, sock: socket.socket, model_id: str, log_level: str = "info") -> None:
    """Serve on ``sock`` until Ctrl-C: the engine loop on this thread, uvicorn on a second one.

    Why this way round: torch runs its CPU kernels on a team of OpenMP threads belonging to the
    thread that calls them. The model was loaded on this thread, so its team exists; an engine
    loop on another thread starts a second team, and on the 2-core course machine each step
    was then ~1.5x slower (64 greedy tokens by HTTP: 22 tokens/s, against 36 with the loop
    here, the same as ``Engine.generate``). The event loop never calls torch.
    """
    app = create_app(engine, model_id, engine_thread=False)
    worker = app.state.server.worker
    logs = copy.deepcopy(uvicorn.config.LOGGING_CONFIG)
    logs["handlers"]["access"]["stream"] = "ext://sys.stderr"  # the CLI keeps stdout for results
    server = uvicorn.Server(uvicorn.Config(app, log_level=log_level, log_config=logs))

    def http() -> None:
        try:
            server.run(sockets=[sock])
        finally:
            worker.stop()  # the engine loop ends with the web server, whatever ended it

    web = threading.Thread(target=http, name="minillm-http", daemon=True)  # a second Ctrl-C does not wait
    web.start()
    try:
        worker.run()
    finally:  # Ctrl-C lands here, on the main thread: the open responses have ended, stop the server
        server.should_exit = True
        web.join()
