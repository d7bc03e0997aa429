"""OpenAI's side of the wire: the request bodies, their validation, the error JSON, the replies.

Everything here is plain data in and out, with no engine and no event loop: pydantic models
parse and check a body (strictly: a bad field is a 400 that names it, before any work is done),
``ApiError`` is every refusal in OpenAI's ``{"error": {...}}`` shape, and ``Reply`` builds the
response objects, whole or as the chunks of a Server-Sent Events stream (``sse``).
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.requests import Request as HttpRequest

from minillm.sampling import SamplingParams
from minillm.sampling.params import MAX_COMPLETIONS, REPETITION_PENALTY_RANGE

MAX_BODY_BYTES = 8 * 2**20  # a request body larger than this is refused (413) before it is parsed
MAX_CHOICES = MAX_COMPLETIONS  # prompts x n of one request: each choice is an engine request with its own state
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions (chat: as many as fit)
# The engine's finish reasons in OpenAI's words: EOS and a stop string are both "stop".
FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length"}


# --------------------------------------------------------------------------- errors
class ApiError(Exception):
    """A request the server refuses, answered as OpenAI does: ``{"error": {message, type, param, code}}``."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def validation_error(err: ValidationError) -> ApiError:
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
    # refused by name in refuse_unsupported.
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


class ChatCompletionBody(GenerationBody):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Optional[int] = Field(None, ge=1)  # the newer name of max_tokens


class CompletionBody(GenerationBody):
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


def refuse_unsupported(body: BaseModel) -> None:
    for name, value in (body.model_extra or {}).items():
        if name in _UNSUPPORTED and value not in _UNSUPPORTED[name]:
            raise ApiError(400, f"{name} is not supported by this server", param=name, code="unsupported_parameter")


# --------------------------------------------------------------------------- responses
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


def token_usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def sse(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


async def read_body(request: HttpRequest) -> bytes:
    """The request body, refused (413) as soon as it grows past MAX_BODY_BYTES."""
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise ApiError(413, f"the request body is larger than {MAX_BODY_BYTES // 2**20} MiB",
                           code="request_too_large")
        chunks.append(chunk)
    return b"".join(chunks)

