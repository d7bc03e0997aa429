"""The HTTP server (``minillm.serve``), through the official ``openai`` client and raw HTTP.

Two servers run for the whole module, each in a background thread on a free port of 127.0.0.1:
one on the real SmolLM2-135M-Instruct (what it answers must equal ``Engine.generate`` on the same
engine, however many clients share it), one on a tiny random checkpoint for the refusals, which
must be OpenAI's error JSON and leave the server serving. No test asserts on time: waits for the
server's state are bounded, and the laws are asserted on what it reports.
"""

from __future__ import annotations

import json
import math
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from openai import OpenAI

from minillm import Engine, SamplingParams, Tokenizer, load_model
from minillm.engine.request import Completion

from helpers.checkpoints import tiny_hf_checkpoint
from helpers.serving import Served, serving, wait_until_healthy

REPO = Path(__file__).resolve().parents[2]
MODEL = "SmolLM2-135M-Instruct"
MAX_TOKENS = 24
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village, there lived"]
QUESTIONS = ["What is the capital of France?", "Name three primary colors."]
CONCURRENT = [f"Write one short sentence about the number {i}." for i in range(16)]


# --------------------------------------------------------------------------- the real model
@dataclass
class Real:
    served: Served
    tokenizer: Tokenizer
    completions: dict[str, Completion]  # greedy, MAX_TOKENS, each prompt alone
    chats: dict[str, Completion]  # greedy, MAX_TOKENS, each question alone
    concurrent: dict[str, Completion]  # greedy, MAX_TOKENS, all 16 questions in one generate()


@pytest.fixture(scope="module")
def real(smollm) -> Iterator[Real]:
    """The server on the real model. The references are computed first, with the same Engine
    (which compiles its decode step on the way), which the server then takes over."""
    model, tok = smollm
    engine = Engine(model, tok)
    greedy = SamplingParams(max_new_tokens=MAX_TOKENS)
    completions = {p: engine.generate([p], greedy)[0] for p in PROMPTS}
    chats = {q: engine.chat([{"role": "user", "content": q}], greedy) for q in QUESTIONS}
    ids = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True) for q in CONCURRENT]
    concurrent = dict(zip(CONCURRENT, engine.generate(ids, greedy)))
    with serving(engine, MODEL) as served:
        yield Real(served, tok, completions, chats, concurrent)


def _finished(metrics: dict[str, float], reason: str) -> float:
    return metrics[f'minillm_requests_finished_total{{reason="{reason}"}}']


def _finish(completion: Completion) -> str:
    return {"eos": "stop", "stop": "stop", "length": "length"}[completion.finish_reason]


def test_models_health_and_aliases(real):
    assert [m.id for m in real.served.client.models.list().data] == [MODEL]
    assert httpx.get(f"{real.served.url}/health").json()["status"] == "ok"
    for alias in ("HuggingFaceTB/SmolLM2-135M-Instruct", "smollm2-135m-instruct", "minillm"):
        reply = real.served.client.completions.create(model=alias, prompt="Hi", max_tokens=1, temperature=0)
        assert reply.model == MODEL


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_completion_over_http_equals_engine_generate(real, prompt):
    expected = real.completions[prompt]
    client = real.served.client
    reply = client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
    assert reply.choices[0].text == expected.text
    assert reply.choices[0].finish_reason == _finish(expected)
    assert reply.usage.prompt_tokens == len(real.tokenizer.encode(prompt))
    assert reply.usage.completion_tokens == len(expected.token_ids)
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens

    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected.text
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert reasons == [_finish(expected)]
    assert chunks[-1].usage.completion_tokens == len(expected.token_ids)


@pytest.mark.parametrize("question", QUESTIONS)
def test_greedy_chat_over_http_equals_engine_chat(real, question):
    expected = real.chats[question]
    client = real.served.client
    messages = [{"role": "user", "content": question}]
    reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=MAX_TOKENS, temperature=0)
    assert reply.choices[0].message.role == "assistant"
    assert reply.choices[0].message.content == expected.text
    assert reply.choices[0].finish_reason == _finish(expected)
    ids = real.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (len(ids), len(expected.token_ids))

    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=MAX_TOKENS, temperature=0,
                                            stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected.text
    assert chunks[-1].choices[0].finish_reason == _finish(expected)


def test_stop_strings_end_the_text_before_the_first_one(real):
    prompt = PROMPTS[2]
    full = real.completions[prompt].text
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    assert stop.strip()  # a visible piece of the greedy answer
    expected = full[: full.find(stop)]
    for stream in (False, True):
        reply = real.served.client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                                      stop=[stop, "never in this text \u2603"], stream=stream)
        chunks = list(reply) if stream else [reply]
        assert "".join(c.choices[0].text for c in chunks) == expected
        assert chunks[-1].choices[0].finish_reason == "stop"


def test_max_tokens_ends_with_length(real):
    prompt = PROMPTS[0]
    ids = real.completions[prompt].token_ids[:3]  # the greedy answer emits no EOS in its first 3 tokens
    assert real.tokenizer.eos_id not in ids
    reply = real.served.client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0)
    assert reply.choices[0].finish_reason == "length" and reply.usage.completion_tokens == 3
    assert reply.choices[0].text == real.tokenizer.decode(ids)


def test_seeded_sampling_is_reproducible_and_n_gives_n_engine_requests(real):
    client = real.served.client
    messages = [{"role": "user", "content": "Tell me a short story about a cat."}]

    def sample(seed: int, n: int) -> list[str]:
        reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0.9,
                                               top_p=0.95, seed=seed, n=n)
        assert [c.index for c in reply.choices] == list(range(n))
        assert n <= reply.usage.completion_tokens <= 16 * n
        return [c.message.content for c in reply.choices]

    assert sample(7, 1) == sample(7, 1)
    before = real.served.metrics()
    three = sample(7, 3)
    after = real.served.metrics()
    # one engine request per choice
    assert sum(_finished(after, r) - _finished(before, r) for r in ("stop", "length")) == 3
    assert sample(7, 3) == three
    streamed = [""] * 3
    for chunk in client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0.9,
                                                top_p=0.95, seed=7, n=3, stream=True):
        for choice in chunk.choices:
            streamed[choice.index] += choice.delta.content or ""
    assert streamed == three


def test_sixteen_concurrent_streaming_clients_get_the_greedy_answers_and_free_the_pool(real):
    served = real.served
    start = served.wait_until_idle()
    results: dict[str, tuple[str, str | None]] = {}
    errors: list[BaseException] = []

    def client(question: str) -> None:
        try:
            text, finish = "", None
            for chunk in served.client.chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": question}], max_tokens=MAX_TOKENS,
                    temperature=0, stream=True):
                text += chunk.choices[0].delta.content or ""
                finish = chunk.choices[0].finish_reason or finish
            results[question] = (text, finish)
        except BaseException as err:  # reported by the main thread
            errors.append(err)

    threads = [threading.Thread(target=client, args=(q,)) for q in CONCURRENT]
    began = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    elapsed = time.perf_counter() - began
    assert not errors, errors
    for question, expected in real.concurrent.items():
        assert results[question] == (expected.text, _finish(expected)), question
    end = served.wait_until_idle()
    assert end["minillm_kv_blocks_free"] == start["minillm_kv_blocks_free"] == end["minillm_kv_blocks_total"]
    tokens = sum(len(c.token_ids) for c in real.concurrent.values())
    print(f"\n16 concurrent streaming clients: {tokens} tokens in {elapsed:.2f} s ({tokens / elapsed:.1f} tokens/s)")


def test_a_streaming_client_that_disconnects_has_its_request_aborted(real):
    served = real.served
    before = served.wait_until_idle()
    body = {"model": MODEL, "prompt": "Count to a million: 1, 2, 3,", "max_tokens": 8000, "ignore_eos": True,
            "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{served.url}/v1/completions", json=body, timeout=120) as response:
        assert response.status_code == 200
        first = next(line for line in response.iter_lines() if line.startswith("data: "))
        assert json.loads(first[len("data: "):])["choices"][0]["finish_reason"] is None
    # Closed after one chunk: the request would run for minutes unless it is aborted.
    after = served.wait_until_idle()
    assert after["minillm_kv_blocks_free"] == after["minillm_kv_blocks_total"]
    assert _finished(after, "abort") == _finished(before, "abort") + 1
    assert _finished(after, "length") == _finished(before, "length")
    assert served.client.completions.create(model=MODEL, prompt="Hi", max_tokens=2, temperature=0).choices[0].text


def test_a_non_streaming_client_that_disconnects_has_its_request_aborted(real):
    served = real.served
    before = served.wait_until_idle()
    body = {"model": MODEL, "prompt": "Count to a million: 1, 2, 3,", "max_tokens": 8000, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):  # the client gives up waiting and closes the connection
        httpx.post(f"{served.url}/v1/completions", json=body, timeout=httpx.Timeout(10, read=2))
    after = served.wait_until_idle()
    assert _finished(after, "abort") == _finished(before, "abort") + 1
    assert after["minillm_kv_blocks_free"] == after["minillm_kv_blocks_total"]


def test_metrics_count_what_a_request_did(real):
    served = real.served
    before = served.wait_until_idle()
    reply = served.client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=MAX_TOKENS, temperature=0)
    after = served.metrics()
    generated = after["minillm_generated_tokens_total"] - before["minillm_generated_tokens_total"]
    assert generated == reply.usage.completion_tokens
    assert after["minillm_prompt_tokens_total"] - before["minillm_prompt_tokens_total"] == reply.usage.prompt_tokens
    for name in ("minillm_time_to_first_token_seconds", "minillm_time_per_output_token_seconds"):
        assert after[f"{name}_count"] == before[f"{name}_count"] + 1
        buckets = sorted(((float(k.split('"')[1]), v) for k, v in after.items() if k.startswith(f"{name}_bucket")))
        counts = [v for _, v in buckets]
        assert counts == sorted(counts) and buckets[-1] == (math.inf, after[f"{name}_count"])  # cumulative
    assert 0 <= after["minillm_prefix_cache_hit_rate"] <= 1
    assert after["minillm_generated_tokens_per_second"] >= 0
    assert after["minillm_kv_blocks_used"] + after["minillm_kv_blocks_free"] == after["minillm_kv_blocks_total"]


def test_the_chat_page_streams_from_the_chat_endpoint(real):
    page = httpx.get(f"{real.served.url}/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    for needle in ("/v1/chat/completions", "getReader", "AbortController", "TTFT", "tokens/s", f'content="{MODEL}"'):
        assert needle in page.text


# --------------------------------------------------------------------------- refusals (a tiny model)
@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory, tiny_tokenizer) -> Path:
    return tiny_hf_checkpoint(tmp_path_factory.mktemp("tiny") / "tiny", tiny_tokenizer, "llama",
                              max_position_embeddings=512, vocab_size=300)


@pytest.fixture(scope="module")
def tiny(tiny_folder) -> Iterator[tuple[Served, Engine]]:
    model, tok = load_model(tiny_folder, device="cpu")
    engine = Engine(model, tok, backend="eager", kv_cache_tokens=2048)
    with serving(engine, "tiny") as served:
        yield served, engine


def _post(served: Served, path: str, body: str | bytes) -> httpx.Response:
    return httpx.post(f"{served.url}{path}", content=body, headers={"Content-Type": "application/json"}, timeout=60)


def _assert_openai_error(response: httpx.Response, status: int, param: str | None = None,
                         code: str | None = None) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    if code is not None:
        assert error["code"] == code


def _assert_still_serving(served: Served) -> None:
    messages = [{"role": "user", "content": "hi"}]
    reply = served.client.chat.completions.create(model="tiny", messages=messages, max_tokens=3)
    assert reply.choices[0].finish_reason in ("stop", "length") and reply.usage.completion_tokens >= 1


CHAT = '"messages": [{"role": "user", "content": "hi"}]'
LONG_TEXT = "To be, or not to be: that is the question. " * 2500  # > 20,000 tokens for the tiny tokenizer


@pytest.mark.parametrize("path, body, status, param, code", [
    ("/v1/chat/completions", '{"model": "tiny", ' + CHAT[:-3], 400, None, None),  # bad JSON
    ("/v1/chat/completions", '[1, 2]', 400, None, None),
    ("/v1/chat/completions", '{"model": "gpt-4o", ' + CHAT + '}', 404, "model", "model_not_found"),
    ("/v1/completions", '{"model": "gpt-4o", "prompt": "hi"}', 404, "model", "model_not_found"),
    ("/v1/chat/completions", '{' + CHAT + ', "max_tokens": -5}', 400, "max_tokens", None),
    ("/v1/chat/completions", '{' + CHAT + ', "temperature": NaN}', 400, "temperature", None),
    ("/v1/completions", '{"prompt": "hi", "temperature": Infinity}', 400, "temperature", None),
    ("/v1/chat/completions", '{"messages": []}', 400, "messages", None),
    ("/v1/chat/completions", '{"messages": [{"role": "bot", "content": "hi"}]}', 400, "messages.0.role", None),
    ("/v1/chat/completions", '{"messages": [{"role": "user"}]}', 400, "messages.0.content", None),
    ("/v1/chat/completions", '{' + CHAT + ', "n": 0}', 400, "n", None),
    ("/v1/chat/completions", '{' + CHAT + ', "top_p": 0}', 400, "top_p", None),
    ("/v1/chat/completions", '{' + CHAT + ', "max_tokens": "5"}', 400, "max_tokens", None),
    ("/v1/chat/completions", '{' + CHAT + ', "stop": ""}', 400, "stop", None),
    ("/v1/chat/completions", '{' + CHAT + ', "stop": ["a", "b", "c", "d", "e"]}', 400, "stop", None),
    ("/v1/chat/completions", '{' + CHAT + ', "presence_penalty": 0.5}', 400, "presence_penalty",
     "unsupported_parameter"),
    ("/v1/completions", '{"prompt": "hi", "best_of": 3}', 400, "best_of", "unsupported_parameter"),
    ("/v1/chat/completions", '{' + CHAT + ', "max_tokens": 600}', 400, "messages", "context_length_exceeded"),
    ("/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": LONG_TEXT}]}), 400, "messages",
     "context_length_exceeded"),
    ("/v1/completions", json.dumps({"prompt": [7] * 20_000}), 400, "prompt", "context_length_exceeded"),
    ("/v1/completions", json.dumps({"prompt": LONG_TEXT}), 400, "prompt", "context_length_exceeded"),
    ("/v1/completions", '{"prompt": [1, 2, 300]}', 400, None, None),  # past the vocabulary: the engine refuses it
    ("/v1/completions", '{"prompt": ""}', 400, "prompt", None),
    ("/v1/completions", '{"prompt": "hi", "n": 100, "max_tokens": 1, "seed": -1}', 400, "seed", None),
], ids=["bad-json", "not-an-object", "unknown-model-chat", "unknown-model-completions", "negative-max-tokens",
        "temperature-nan", "temperature-inf", "empty-messages", "unknown-role", "no-content", "n-0", "top-p-0",
        "max-tokens-string", "empty-stop", "five-stops", "presence-penalty", "best-of", "past-context-by-max-tokens",
        "20k-token-chat", "20k-token-ids", "20k-token-text", "id-past-vocab", "empty-prompt", "negative-seed"])
def test_a_bad_request_gets_openai_error_json_and_the_server_keeps_serving(tiny, path, body, status, param, code):
    served, _ = tiny
    _assert_openai_error(_post(served, path, body), status, param, code)
    _assert_still_serving(served)


def test_the_long_prompts_above_are_past_20000_tokens(tiny):
    _, engine = tiny
    assert len(engine.tokenizer.encode(LONG_TEXT)) > 20_000


def test_a_body_past_8_mib_is_refused_with_413(tiny):
    served, _ = tiny
    body = json.dumps({"prompt": "x" * (9 * 2**20)})
    _assert_openai_error(_post(served, "/v1/completions", body), 413, None, "request_too_large")
    _assert_still_serving(served)


def test_the_openai_client_raises_its_own_errors(tiny):
    served, _ = tiny
    with pytest.raises(openai.NotFoundError, match="model_not_found|does not exist"):
        served.client.completions.create(model="gpt-4o", prompt="hi")
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        served.client.completions.create(model="tiny", prompt="hi", max_tokens=-1)
    _assert_still_serving(served)


def test_an_engine_failure_mid_request_is_a_server_error_and_the_engine_keeps_serving(tiny, monkeypatch):
    served, engine = tiny

    def broken(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(engine.runner, "decode", broken)  # every decode step now fails
    response = _post(served, "/v1/completions", '{"prompt": "hi", "max_tokens": 5, "n": 2}')
    assert response.status_code == 500 and "boom" in response.json()["error"]["message"]
    assert response.json()["error"]["type"] == "server_error"
    with httpx.stream("POST", f"{served.url}/v1/completions", json={"prompt": "hi", "max_tokens": 5, "stream": True},
                      timeout=60) as stream:
        events = [line for line in stream.iter_lines() if line.startswith("data: ")]
    assert "boom" in json.loads(events[-2][len("data: "):])["error"]["message"] and events[-1] == "data: [DONE]"
    monkeypatch.undo()
    m = served.wait_until_idle()
    assert m["minillm_kv_blocks_free"] == m["minillm_kv_blocks_total"]
    _assert_still_serving(served)


def test_two_servers_in_one_process_count_their_own_metrics(tiny, tiny_folder):
    served, _ = tiny
    before = served.wait_until_idle()["minillm_prompt_tokens_total"]
    model, tok = load_model(tiny_folder, device="cpu")
    with serving(Engine(model, tok, backend="eager", kv_cache_tokens=2048), "other") as other:
        assert other.metrics()["minillm_prompt_tokens_total"] == 0
        reply = other.client.completions.create(model="other", prompt="hi", max_tokens=2)
        assert other.wait_until_idle()["minillm_prompt_tokens_total"] == reply.usage.prompt_tokens
    assert served.metrics()["minillm_prompt_tokens_total"] == before


# Request bodies: a valid one with up to three fields replaced by valid or invalid values.
# Whatever arrives, the answer is a well-formed response or an OpenAI error (never a 5xx), and
# the pool is free afterwards.
_JUNK = st.one_of(st.none(), st.booleans(), st.integers(-3, 3), st.floats(allow_nan=True), st.text(max_size=5),
                  st.lists(st.integers(-1, 400), max_size=3))
_FIELDS = {
    "model": st.sampled_from(["tiny", "minillm", "org/tiny", "nope", ""]),
    "messages": st.one_of(st.just([]), _JUNK, st.lists(st.fixed_dictionaries(
        {"role": st.sampled_from(["system", "user", "assistant", "x"]), "content": st.text(max_size=20)}), max_size=3)),
    "prompt": st.one_of(st.text(max_size=20), st.lists(st.integers(-1, 400), max_size=4), _JUNK),
    "max_tokens": st.one_of(st.integers(-1, 4), _JUNK),
    "temperature": st.one_of(st.floats(0, 2), _JUNK),
    "top_p": st.one_of(st.floats(0, 1), _JUNK),
    "n": st.one_of(st.integers(0, 3), _JUNK),
    "stop": st.one_of(st.text(max_size=3), st.lists(st.text(max_size=3), max_size=5), _JUNK),
    "seed": st.one_of(st.integers(-1, 2**64), _JUNK),
    "stream": st.one_of(st.booleans(), _JUNK),
    "presence_penalty": st.one_of(st.just(0), _JUNK),
}
_CHANGES = st.lists(st.sampled_from(sorted(_FIELDS)), max_size=3, unique=True).flatmap(
    lambda names: st.fixed_dictionaries({name: _FIELDS[name] for name in names}))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(path=st.sampled_from(["/v1/chat/completions", "/v1/completions"]), changes=_CHANGES)
def test_any_request_body_is_answered_or_refused_never_a_server_error(tiny, path, changes):
    served, _ = tiny
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "prompt": "hi", "max_tokens": 3,
            **changes}
    response = _post(served, path, json.dumps(body))  # json.dumps writes NaN and Infinity as Python does
    assert response.status_code in (200, 400, 404), response.text
    event(f"HTTP {response.status_code}")  # shown by --hypothesis-show-statistics
    if response.status_code != 200:
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    elif body.get("stream") is True:
        events = [line for line in response.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]"
        assert all("error" not in json.loads(e[len("data: "):]) for e in events[:-1])
    else:
        reply = response.json()
        assert len(reply["choices"]) == body.get("n", 1)
        assert reply["usage"]["completion_tokens"] >= len(reply["choices"])  # at least one token each
    m = served.wait_until_idle()
    assert m["minillm_kv_blocks_free"] == m["minillm_kv_blocks_total"]


# --------------------------------------------------------------------------- the command line
def test_serve_help_names_the_endpoints():
    result = subprocess.run([sys.executable, "-m", "minillm", "serve", "--help"], cwd=REPO, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0
    for needle in ("--port", "--max-batch-size", "/v1", "/metrics", "chat page", "--api-key", "MINILLM_API_KEY",
                   "--allowed-hosts", "--cors-origin", "--shutdown-timeout", "--request-timeout", "SIGTERM"):
        assert needle in result.stdout


@pytest.mark.parametrize("option, value", [("--request-timeout", "0"), ("--request-timeout", "nan"),
                                           ("--shutdown-timeout", "-1"), ("--shutdown-timeout", "1e9"),
                                           ("--shutdown-timeout", "soon")])
def test_serve_refuses_a_bad_timeout_before_loading_anything(option, value):
    result = subprocess.run([sys.executable, "-m", "minillm", "serve", option, value], cwd=REPO, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 2 and option in result.stderr and "Traceback" not in result.stderr


def test_serve_on_a_port_in_use_fails_cleanly():
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        result = subprocess.run([sys.executable, "-m", "minillm", "serve", "--port", str(port)], cwd=REPO,
                                capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    assert f"minillm: error: cannot listen on 127.0.0.1:{port}" in result.stderr and "Traceback" not in result.stderr


def test_the_serve_command_answers_and_stops_on_ctrl_c(tiny_folder, tmp_path):
    """The real command: the engine loop on its main thread, uvicorn on another; Ctrl-C ends an
    open stream with an error event and the process with 130."""
    with socket.create_server(("127.0.0.1", 0)) as probe:
        port = probe.getsockname()[1]
    # The server's log goes to a file, not a pipe: while it compiles, every /health poll below
    # logs a line, and a pipe nobody reads fills up (64 KB) and blocks the server mid-write.
    log = (tmp_path / "stderr.txt").open("w+")
    # SIGINT at its default in the server, whatever this process inherited: a shell starts a
    # background job (`make test &` in a script, `nohup ... &`) with SIGINT *ignored*, children
    # inherit that, and a server that ignores Ctrl-C would never stop here.
    process = subprocess.Popen([sys.executable, "-m", "minillm", "serve", "--model", str(tiny_folder), "--port",
                                str(port), "--device", "cpu"], cwd=REPO, stdout=subprocess.PIPE,
                               stderr=log, text=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        url = f"http://127.0.0.1:{port}"
        wait_until_healthy(url, process, 300)  # the first run compiles the decode step
        client = OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        assert [m.id for m in client.models.list().data] == ["tiny"]
        assert client.completions.create(model="tiny", prompt="hi", max_tokens=2).usage.completion_tokens == 2
        body = {"prompt": "hi", "max_tokens": 500, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as stream:
            lines = stream.iter_lines()
            next(line for line in lines if line.startswith("data: "))
            process.send_signal(signal.SIGINT)
            events = [line for line in lines if line.startswith("data: ")]
        assert process.wait(60) == 130
        log.seek(0)
        assert "minillm: interrupted" in log.read()
        assert process.stdout.read() == ""  # logs go to stderr: stdout is for results
        assert events[-1] == "data: [DONE]"
        ended = events[-2]  # the shutdown error, or the finish if the 500 tokens were faster than Ctrl-C
        assert "the server is shutting down" in ended or '"finish_reason": "length"' in ended
    finally:
        process.kill()
        log.close()
