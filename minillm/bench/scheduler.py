"""``bench scheduler``: what prefix caching and chunked prefill change, each measured on the
Engine against the Engine without it, in the same run (CPU, float32)."""

from __future__ import annotations

import argparse
import time
from typing import Any

from minillm.assets import corpus_path


def _prefix_caching(model: Any, tok: Any, system: list[int], questions: list[list[int]],
                    corpus: list[int], params: Any) -> dict[str, Any]:
    """Mean time to first token of requests sharing ``system``, one after another, with and
    without prefix caching; the share of prompt tokens found cached; whether the answers agree."""
    from minillm.engine import Engine

    r: dict[str, Any] = {}
    answers = {}
    for caching in (False, True):
        engine = Engine(model, tok, max_batch_size=16, prefix_caching=caching)
        engine.generate([corpus[-64:]], params)  # compile the step, outside the timing
        ttfts = []
        for question in questions:
            request = engine.add_request(system + question, params)
            start = time.perf_counter()
            while not request.output_ids:
                engine.step()
            ttfts.append(time.perf_counter() - start)
            while engine.has_unfinished_requests():
                engine.step()
        answers[caching] = [engine.generate([system + q], params)[0].token_ids for q in questions[:4]]
        key = "cached" if caching else "uncached"
        r[f"ttft_mean_s_{key}"] = sum(ttfts) / len(ttfts)
        if caching:
            r["prefix_hit_rate"] = engine.cached_prompt_tokens / engine.prompt_tokens
    r["ttft_ratio"] = r["ttft_mean_s_cached"] / r["ttft_mean_s_uncached"]
    r["same_answers"] = answers[False] == answers[True]
    return r


def _worst_gap(model: Any, tok: Any, corpus: list[int], long_prompt: list[int], streams: int,
               chunk_tokens: int | None, params: Any) -> float:
    """The longest gap between two steps while ``long_prompt`` is prefilled next to ``streams``
    decoding requests (whole, or in ``chunk_tokens``-token chunks)."""
    from minillm.engine import Engine
    from minillm.sampling import SamplingParams

    engine = Engine(model, tok, max_batch_size=16, prefill_chunk_tokens=chunk_tokens)
    engine.generate([corpus[-64:]], params)
    running = [engine.add_request(corpus[i * 50 : i * 50 + 20], SamplingParams(max_new_tokens=1000))
               for i in range(streams)]
    while any(not request.output_ids for request in running):
        engine.step()
    for _ in range(3):
        engine.step()
    long = engine.add_request(long_prompt, SamplingParams(max_new_tokens=1))
    last = time.perf_counter()
    worst = 0.0
    while not long.finished:
        engine.step()
        now = time.perf_counter()
        worst, last = max(worst, now - last), now
    for request in running:
        engine.abort(request)
    return worst


def run(args: argparse.Namespace) -> dict[str, Any]:
    return bench_scheduler()


def bench_scheduler(system_tokens: int = 512, n_requests: int = 16, long_prompt_tokens: int = 4000,
                    streams: int = 8, chunk: int = 256) -> dict[str, Any]:
    """What prefix caching and chunked prefill change, measured on the Engine (CPU, float32), each
    side in the same run:

    * ``n_requests`` requests sharing a ``system_tokens``-token system prompt, each with its own
      question, arriving one after another: time to first token with and without prefix caching,
      the share of prompt tokens found in the cache, and whether the answers are the same.
    * ``streams`` requests decoding when one ``long_prompt_tokens``-token prompt arrives: the
      longest gap between two tokens of those streams, with the prompt prefilled whole and in
      ``chunk``-token chunks.
    """
    from minillm.model import load_model
    from minillm.sampling import SamplingParams

    model, tok = load_model(device="cpu")
    corpus = tok.encode(corpus_path().read_text(encoding="utf-8")[:200_000])
    system = corpus[:system_tokens]
    questions = [tok.encode(f"\nQuestion {i}: who speaks next, and why?") for i in range(n_requests)]
    params = SamplingParams(max_new_tokens=16)
    r: dict[str, Any] = {"system_tokens": system_tokens, "n_requests": n_requests}
    r.update(_prefix_caching(model, tok, system, questions, corpus, params))

    long_prompt = corpus[system_tokens : system_tokens + long_prompt_tokens]
    r.update({"long_prompt_tokens": len(long_prompt), "streams": streams, "chunk": chunk})
    for chunk_tokens in (None, chunk):
        r[f"worst_gap_s_{'chunked' if chunk_tokens else 'whole'}"] = _worst_gap(
            model, tok, corpus, long_prompt, streams, chunk_tokens, params)
    r["gap_ratio"] = r["worst_gap_s_chunked"] / r["worst_gap_s_whole"]
    return r


def print_scheduler_report(r: dict[str, Any]) -> None:
    print(f"prefix caching: {r['n_requests']} requests sharing a {r['system_tokens']}-token system prompt, one after "
          f"another: mean time to first token {1000 * r['ttft_mean_s_cached']:.0f} ms cached vs "
          f"{1000 * r['ttft_mean_s_uncached']:.0f} ms not = {r['ttft_ratio']:.2f}x (goal: <= 0.3x); "
          f"{100 * r['prefix_hit_rate']:.0f}% of prompt tokens found in the cache; same answers: {r['same_answers']}")
    print(f"chunked prefill: a {r['long_prompt_tokens']}-token prompt arrives while {r['streams']} requests stream: "
          f"their worst gap between tokens {1000 * r['worst_gap_s_chunked']:.0f} ms with {r['chunk']}-token chunks vs "
          f"{1000 * r['worst_gap_s_whole']:.0f} ms whole = {r['gap_ratio']:.2f}x (goal: <= 0.25x)")
