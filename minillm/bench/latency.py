"""``bench latency``: requests arriving over time (seeded Poisson streams), served with continuous
batching and one at a time: time to first token and time per output token."""

from __future__ import annotations

import argparse
import time
from typing import Any

from minillm.bench.timing import percentile
from minillm.bench.workloads import corpus_prompt, poisson_arrivals


def serve_arrivals(engine: Any, prompts: list[Any], params: list[Any], arrivals: list[float]) -> list[dict[str, float]]:
    """Run ``engine`` as a server would: each request is added when its arrival time comes, and
    the engine steps while anything is queued or running (it sleeps when idle).

    Per request, in seconds: ``ttft`` (time to first token: queueing + prefill + one sample,
    from its arrival), ``tpot`` (time per output token after the first, the decode pace it
    saw), ``latency`` (arrival to last token) and ``tokens``.
    """
    start = time.perf_counter()
    queue = sorted(zip(arrivals, range(len(prompts))))
    stamps: dict[int, dict[str, float]] = {}
    requests: list[Any] = [None] * len(prompts)
    index_of: dict[int, int] = {}
    while queue or engine.has_unfinished_requests():
        now = time.perf_counter() - start
        while queue and queue[0][0] <= now:
            arrival, i = queue.pop(0)
            requests[i] = engine.add_request(prompts[i], params[i])
            index_of[id(requests[i])] = i
            stamps[i] = {"arrival": arrival}
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, queue[0][0] - now))
            continue
        events = engine.step()
        now = time.perf_counter() - start
        for request, _ in events:
            s = stamps[index_of[id(request)]]
            s.setdefault("first", now)
            if request.finished:
                s["done"] = now
    rows = []
    for i, request in enumerate(requests):
        s, n = stamps[i], len(request.output_ids)
        s.setdefault("first", s["arrival"])  # nothing to generate (max_new_tokens=0): done on arrival
        s.setdefault("done", s["first"])
        rows.append({"ttft": s["first"] - s["arrival"], "latency": s["done"] - s["arrival"], "tokens": n,
                     "tpot": (s["done"] - s["first"]) / (n - 1) if n > 1 else 0.0})
    return rows


def latency_summary(rows: list[dict[str, float]]) -> dict[str, float]:
    """p50 and p99 of TTFT and TPOT over requests, in milliseconds."""
    summary = {}
    for metric in ("ttft", "tpot"):
        values = [1000 * row[metric] for row in rows]
        summary[f"{metric}_p50_ms"] = percentile(values, 50)
        summary[f"{metric}_p99_ms"] = percentile(values, 99)
    return summary


def run(args: argparse.Namespace) -> dict[str, Any]:
    return bench_latency()


def bench_latency(rates: tuple[float, ...] = (1.0, 2.0, 4.0, 8.0), n_requests: int = 32, new_tokens: int = 32,
                  seed: int = 0) -> dict[str, Any]:
    """Requests arriving over time (seeded Poisson streams at several rates), served by the
    Engine with continuous batching (up to 16 rows) and by the same Engine one request at a
    time (``max_batch_size=1``, a FIFO server): TTFT and TPOT p50/p99 and throughput per rate.

    One request at a time, TTFT explodes once requests arrive faster than one answer takes
    (the queue grows without bound); with continuous batching a newcomer waits at most one
    step plus its prefill, and the cost shows up instead as a slower decode pace (TPOT) for
    everyone while the batch is larger.
    """
    from minillm.engine import Engine
    from minillm.model import load_model
    from minillm.sampling import SamplingParams

    model, tok = load_model(device="cpu")
    corpus = corpus_prompt(tok, 4096)
    lengths = [8 + (37 * i) % 120 for i in range(n_requests)]  # mixed prompts, 8-127 tokens
    prompts = [corpus[(53 * i) % 3900:][:n] for i, n in enumerate(lengths)]
    params = [SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)] * n_requests
    engines = {"batched": Engine(model, tok, max_batch_size=16), "one_at_a_time": Engine(model, tok, max_batch_size=1)}
    for engine in engines.values():  # compile (or load) both decode programs before timing
        engine.generate(prompts[:2], SamplingParams(max_new_tokens=3))
        engine.generate(prompts[:1], SamplingParams(max_new_tokens=3))
    rows = []
    for rate in rates:
        arrivals = poisson_arrivals(n_requests, rate, seed)
        for name, engine in engines.items():
            served = serve_arrivals(engine, prompts, params, arrivals)
            span = max(arrivals[i] + row["latency"] for i, row in enumerate(served)) - arrivals[0]
            rows.append({"rate": rate, "engine": name, **latency_summary(served),
                         "tok_s": sum(row["tokens"] for row in served) / span})
    return {"rows": rows, "requests": n_requests, "new_tokens": new_tokens, "prompt_tokens": (min(lengths), max(lengths))}


def print_latency_report(r: dict[str, Any]) -> None:
    low, high = r["prompt_tokens"]
    print(f"{r['requests']} requests per rate (Poisson arrivals), prompts of {low}-{high} tokens, "
          f"{r['new_tokens']} new tokens each; times in ms")
    print(f"  {'req/s':>5} {'engine':<15} {'TTFT p50':>9} {'TTFT p99':>9} {'TPOT p50':>9} {'TPOT p99':>9} {'tok/s':>7}")
    for row in r["rows"]:
        print(f"  {row['rate']:>5.1f} {row['engine']:<15} {row['ttft_p50_ms']:>9.0f} {row['ttft_p99_ms']:>9.0f} "
              f"{row['tpot_p50_ms']:>9.1f} {row['tpot_p99_ms']:>9.1f} {row['tok_s']:>7.1f}")
