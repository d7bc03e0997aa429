"""OpenAI's side of the wire: the request bodies, their validation, the error JSON, the replies.

Everything here is plain data in and out, with no engine and no event loop: pydantic models
parse and check a body (strictly: a bad field is a 400 that names it, before any work is done),
``ApiError`` is every refusal in OpenAI's ``{"error": {...}}`` shape, and ``Reply`` builds the
response objects, whole or as the chunks of a Server-Sent Events stream (``sse``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Literal, Optional, TypeVar, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.requests import ClientDisconnect
from starlette.requests import Request as HttpRequest

from minillm.sampling import SamplingParams
from minillm.sampling.params import MAX_COMPLETIONS, MAX_LOGPROBS, REPETITION_PENALTY_RANGE
from minillm.structured import ResponseFormat

log = logging.getLogger("minillm.serve")

# Limits checked before any work that grows with what they limit (parsing aside, which the body's
# size bounds): a request over one is refused by name, never after seconds of tokenizing.
MAX_BODY_BYTES = 8 * 2**20  # a request body larger than this is refused (413) before it is parsed
MAX_CHOICES = MAX_COMPLETIONS  # prompts x n of one request: each choice is an engine request with its own state
MAX_MESSAGES = 4096  # messages in one chat request (each costs the chat template a loop turn)
MAX_CONTENT_PARTS = 256  # text parts in one message's content
MAX_PROMPT_IDS = 2**17  # token ids in one prompt (past every context minillm loads; the context is checked next)
MAX_TOOL_CALLS = 64  # tool calls in one earlier assistant turn
ECHO_CHARS = 100  # a user string quoted in an error message is cut to this many characters
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions (chat: as many as fit)
# The engine's finish reasons in OpenAI's words: EOS and a stop string are both "stop".
FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length"}


# --------------------------------------------------------------------------- errors
class ApiError(Exception):
    """A request the server refuses, answered as OpenAI does: ``{"error": {message, type, param, code}}``."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error") -> None:
        message = clip(message, 1000)  # a net: the strings a message quotes are clipped already
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def clip(text: str, limit: int = ECHO_CHARS) -> str:
    """``text`` cut to ``limit`` characters (and an ellipsis): a 1 MiB model name is not echoed whole."""
    return text if len(text) <= limit else text[:limit] + "…"


def shutting_down() -> ApiError:
    """The answer to a request the server will not finish: it is stopping."""
    return ApiError(503, "the server is shutting down", type="server_error", code="server_shutting_down")


def validation_error(err: ValidationError) -> ApiError:
    """The first problem pydantic found, named by its path in the request (``messages.0.role``)."""
    errors = err.errors(include_url=False)
    first = errors[0]
    # A union (stop: a str or a list of str) reports one error per alternative: an error of
    # value ("too long") says more than one of type ("not a string").
    same_field = [e for e in errors if e["loc"][:1] == first["loc"][:1]]
    first = next((e for e in same_field if not e["type"].endswith("_type")), first)
    # The alternatives also appear in the path, as type names ("prompt.list[int].1"): drop them.
    path = [str(p) for p in first["loc"] if isinstance(p, int) or p.isidentifier() and p not in _TYPE_NAMES]
    param = ".".join(path) or None
    got = _preview(first.get("input"))
    return ApiError(400, f"{param or 'the request body'}: {first['msg']} (got {got})", param=param)


_TYPE_NAMES = {"str", "int", "float", "bool"}


def _preview(value: Any) -> str:
    """The start of a refused value, as JSON (of a long list, only its first items are written out)."""
    if isinstance(value, list) and len(value) > 8:
        return clip(json.dumps(value[:8], default=str)[:-1] + f", ... ({len(value)} items)]", 80)
    return clip(json.dumps(clip(value, 80) if isinstance(value, str) else value, default=str), 80)


def _at_most(items: Any, limit: int, what: str, param: str) -> None:
    if isinstance(items, list) and len(items) > limit:
        raise ApiError(400, f"{param}: at most {limit} {what} are allowed, got {len(items)}", param=param)


# --------------------------------------------------------------------------- request bodies
class _Body(BaseModel):
    # strict: "5" is not a number and true is not 1; NaN and Infinity (which JSON parsers
    # accept) are refused; fields OpenAI clients send that change nothing here (user, store,
    # metadata...) are allowed and ignored, and the ones that would change the answer are
    # refused by name in refuse_unsupported.
    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="allow")


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[TextPart], None]  # None only for an assistant turn that called tools
    tool_calls: Optional[Annotated[list[dict[str, Any]], Field(max_length=MAX_TOOL_CALLS)]] = None
    tool_call_id: Optional[str] = None  # a tool turn: the call it answers

    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class StreamOptions(_Body):
    include_usage: bool = False


StopString = Annotated[str, Field(min_length=1, max_length=256)]


class GenerationBody(_Body):
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
    repetition_penalty: float = Field(1.0, ge=REPETITION_PENALTY_RANGE[0], le=REPETITION_PENALTY_RANGE[1])
    ignore_eos: bool = False
    # token id (a JSON key, so a string) -> a bias in [-100, 100], added to the logit
    logit_bias: Optional[dict[str, float]] = None
    # {"type": "text" | "json_object" | "json_schema" | "regex", ...}: see minillm.structured.constraint
    response_format: Optional[dict[str, Any]] = None

    @classmethod
    def check_counts(cls, data: Any) -> None:
        """Refuse a body whose lists are past their limits, before each of their items is validated."""

    def logprobs_count(self) -> int | None:
        """How many alternatives to report per token, or None for no logprobs at all."""
        return None

    def sampling_params(self, max_tokens: int, tool_format: dict[str, Any] | None = None) -> SamplingParams:
        """The engine's parameters; ``tool_format``: the constraint of a required tool call."""
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) != 0:
                raise ApiError(400, f"{name} is not supported: minillm's sampler has repetition_penalty "
                                    "(a multiplicative penalty on every token already seen, transformers' rule) "
                                    "instead; send that field, or leave this one at 0", param=name,
                               code="unsupported_parameter")
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        if tool_format is not None and self.response_format not in (None, {"type": "text"}):
            raise ApiError(400, "response_format cannot be combined with a required tool call: the call's "
                                "arguments follow the tool's parameters", param="response_format")
        try:  # a schema or pattern outside what minillm supports is named here, before any work
            response_format = ResponseFormat.parse(tool_format or self.response_format)
        except (TypeError, ValueError) as err:
            raise ApiError(400, f"response_format: {err}", param="response_format",
                           code="invalid_response_format") from err
        try:
            return SamplingParams(max_new_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p,
                                  top_k=max(self.top_k, 0), min_p=self.min_p,
                                  repetition_penalty=self.repetition_penalty, stop=stop, seed=self.seed,
                                  ignore_eos=self.ignore_eos, response_format=response_format,
                                  logit_bias=self.logit_bias or {}, logprobs=self.logprobs_count())
        except (TypeError, ValueError) as err:  # the fields above are checked already: a second net
            raise ApiError(400, str(err)) from err


class ChatCompletionBody(GenerationBody):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Optional[int] = Field(None, ge=1)  # the newer name of max_tokens
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: Optional[list[Any]] = None  # checked by minillm.serve.tools.ToolPlan.parse
    tool_choice: Union[str, dict[str, Any], None] = None
    parallel_tool_calls: Optional[bool] = None  # accepted: at most one call per turn either way

    def logprobs_count(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None

    @classmethod
    def check_counts(cls, data: Any) -> None:
        messages = data.get("messages") if isinstance(data, dict) else None
        _at_most(messages, MAX_MESSAGES, "messages", "messages")
        for i, message in enumerate(messages if isinstance(messages, list) else ()):
            content = message.get("content") if isinstance(message, dict) else None
            _at_most(content, MAX_CONTENT_PARTS, "content parts", f"messages.{i}.content")


class CompletionBody(GenerationBody):
    # a prompt, a list of prompts, token ids, or a list of token-id prompts (as OpenAI accepts)
    prompt: Union[str, list[str], list[int], list[list[int]]]
    logprobs: Optional[int] = Field(None, ge=0, le=MAX_LOGPROBS)  # the legacy API: a count, not a flag
    echo: bool = False  # the prompt comes back before the completion (with its tokens' logprobs, if asked)
    max_tokens: Optional[int] = Field(None, ge=0)  # 0: score the prompt only (with echo), generate nothing

    def logprobs_count(self) -> int | None:
        return self.logprobs

    @classmethod
    def check_counts(cls, data: Any) -> None:
        prompt = data.get("prompt") if isinstance(data, dict) else None
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
            _at_most(prompt, MAX_PROMPT_IDS, "token ids in a prompt", "prompt")
        elif isinstance(prompt, list):  # more prompts than MAX_CHOICES could never be answered
            _at_most(prompt, MAX_CHOICES, "prompts", "prompt")
            for i, one in enumerate(prompt):
                _at_most(one, MAX_PROMPT_IDS, "token ids in a prompt", f"prompt.{i}")

    def prompts(self) -> list[str | list[int]]:
        prompt = self.prompt
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            return [prompt]  # type: ignore[list-item]
        return list(prompt)  # type: ignore[arg-type]


# OpenAI fields this server cannot honour, with the values that mean "not used".
_UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "functions": (None, []), "function_call": (None, "none", "auto"), "best_of": (None, 1), "suffix": (None, ""),
}


def refuse_unsupported(body: BaseModel) -> None:
    for name, value in (body.model_extra or {}).items():
        if name in _UNSUPPORTED and value not in _UNSUPPORTED[name]:
            raise ApiError(400, f"{name} is not supported by this server", param=name, code="unsupported_parameter")


# --------------------------------------------------------------------------- responses
@dataclass(frozen=True)
class TokenLogprobs:
    """One generated token for the wire: its text and bytes (a token may hold part of a UTF-8
    character: ``token`` then shows U+FFFD and ``token_bytes`` the truth), its log-probability,
    and the best alternatives as (text, bytes, log-probability)."""

    token: str
    token_bytes: bytes
    logprob: float | None  # None: the first token of an echoed prompt, which nothing predicts
    top: tuple[tuple[str, bytes, float], ...] = ()

    @classmethod
    def of(cls, token_id: int, logprob: float | None, top: Sequence[tuple[int, float]],
           decode_bytes: Callable[[list[int]], bytes]) -> TokenLogprobs:
        """From token ids, with ``decode_bytes`` (the tokenizer's) giving each token's bytes."""
        def text(i: int) -> tuple[str, bytes]:
            raw = decode_bytes([i])
            return raw.decode("utf-8", "replace"), raw
        return cls(*text(token_id), logprob, tuple((*text(i), v) for i, v in top))


@dataclass(frozen=True)
class Reply:
    """Builds the OpenAI objects of one response: chat (``message``/``delta``) or text completion."""

    chat: bool
    model: str
    id: str = ""
    created: int = 0

    @classmethod
    def new(cls, chat: bool, model: str) -> Reply:
        prefix = "chatcmpl" if chat else "cmpl"
        return cls(chat, model, f"{prefix}-{uuid.uuid4().hex}", int(time.time()))

    def _object(self, kind: str, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices,
                **extra}

    def chunk(self, index: int, text: str | None = None, finish_reason: str | None = None,
              role: bool = False, logprobs: list[TokenLogprobs] | None = None, offset: int = 0,
              tool_calls: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        """One streamed chunk of choice ``index``; ``logprobs``, when asked for, are those of the
        tokens this chunk brings (``offset``: where its text starts in the choice's, for the legacy
        API's ``text_offset``)."""
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {}
            if text is not None:
                delta["content"] = text
            if tool_calls:  # a streamed call: whole, in one delta (with its place in the list)
                delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(tool_calls)]
            choice = {"index": index, "delta": delta, "logprobs": self._logprobs(logprobs, offset),
                      "finish_reason": finish_reason}
            return self._object("chat.completion.chunk", [choice])
        choice = {"index": index, "text": text or "", "logprobs": self._logprobs(logprobs, offset),
                  "finish_reason": finish_reason}
        return self._object("text_completion", [choice])

    def _logprobs(self, entries: list[TokenLogprobs] | None, offset: int = 0) -> dict[str, Any] | None:
        """OpenAI's two shapes: chat's ``{"content": [{token, logprob, bytes, top_logprobs}]}``, and
        the legacy completions' parallel lists (tokens, token_logprobs, top_logprobs, text_offset)."""
        if entries is None:
            return None
        if self.chat:
            return {"content": [{"token": e.token, "logprob": e.logprob, "bytes": list(e.token_bytes),
                                 "top_logprobs": [{"token": t, "logprob": lp, "bytes": list(b)} for t, b, lp in e.top]}
                                for e in entries]}
        offsets = []
        for e in entries:
            offsets.append(offset)
            offset += len(e.token)
        return {"tokens": [e.token for e in entries], "token_logprobs": [e.logprob for e in entries],
                "top_logprobs": [None if e.logprob is None else {t: lp for t, _, lp in e.top} for e in entries],
                "text_offset": offsets}

    def usage_chunk(self, usage: dict[str, int]) -> dict[str, Any]:
        return self._object("chat.completion.chunk" if self.chat else "text_completion", [], usage=usage)

    def response(self, texts: list[str], finish_reasons: list[str], usage: dict[str, int],
                 logprobs: list[list[TokenLogprobs] | None] | None = None,
                 tool_calls: list[list[dict[str, Any]] | None] | None = None) -> dict[str, Any]:
        logprobs = logprobs or [None] * len(texts)
        tool_calls = tool_calls or [None] * len(texts)
        if self.chat:
            choices = []
            for i, (t, r, lp, calls) in enumerate(zip(texts, finish_reasons, logprobs, tool_calls)):
                message = {"role": "assistant", "content": None, "tool_calls": calls} if calls else \
                    {"role": "assistant", "content": t}
                choices.append({"index": i, "message": message, "logprobs": self._logprobs(lp), "finish_reason": r})
            return self._object("chat.completion", choices, usage=usage)
        choices = [{"index": i, "text": t, "logprobs": self._logprobs(lp), "finish_reason": r}
                   for i, (t, r, lp) in enumerate(zip(texts, finish_reasons, logprobs))]
        return self._object("text_completion", choices, usage=usage)


def token_usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def sse(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


Body = TypeVar("Body", bound=GenerationBody)


def parse_body(model: type[Body], raw: bytes) -> Body:
    """Parse a request body and validate it as ``model``: the JSON first, then the lengths of its
    lists (``check_counts``), and only then each field and item. (pydantic would validate every
    item of a 1,000,000-item list before finding the list too long.)"""
    try:
        data = json.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError) as err:  # not UTF-8, not JSON, nested too deep
        raise ApiError(400, f"the request body is not valid JSON: {clip(str(err))}") from None
    model.check_counts(data)
    return model.model_validate(data)


async def read_body(request: HttpRequest, timeout: float) -> bytes:
    """The request body, refused as soon as it grows past MAX_BODY_BYTES (413) or takes longer than
    ``timeout`` seconds to arrive (408: a client trickling its body must not hold a handler forever).
    A client that leaves mid-body ends the request quietly (499, which nobody reads)."""
    chunks, size = [], 0
    try:
        async with asyncio.timeout(timeout):
            async for chunk in request.stream():
                size += len(chunk)
                if size > MAX_BODY_BYTES:
                    raise ApiError(413, f"the request body is larger than {MAX_BODY_BYTES // 2**20} MiB",
                                   code="request_too_large")
                chunks.append(chunk)
    except TimeoutError:
        raise ApiError(408, f"the request body did not arrive within {timeout:g} s",
                       code="request_timeout") from None
    except ClientDisconnect:
        log.info("a client closed its connection while sending its request body")
        raise ApiError(499, "the client closed the connection") from None
    return b"".join(chunks)
