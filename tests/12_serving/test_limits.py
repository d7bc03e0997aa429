"""Counts and sizes are checked before the work they bound (``protocol.parse_body``, ``Server``).

A request past a limit is a 400 that names the field, and the law is that none of the work the
limit bounds was done: the tokenizer (``encode``, the chat template) is never called. Before,
``"prompt": ["a"] * 1_500_000`` was tokenized whole (10-27 s) before "more than 128 completions",
and 240,000 empty chat messages were templated (8 s) before any refusal. The one time bound
(generous) is on the request that used to take seconds: it proves no per-item work was done.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest

from minillm import Engine, load_model
from minillm.serve.protocol import MAX_CHOICES, MAX_CONTENT_PARTS, MAX_MESSAGES, MAX_PROMPT_IDS

from helpers.checkpoints import tiny_hf_checkpoint
from helpers.serving import Served, serving


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, tiny_tokenizer) -> Iterator[tuple[Served, Engine]]:
    folder = tiny_hf_checkpoint(tmp_path_factory.mktemp("tiny") / "tiny", tiny_tokenizer, "llama",
                                max_position_embeddings=512, vocab_size=300)
    model, tok = load_model(folder, device="cpu")
    engine = Engine(model, tok, backend="eager", kv_cache_tokens=2048)
    with serving(engine, "tiny") as served:
        yield served, engine


@pytest.fixture
def tokenizer_calls(tiny, monkeypatch) -> list[str]:
    """Every call of the server's tokenizer during the test (it still works: the spies pass through)."""
    _, engine = tiny
    tok, calls = engine.tokenizer, []
    for name in ("encode", "apply_chat_template"):
        real = getattr(tok, name)

        def spy(*args, _real=real, _name=name, **kwargs):
            calls.append(_name)
            return _real(*args, **kwargs)

        monkeypatch.setattr(tok, name, spy)
    return calls


def _post(served: Served, path: str, body: object) -> httpx.Response:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(f"{served.url}{path}", content=raw, headers={"Content-Type": "application/json"}, timeout=120)


CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
EMPTY = {"role": "user", "content": ""}


@pytest.mark.parametrize("path, body, param, code", [
    (COMPLETIONS, {"prompt": ["a"] * 1_500_000}, "prompt", None),
    (COMPLETIONS, {"prompt": ["a"] * (MAX_CHOICES + 1), "max_tokens": 1}, "prompt", None),
    (COMPLETIONS, {"prompt": ["a", "b"], "n": MAX_CHOICES // 2 + 1}, "n", None),  # prompts x n
    (COMPLETIONS, {"prompt": ["a"] * MAX_CHOICES, "n": 2}, "n", None),
    (COMPLETIONS, {"prompt": [[7]] * (MAX_CHOICES + 1)}, "prompt", None),
    (COMPLETIONS, {"prompt": [7] * (MAX_PROMPT_IDS + 1)}, "prompt", None),
    (COMPLETIONS, {"prompt": [[7], [7] * (MAX_PROMPT_IDS + 1)]}, "prompt.1", None),
    (COMPLETIONS, {"prompt": [7] * 600}, "prompt", "context_length_exceeded"),  # past the 512-token context
    (COMPLETIONS, {"prompt": [[7], [7] * 600]}, "prompt", "context_length_exceeded"),
    (COMPLETIONS, {"prompt": ["hi", "x" * 100_000]}, "prompt", "context_length_exceeded"),  # the 2nd, by its size
    (CHAT, {"messages": [EMPTY] * 240_000}, "messages", None),
    (CHAT, {"messages": [EMPTY] * (MAX_MESSAGES + 1)}, "messages", None),
    (CHAT, {"messages": [EMPTY, {"role": "user", "content": [{"type": "text", "text": ""}] * 250_000}]},
     "messages.1.content", None),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "text", "text": ""}] * (MAX_CONTENT_PARTS + 1)}]},
     "messages.0.content", None),
    (CHAT, {"messages": [{"role": "user", "content": "x" * 100_000}]}, "messages", "context_length_exceeded"),
    (CHAT, {"messages": [{"role": "user", "content": "x" * 60_000}] * 4}, "messages", "context_length_exceeded"),
], ids=["1.5M-prompts", "129-prompts", "2-prompts-x-65", "128-prompts-x-2", "129-id-prompts", "131073-ids",
        "131073-ids-in-the-2nd", "600-ids", "600-ids-in-the-2nd", "100k-chars-in-the-2nd", "240k-messages",
        "4097-messages", "250k-parts", "257-parts", "100k-chars-chat", "4x60k-chars-chat"])
def test_a_request_past_a_limit_is_refused_by_name_before_any_tokenizing(tiny, tokenizer_calls, path, body, param,
                                                                            code):
    served, _ = tiny
    response = _post(served, path, body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert error["code"] == code
    assert len(error["message"]) < 600  # the refused list is not echoed
    assert tokenizer_calls == []


@pytest.mark.parametrize("path, body", [
    (COMPLETIONS, {"prompt": ["a"] * 1_500_000}),
    (CHAT, {"messages": [EMPTY] * 240_000}),
], ids=["1.5M-prompts", "240k-messages"])
def test_the_requests_that_took_seconds_are_refused_at_once(tiny, tokenizer_calls, path, body):
    """Refused by their count before any item is tokenised (they took 8-27 s when every prompt
    was encoded first; measured now: well under a second, not asserted: wall time is the machine's)."""
    served, _ = tiny
    response = _post(served, path, json.dumps(body).encode())
    assert response.status_code == 400
    assert response.json()["error"]["param"] == ("prompt" if path == COMPLETIONS else "messages")
    assert tokenizer_calls == []


def test_the_limits_themselves_are_allowed(tiny, tokenizer_calls):
    served, _ = tiny
    reply = _post(served, COMPLETIONS, {"prompt": ["a"] * MAX_CHOICES, "max_tokens": 1})
    assert reply.status_code == 200 and len(reply.json()["choices"]) == MAX_CHOICES
    assert tokenizer_calls.count("encode") == MAX_CHOICES
    reply = _post(served, COMPLETIONS, {"prompt": [[7]] * (MAX_CHOICES // 2), "n": 2, "max_tokens": 1})
    assert reply.status_code == 200 and len(reply.json()["choices"]) == MAX_CHOICES
    parts = [{"type": "text", "text": "a"}] * MAX_CONTENT_PARTS
    reply = _post(served, CHAT, {"messages": [{"role": "user", "content": parts}], "max_tokens": 1})
    assert reply.status_code == 200
    # As many (empty) messages as allowed: past the count check, refused by the context once templated.
    tokenizer_calls.clear()
    reply = _post(served, CHAT, {"messages": [EMPTY] * MAX_MESSAGES})
    assert reply.status_code == 400 and reply.json()["error"]["code"] == "context_length_exceeded"
    assert "apply_chat_template" in tokenizer_calls  # the count check let it through


@pytest.mark.parametrize("raw", [b"[" * 100_000, b'{"prompt": "\xff"}', b'{"prompt": "hi"', b""],
                         ids=["nested-100k-deep", "not-utf8", "truncated", "empty"])
def test_a_body_that_is_not_json_is_a_400(tiny, raw):
    served, _ = tiny
    for path in (CHAT, COMPLETIONS):
        response = _post(served, path, raw)
        assert response.status_code == 400, response.text
        assert response.json()["error"]["message"].startswith("the request body is not valid JSON")
