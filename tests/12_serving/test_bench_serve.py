"""``bench serve``'s parts: the seeded load, the statistics, the client, the server processes.

The benchmark itself takes minutes on the real model; here each part is checked on its own, on
hand-computed values or against a tiny random checkpoint served in a thread. No test asserts on
wall time: only on what the load and the servers report.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from minillm import Engine, load_model
from minillm.bench import (
    ServerProcess,
    load_summary,
    percentile,
    poisson_arrivals,
    prometheus_values,
    run_load,
    serve_body,
    serve_conversations,
    serve_ratios,
    serve_system_prompts,
)

from helpers.checkpoints import tiny_hf_checkpoint
from helpers.serving import serving


# --------------------------------------------------------------------------- the load
def test_the_poisson_schedule_is_seeded_reproducible_and_has_the_asked_rate():
    a, b = poisson_arrivals(2000, 4.0, seed=7), poisson_arrivals(2000, 4.0, seed=7)
    assert a == b
    assert a != poisson_arrivals(2000, 4.0, seed=8)
    assert all(0 < x < y for x, y in zip(a, a[1:]))  # strictly increasing, after the start
    mean_gap = a[-1] / len(a)  # exponential gaps of mean 1/rate: 0.25 s (2000 of them: within 10%)
    assert 0.225 < mean_gap < 0.275
    assert poisson_arrivals(5, 4.0, seed=7) == a[:5]  # a longer run only adds arrivals after these


def test_the_conversations_share_the_system_prompt_and_ask_distinct_questions(tiny_tokenizer):
    systems = serve_system_prompts(tiny_tokenizer, 40, 3)
    assert len(set(systems)) == 3
    assert all(len(tiny_tokenizer.encode(s)) in range(36, 45) for s in systems)  # 40 tokens, re-encoded
    chats = serve_conversations(systems[0], 20)
    assert {chat[0]["content"] for chat in chats} == {systems[0]}
    assert [chat[0]["role"] for chat in chats] == ["system"] * 20
    assert len({chat[1]["content"] for chat in chats}) == 20


def test_both_dialects_ask_for_exactly_max_tokens_greedy_and_streamed():
    messages = [{"role": "user", "content": "hi"}]
    ours, theirs = serve_body("minillm", messages, 7), serve_body("transformers", messages, 7)
    for body in (ours, theirs):
        assert body["max_tokens"] == 7 and body["temperature"] == 0 and body["stream"] is True
    assert ours["ignore_eos"] is True and ours["stream_options"] == {"include_usage": True}
    assert "ignore_eos" not in theirs and "stream_options" not in theirs  # transformers refuses unknown fields
    assert json.loads(theirs["generation_config"]) == {"max_new_tokens": 7, "min_new_tokens": 7, "do_sample": False}


# --------------------------------------------------------------------------- the statistics
def test_percentiles_on_hand_computed_values():
    assert percentile([3.0, 1.0, 4.0, 2.0], 50) == 2.5  # between the two middle ranks
    assert percentile([10, 20, 30, 40, 50], 99) == pytest.approx(49.6)  # rank 3.96: 40 + 0.96 * 10
    assert percentile([10, 20, 30, 40, 50], 0) == 10 and percentile([10, 20, 30, 40, 50], 100) == 50
    assert percentile([5.0], 99) == 5.0
    values = list(range(101))
    assert percentile(values, 99) == 99 and percentile(values, 50) == 50


def _row(sent: float, first: float, last: float, done: float, tokens: int, error: str | None = None) -> dict:
    return {"sent": sent, "first": first, "last": last, "done": done, "tokens": tokens, "error": error,
            "ttft": None if error else first - sent, "tpot": None if error else (last - first) / (tokens - 1),
            "latency": done - sent, "late": 0.0}


def test_the_run_summary_on_hand_computed_rows():
    rows = [_row(0.0, 0.1, 0.4, 0.4, 4), _row(1.0, 1.3, 2.2, 2.3, 10), _row(1.5, 1.5, 1.5, 1.6, 1, "HTTP 400: no")]
    s = load_summary(rows)
    assert (s["requests"], s["errors"], s["tokens"]) == (3, 1, 14)  # a failed request's tokens do not count
    assert s["span_s"] == pytest.approx(2.3)  # first send to last answer
    assert s["tok_s"] == pytest.approx(14 / 2.3)
    assert s["ttft_p50_ms"] == pytest.approx(200)  # TTFTs 100 and 300 ms
    assert s["ttft_p99_ms"] == pytest.approx(298)  # 100 + 0.99 * 200
    assert s["tpot_p50_ms"] == pytest.approx(100)  # TPOTs 100 ms (0.3 s / 3) and 100 ms (0.9 s / 9)
    assert s["first_errors"] == ["HTTP 400: no"]


def test_the_ratios_are_minillm_over_transformers_best_against_best_and_round_by_round():
    def system(tok_s: list[float], ttft_p99: list[float]) -> dict:
        runs = [{"tok_s": t, "ttft_p99_ms": p} for t, p in zip(tok_s, ttft_p99)]
        return {"label": "x", "runs": runs, "best": {"tok_s": {"best": max(tok_s)}, "ttft_p99_ms": {"best": min(ttft_p99)}}}

    systems = {"minillm:on": system([100, 80], [200, 300]), "minillm:off": system([1, 1], [1, 1]),
               "transformers:cb": system([40, 50], [1000, 500]), "transformers:generate": {"label": "y", "runs": []}}
    [row] = serve_ratios(systems)
    assert row["against"] == "transformers:cb"
    assert row["throughput"] == pytest.approx(2.0)  # 100 / 50
    assert row["ttft_p99"] == pytest.approx(0.4)  # 200 / 500
    assert row["throughput_per_round"] == pytest.approx((1.6, 2.5))  # 80 / 50, 100 / 40
    assert row["ttft_p99_per_round"] == pytest.approx((0.2, 0.6))  # 200 / 1000, 300 / 500


def test_prometheus_text_is_read_by_name_and_labels():
    text = "# HELP a x\n# TYPE a gauge\na 1.5\nb{reason=\"stop\"} 3\n\nc NaN\n"
    values = prometheus_values(text)
    assert values["a"] == 1.5 and values['b{reason="stop"}'] == 3 and values["c"] != values["c"]


# --------------------------------------------------------------------------- the client, on a tiny server
@pytest.fixture(scope="module")
def tiny_url(tmp_path_factory, tiny_tokenizer) -> Iterator[str]:
    folder = tiny_hf_checkpoint(tmp_path_factory.mktemp("tiny") / "tiny", tiny_tokenizer, "llama",
                                max_position_embeddings=512, vocab_size=300)
    model, tok = load_model(folder, device="cpu")
    with serving(Engine(model, tok, backend="eager", kv_cache_tokens=4096, prefix_caching=True), "tiny") as served:
        yield served.url


def _metrics(url: str) -> dict[str, float]:
    return prometheus_values(httpx.get(f"{url}/metrics").text)


def test_the_client_counts_every_token_of_a_poisson_load_with_no_errors(tiny_url, tiny_tokenizer):
    [system] = serve_system_prompts(tiny_tokenizer, 48, 1)
    chats = serve_conversations(system, 6)
    run_load(tiny_url, [serve_body("minillm", chats[0], 2)], [0.0])  # the system prompt's blocks are cached now
    before = _metrics(tiny_url)
    rows = run_load(tiny_url, [serve_body("minillm", chat, 5) for chat in chats], poisson_arrivals(6, 50.0, seed=1))
    after = _metrics(tiny_url)
    assert [row["error"] for row in rows] == [None] * 6
    assert [row["tokens"] for row in rows] == [5] * 6  # ignore_eos: exactly max_tokens, as the usage says
    for row in rows:
        assert 1 <= row["chunks"] <= 5 and row["text"]
        assert row["sent"] <= row["first"] <= row["last"] <= row["done"]
        assert row["ttft"] >= 0 and row["tpot"] >= 0 and row["latency"] >= row["ttft"]
    s = load_summary(rows)
    assert (s["requests"], s["errors"], s["tokens"]) == (6, 0, 30)
    assert s["tok_s"] > 0 and s["ttft_p50_ms"] <= s["ttft_p99_ms"]
    hits, queries = (after[f"minillm_prefix_cache_{k}_tokens_total"] - before[f"minillm_prefix_cache_{k}_tokens_total"]
                     for k in ("hit", "query"))
    assert queries == after["minillm_prompt_tokens_total"] - before["minillm_prompt_tokens_total"]
    assert 0 < hits <= queries  # the shared system prompt was found in the cache


def test_a_refused_request_is_counted_as_an_error_not_as_tokens(tiny_url):
    ok = serve_body("minillm", [{"role": "user", "content": "hi"}], 3)
    refused = serve_body("minillm", [{"role": "user", "content": "hi"}], 100_000)  # past the context: a 400
    rows = run_load(tiny_url, [ok, refused], [0.0, 0.0])
    assert rows[0]["error"] is None and rows[0]["tokens"] == 3
    assert rows[1]["error"].startswith("HTTP 400") and rows[1]["ttft"] is None
    s = load_summary(rows)
    assert (s["errors"], s["tokens"]) == (1, 3)


# --------------------------------------------------------------------------- the server processes
def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except OSError:
        return True
    return state in ("Z", "X")  # a zombie has ended; its parent (init) collects it


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_stopping_a_server_ends_its_whole_process_group(tmp_path):
    script = ("import subprocess, sys, time\n"
              "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
              "print(child.pid, flush=True)\n"
              "time.sleep(120)\n")
    server = ServerProcess("sleeper", [sys.executable, "-c", script], 1, tmp_path / "log", dict(os.environ))
    deadline = time.monotonic() + 60
    while not (tmp_path / "log").read_text().strip():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    child = int((tmp_path / "log").read_text())
    assert not _gone(server.process.pid) and not _gone(child)
    server.stop()
    server.stop()  # twice is harmless
    assert server.process.returncode is not None
    deadline = time.monotonic() + 30
    while not _gone(child):
        assert time.monotonic() < deadline, "the server's own child outlived it"
        time.sleep(0.05)


def test_a_server_that_exits_before_it_is_ready_is_reported_with_its_log(tmp_path):
    script = "import sys; print('no weights here', flush=True); sys.exit(3)"
    server = ServerProcess("broken", [sys.executable, "-c", script], 9, tmp_path / "log", dict(os.environ))
    try:
        with pytest.raises(RuntimeError, match=r"(?s)exited with status 3.*no weights here"):
            server.wait_ready(60)
    finally:
        server.stop()


def test_the_report_prints_every_run_and_says_why_transformers_did_not_run(capsys):
    run = {"round": 1, "tok_s": 50.0, "ttft_p50_ms": 100.0, "ttft_p99_ms": 200.0, "tpot_p50_ms": 20.0,
           "tpot_p99_ms": 30.0, "prefix_hit_rate": 0.5, "errors": 0, "requests": 4, "first_errors": [],
           "late_max_ms": 0.0, "tokens": 32}
    best = {key: {"best": run[key], "min": run[key], "max": run[key]}
            for key in ("tok_s", "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms")}
    r = {"requests": 4, "rate": 4.0, "seed": 0, "arrival_span_s": 1.0, "system_tokens": 128, "max_tokens": 8,
         "rounds": 1, "device": "cpu", "dtype": "float32", "threads": 2, "model": "m",
         "systems": {"minillm:on": {"label": "minillm serve", "runs": [run], "best": best, "tokens_expected": 32,
                                    "tokens_returned": 32, "peak_rss_mb": 1000.0},
                     "transformers:cb": {"label": "transformers serve --continuous-batching", "runs": [],
                                         "error": "it exited"}},
         "ratios": [], "transformers_error": "transformers serve --continuous-batching: it exited\n"}
    from minillm.bench import print_serve_report

    print_serve_report(r)
    out = capsys.readouterr().out
    assert "minillm serve" in out and "50.0" in out and "50%" in out
    assert "did not run" in out and "could not run here:\ntransformers serve --continuous-batching: it exited" in out
