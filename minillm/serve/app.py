"""The HTTP side: FastAPI routes around one ``EngineWorker``, ``create_app`` and ``run_server``.

A handler reads and validates the body (``protocol``), tokenizes it in a worker thread (a long
prompt must not stall the other connections), checks that it fits the context, then hands a
``Job`` to the engine thread and turns the events that come back into OpenAI's JSON: one object,
or Server-Sent Events with ``stream``. However a response ends (done, the client gone, an
error), what is left of its job is aborted, so its KV blocks go back to the pool.

In front of the routes, two ASGI middlewares: ``security.Guard`` (which requests get in: Host,
Origin, API key, Content-Type) and ``shutdown.DrainMiddleware`` (the requests in flight, and 503s
once the server is stopping).
"""

from __future__ import annotations

import asyncio
import html
import signal
import socket
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from contextlib import asynccontextmanager
from dataclasses import replace
from importlib import resources
from typing import Any

import uvicorn
from fastapi import FastAPI
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request as HttpRequest

from minillm.engine import Engine
from minillm.sampling import SamplingParams
from minillm.serve.metrics import Metrics
from minillm.serve.protocol import (
    COMPLETIONS_DEFAULT_MAX_TOKENS,
    MAX_CHOICES,
    ApiError,
    ChatCompletionBody,
    ChatMessage,
    CompletionBody,
    GenerationBody,
    Reply,
    clip,
    parse_body,
    read_body,
    refuse_unsupported,
    validation_error,
)
from minillm.serve.responses import collect_events, stream_events
from minillm.serve.security import Guard, Policy, is_loopback, page_headers, uvicorn_config
from minillm.serve.shutdown import Drain, DrainMiddleware, SignalStop
from minillm.serve.tools import ToolError, ToolPlan, render_calls, with_tools
from minillm.serve.worker import EngineWorker, Failed, Job
from minillm.structured import token_index


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

    def __init__(self, engine: Engine, model_id: str, aliases: Sequence[str] = (), warm_up: bool = True,
                 policy: Policy | None = None, request_timeout: float = 30.0) -> None:
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
        self.policy, self.request_timeout = policy or Policy(), request_timeout
        self.drain = Drain()
        self.loop: asyncio.AbstractEventLoop | None = None  # the event loop serving the app, once it runs
        page = resources.files("minillm").joinpath("chat.html").read_text(encoding="utf-8")
        self.page = page.replace("{{MODEL}}", html.escape(model_id)).replace(
            "{{AUTH}}", "bearer" if self.policy.api_key else "none")  # the page asks for a key if one is needed
        self.page_headers = page_headers(self.page)

    # -- routes
    async def chat_completions(self, request: HttpRequest) -> Response:
        arrival = time.perf_counter()
        body = parse_body(ChatCompletionBody, await read_body(request, self.request_timeout))
        self._check(body)
        try:
            tools = ToolPlan.parse(body.tools, body.tool_choice)
        except ToolError as err:
            raise ApiError(400, str(err), param=err.param) from err
        prompt_ids = await run_in_threadpool(self._encode_chat, body.messages, tools)
        requested = body.max_completion_tokens or body.max_tokens
        max_tokens = requested if requested is not None else self.longest - len(prompt_ids)  # as long as it can
        self._check_fits(len(prompt_ids), max_tokens, "messages")
        return await self._generate(request, body, [prompt_ids], max_tokens, arrival, chat=True, tools=tools)

    async def completions(self, request: HttpRequest) -> Response:
        arrival = time.perf_counter()
        body = parse_body(CompletionBody, await read_body(request, self.request_timeout))
        self._check(body)
        prompts = body.prompts()
        if not prompts:
            raise ApiError(400, "prompt: the list of prompts is empty", param="prompt")
        if len(prompts) * body.n > MAX_CHOICES:  # counts and sizes first: no prompt is encoded before
            raise ApiError(400, f"{len(prompts)} prompts x n={body.n} is more than {MAX_CHOICES} completions",
                           param="n")
        max_tokens = body.max_tokens if body.max_tokens is not None else COMPLETIONS_DEFAULT_MAX_TOKENS
        for prompt in prompts:
            if isinstance(prompt, str):
                self._refuse_by_size(len(prompt.encode("utf-8", "surrogatepass")), "prompt")
            else:
                self._check_fits(len(prompt), max_tokens, "prompt", least=0)
        prompt_ids = await run_in_threadpool(lambda: [self._encode_text(p) for p in prompts])
        for ids in prompt_ids:
            self._check_fits(len(ids), max_tokens, "prompt", least=0)
        if max_tokens == 0 and not body.echo:
            raise ApiError(400, "max_tokens: 0 generates nothing: it is only allowed with echo", param="max_tokens")
        return await self._generate(request, body, prompt_ids, max_tokens, arrival, chat=False,
                                    echo=[p if isinstance(p, str) else self.tokenizer.decode(ids)
                                          for p, ids in zip(prompts, prompt_ids)] if body.echo else None)

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
        return PlainTextResponse(self.metrics.render(), media_type="text/plain; version=0.0.4")

    async def chat_page(self) -> HTMLResponse:
        return HTMLResponse(self.page, headers=self.page_headers)

    # -- validation and tokenization
    def _check(self, body: GenerationBody) -> None:
        if body.model is not None and body.model.lower() not in self.model_names \
                and body.model.rsplit("/", 1)[-1].lower() not in self.model_names:
            raise ApiError(404, f"The model '{clip(body.model)}' does not exist: this server serves "
                                f"'{self.model_id}'", param="model", code="model_not_found")
        refuse_unsupported(body)
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

    def _encode_chat(self, messages: list[ChatMessage], tools: ToolPlan | None = None) -> list[int]:
        # "developer" is OpenAI's newer name for the system role; chat templates know "system".
        # An earlier call is shown as the JSON the model writes for one (``tools.render_calls``).
        plain = [{"role": "system" if m.role == "developer" else m.role,
                  "content": "\n".join(filter(None, [m.text(), render_calls(m.tool_calls or [])]))}
                 for m in messages]
        plain = with_tools(plain, tools)
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
        return self.tokenizer.encode(prompt)  # as Engine.generate encodes a str prompt

    def _check_fits(self, prompt_tokens: int, max_tokens: int, param: str, least: int = 1) -> None:
        """The prompt and ``max_tokens`` (at least ``least``: 0 only for an echoed prompt) fit the context."""
        if prompt_tokens == 0:
            raise ApiError(400, f"{param}: the prompt is empty: it needs at least one token", param=param)
        if max_tokens < least or prompt_tokens + max_tokens > self.longest:
            wanted = max(max_tokens, least)
            raise ApiError(400, f"{self._limit()}. However, you requested {prompt_tokens + wanted} tokens "
                                f"({prompt_tokens} in the {param}, {wanted} in the completion). Please reduce the "
                                f"length of the {param} or completion.", param=param, code="context_length_exceeded")

    def _grammar_index(self, params: SamplingParams) -> None:
        """Compile the response_format's automaton into the shared index cache (bounded in time
        by the automaton's limits), so a schema too large is a 400 and the engine's thread, which
        finds the index cached, never stalls the other streams building it."""
        engine = self.worker.engine
        try:
            token_index(params.response_format.pattern, engine.tokenizer, engine.eos_ids)  # type: ignore[union-attr]
        except ValueError as err:
            raise ApiError(400, f"response_format: {err}", param="response_format",
                           code="invalid_response_format") from err

    # -- generation
    async def _generate(self, request: HttpRequest, body: GenerationBody, prompts: list[list[int]],
                        max_tokens: int, arrival: float, chat: bool, echo: list[str] | None = None,
                        tools: ToolPlan | None = None) -> Response:
        """Run the job; ``echo``: each prompt's text, to come back before its completion (with its
        tokens' log-probabilities, scored on the engine's thread, when logprobs are asked for)."""
        params = body.sampling_params(max_tokens, tools.response_format() if tools is not None else None)
        if params.response_format is not None:  # build the automaton here, not in the engine's thread
            await run_in_threadpool(self._grammar_index, params)
        # Choice i of a prompt's n draws from seed + i, as Engine.generate numbers them.
        choices = [(ids, params if params.seed is None else replace(params, seed=(params.seed + i) % 2**64))
                   for ids in prompts for i in range(body.n)]
        job = Job(choices, asyncio.get_running_loop(), arrival)
        if echo is not None and params.logprobs is not None:
            job.score_prompts, job.score_top = prompts, params.logprobs
        self.worker.submit(job)
        first = await job.events.get()
        if isinstance(first, Failed):
            raise first.error
        reply = Reply.new(chat, self.model_id)
        prompt_tokens = sum(len(ids) for ids in prompts)
        # choice i answers prompt i // n: it echoes that prompt
        echoed = None if echo is None else \
            [(echo[i // body.n], job.scores[i // body.n] if job.scores else None) for i in range(len(choices))]
        if body.stream:
            include_usage = body.stream_options is not None and body.stream_options.include_usage
            return _JobStream(stream_events(job, reply, prompt_tokens, include_usage, echoed, tools),
                              lambda: self.worker.abort(job))
        return JSONResponse(await collect_events(job, reply, prompt_tokens, request, self.worker.abort, echoed,
                                                 tools))

    # -- stopping (see ``shutdown``)
    async def shutdown(self, grace: float) -> None:
        """Refuse new requests (503), give the ones in flight ``grace`` seconds to finish, then stop
        the engine loop, which ends the rest (an error event and ``[DONE]``, or a 503)."""
        if self.drain.draining:
            return
        self.drain.draining = True
        await self.drain.wait_idle(grace)
        await run_in_threadpool(self.worker.stop)


def create_app(engine: Engine, model_id: str = "SmolLM2-135M-Instruct", aliases: Sequence[str] = (),
               warm_up: bool = True, engine_thread: bool = True, *, api_key: str | None = None,
               allowed_hosts: Iterable[str] = (), cors_origins: Iterable[str] = (),
               request_timeout: float = 30.0) -> FastAPI:
    """The FastAPI app serving ``engine``. The engine loop first compiles the decode step (unless
    ``warm_up=False``; ``/health`` is 503 until then). The app's lifespan starts it on a thread of
    its own, or, with ``engine_thread=False``, leaves it to the caller (``run_server``), and stops it.

    ``model_id`` is the name ``/v1/models`` lists; requests may name it, one of ``aliases``,
    ``"minillm"``, ``"default"``, or a path ending in one of those (``HuggingFaceTB/SmolLM2-135M-Instruct``).
    From the moment the app starts, ``engine`` belongs to the engine thread: do not use it elsewhere.

    Who may call it (``security``): requests whose ``Host`` is localhost, an IP address or one of
    ``allowed_hosts`` (``"*"``: any); pages of this origin or of ``cors_origins``; with ``api_key``,
    only requests that send it (the chat page and ``/health`` stay open). A request body must arrive
    within ``request_timeout`` seconds.
    """
    policy = Policy.of(allowed_hosts, cors_origins, api_key)
    server = Server(engine, model_id, aliases, warm_up, policy, request_timeout)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        server.loop = asyncio.get_running_loop()
        if engine_thread:
            server.worker.start()
        yield
        await run_in_threadpool(server.worker.stop)

    app = FastAPI(title="minillm", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(DrainMiddleware, drain=server.drain)
    app.add_middleware(Guard, policy=policy)  # added last: the outer one, the first a request meets
    app.state.server = server
    app.post("/v1/chat/completions")(server.chat_completions)
    app.post("/v1/completions")(server.completions)
    app.get("/v1/models")(server.models)
    app.get("/health")(server.health)
    app.get("/metrics")(server.metrics_text)
    app.get("/")(server.chat_page)

    @app.exception_handler(ApiError)
    async def api_error(request: HttpRequest, err: ApiError) -> JSONResponse:
        # 408, 413, 499: the body was not read to its end, so the connection cannot carry another request
        headers = {"Connection": "close"} if err.status in (408, 413, 499) else None
        return JSONResponse(err.body(), status_code=err.status, headers=headers)

    @app.exception_handler(ValidationError)
    async def invalid_body(request: HttpRequest, err: ValidationError) -> JSONResponse:
        error = validation_error(err)
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


def run_server(engine: Engine, sock: socket.socket, model_id: str, log_level: str = "info", *,
               shutdown_timeout: float = 5.0, request_timeout: float = 30.0, api_key: str | None = None,
               allowed_hosts: Iterable[str] = (), cors_origins: Iterable[str] = ()) -> int | None:
    """Serve on ``sock`` until SIGINT (Ctrl-C) or SIGTERM, then stop gracefully: new requests get
    503, the open ones ``shutdown_timeout`` seconds to finish before they are ended (``shutdown``).
    Returns the signal that stopped it (None if uvicorn stopped by itself). The other options are
    ``create_app``'s; bound to an address other than loopback, the machine's name is an allowed host.

    The engine loop runs on this thread, uvicorn on a second one. Why this way round: torch runs
    its CPU kernels on a team of OpenMP threads belonging to the thread that calls them. The model
    was loaded on this thread, so its team exists; an engine loop on another thread starts a second
    team, and on the 2-core course machine each step was then ~1.5x slower (64 greedy tokens by
    HTTP: 22 tokens/s, against 36 with the loop here, the same as ``Engine.generate``). The event
    loop never calls torch.
    """
    address = sock.getsockname()[0]
    if not is_loopback(address):  # serving the network: the machine's name is one of the server's
        name = socket.gethostname().lower()
        allowed_hosts = [*allowed_hosts, name, f"{name}.local"]
        if not api_key:
            print(f"minillm: WARNING: listening on {address} with no API key: anyone who can reach this port "
                  "can use the server. Set --api-key (or MINILLM_API_KEY).", file=sys.stderr)
    app = create_app(engine, model_id, engine_thread=False, api_key=api_key, allowed_hosts=allowed_hosts,
                     cors_origins=cors_origins, request_timeout=request_timeout)
    server: Server = app.state.server
    web = uvicorn.Server(uvicorn_config(app, log_level, request_timeout))
    stop = SignalStop(server, shutdown_timeout)

    def http() -> None:
        try:
            web.run(sockets=[sock])
        finally:
            server.worker.stop()  # the engine loop ends with the web server, whatever ended it

    thread = threading.Thread(target=http, name="minillm-http", daemon=True)  # a second Ctrl-C does not wait
    with stop.installed():
        thread.start()
        try:
            server.worker.run()  # until Server.shutdown stops it
        except KeyboardInterrupt:  # a second signal, or one before the engine was ready: it ended every job
            pass
        web.should_exit = True  # every job has ended: uvicorn closes its socket and connections (<= 1 s)
        thread.join(shutdown_timeout + 5)
    pool = engine.manager.allocator
    by = f" by {signal.Signals(stop.signal).name}" if stop.signal else ""
    print(f"minillm: stopped{by}: {server.worker.ended_by_stop} open request(s) ended by the shutdown; "
          f"KV blocks free: {pool.num_free} of {pool.num_blocks}", file=sys.stderr)
    return stop.signal
