"""From the engine's events to OpenAI's responses: one job's Server-Sent Events, or its whole answer.

The worker sends each job ``Delta`` (new text, and the logprobs of the tokens behind it),
``Finished`` and ``Failed`` events; these two coroutines turn them into what the client reads.
An echoed prompt (``echo`` on /v1/completions) comes first, as the start of each choice's text.
With tools (``ToolPlan``), a choice's text is held until it ends: then it is either a tool call
(``tool_calls``, finish reason "tool_calls") or, if it is not one, the text.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

from starlette.requests import Request as HttpRequest

from minillm.serve.protocol import ApiError, Reply, TokenLogprobs, sse, token_usage
from minillm.serve.tools import ToolPlan
from minillm.serve.worker import Delta, Failed, Finished, Job

Echo = tuple[str, "list[TokenLogprobs] | None"]  # an echoed prompt's text and its tokens' logprobs


async def stream_events(job: Job, reply: Reply, prompt_tokens: int, include_usage: bool,
                        echoed: list[Echo] | None = None, tools: ToolPlan | None = None) -> AsyncIterator[str]:
    """The Server-Sent Events of one job: a role chunk per choice (chat) or its echoed prompt,
    the text as it comes, a chunk with each choice's finish reason, the usage if asked for, then
    ``[DONE]``."""
    finished = completion_tokens = 0
    offsets = [0] * len(job.choices)  # characters of each choice streamed so far (legacy text_offset)
    if reply.chat:
        for index in range(len(job.choices)):
            yield sse(reply.chunk(index, role=True))
    for index, (text, entries) in enumerate(echoed or ()):
        yield sse(reply.chunk(index, text, logprobs=entries))
        offsets[index] = len(text)
    held = [""] * len(job.choices)  # with tools: each choice's text, until it ends
    held_logprobs: list[list[TokenLogprobs] | None] = [None] * len(job.choices)
    while finished < len(job.choices):
        event = await job.events.get()
        if isinstance(event, Delta) and tools is not None:
            held[event.index] += event.text
            held_logprobs[event.index] = _joined(held_logprobs[event.index], event.logprobs)
        elif isinstance(event, Delta):
            yield sse(reply.chunk(event.index, event.text, logprobs=event.logprobs, offset=offsets[event.index]))
            offsets[event.index] += len(event.text)
        elif isinstance(event, Finished):
            finished += 1
            completion_tokens += event.completion_tokens
            reason, logprobs = event.finish_reason, event.logprobs or None
            if tools is not None:
                logprobs = _joined(held_logprobs[event.index], event.logprobs)
                calls = tools.calls(held[event.index]) if reason == "stop" else None
                if calls:
                    yield sse(reply.chunk(event.index, tool_calls=calls, logprobs=logprobs))
                    reason, logprobs = "tool_calls", None
                elif held[event.index]:
                    yield sse(reply.chunk(event.index, held[event.index], logprobs=logprobs))
                    logprobs = None
            yield sse(reply.chunk(event.index, finish_reason=reason, logprobs=logprobs, offset=offsets[event.index]))
        elif isinstance(event, Failed):  # the status line is sent already: the error goes in the stream
            yield sse(event.error.body())
            break
    else:
        if include_usage:
            yield sse(reply.usage_chunk(token_usage(prompt_tokens, completion_tokens)))
    yield "data: [DONE]\n\n"

async def collect_events(job: Job, reply: Reply, prompt_tokens: int, request: HttpRequest,
                         abort: Callable[[Job], None], echoed: list[Echo] | None = None,
                         tools: ToolPlan | None = None) -> dict[str, Any]:
    """The whole answer of a non-streaming request; aborted if the client disconnects meanwhile."""
    n = len(job.choices)
    texts, reasons = [""] * n, ["length"] * n
    logprobs: list[list[TokenLogprobs] | None] = [None] * n
    for index, (text, entries) in enumerate(echoed or ()):
        texts[index], logprobs[index] = text, None if entries is None else list(entries)
    finished = completion_tokens = 0
    watcher = asyncio.create_task(_end_on_disconnect(request, job))
    try:
        while finished < n:
            event = await job.events.get()
            if isinstance(event, (Delta, Finished)):
                logprobs[event.index] = _joined(logprobs[event.index], event.logprobs)
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
            abort(job)
    calls = [tools.calls(text) if tools is not None and reason == "stop" else None
             for text, reason in zip(texts, reasons)]
    reasons = ["tool_calls" if call else reason for call, reason in zip(calls, reasons)]
    return reply.response(texts, reasons, token_usage(prompt_tokens, completion_tokens), logprobs, calls)


def _joined(held: list[TokenLogprobs] | None, new: list[TokenLogprobs] | None) -> list[TokenLogprobs] | None:
    return held if new is None else (held or []) + new


async def _end_on_disconnect(request: HttpRequest, job: Job) -> None:
    """Wait for the client of a non-streaming request to go away, then end the wait for its
    answer. (Its body is read: the only message still to come is the disconnect.)"""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    job.events.put_nowait(Failed(ApiError(499, "the client closed the connection")))
