"""``bench serve``: the HTTP server under load, minillm serve against transformers serve.

Clients arrive at random (a seeded Poisson stream), each with the same system prompt and a
question of its own, and stream their answers over loopback from ``python -m minillm serve``
(with prefix caching and chunked prefill on and off) and from ``transformers serve``
(transformers' own OpenAI-compatible server) on the same weights. The servers take turns,
round by round, on the same load; the ratios are taken against the peer measured in the run.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from minillm.assets import corpus_path, default_gguf_path
from minillm.bench.load_client import (
    ServerProcess,
    children_env,
    fetch_metrics,
    free_port,
    load_summary,
    run_load,
    serve_body,
)
from minillm.bench.timing import ratio_range, value_range
from minillm.bench.workloads import poisson_arrivals
from minillm.tokenizer import Tokenizer

MINILLM_SERVE_CONFIGS: dict[str, tuple[str, list[str]]] = {  # name -> (label, `minillm serve` flags)
    "on": ("minillm serve (prefix cache + chunked prefill)", []),  # the defaults
    "no-cache": ("minillm serve --no-prefix-caching", ["--no-prefix-caching"]),
    "no-chunk": ("minillm serve --prefill-chunk-tokens 0", ["--prefill-chunk-tokens", "0"]),
    "off": ("minillm serve (neither)", ["--no-prefix-caching", "--prefill-chunk-tokens", "0"]),
}
TRANSFORMERS_SERVE_MODES: dict[str, str] = {  # name -> label
    "cb": "transformers serve --continuous-batching",
    "generate": "transformers serve (one generate() at a time)",
}
HF_CB_PAGE_TOKENS = 256  # transformers' continuous batching: tokens per KV page (its default page_size)
SERVE_TOPICS = ("the weather", "the main character", "money", "the city", "a promise", "the sea", "a letter",
                "the king", "food", "a journey", "the night", "a friend", "the law", "music", "a secret", "time")


def serve_system_prompts(tok: Tokenizer, n_tokens: int, count: int) -> list[str]:
    """``count`` different system prompts of ``n_tokens`` corpus tokens each (consecutive slices).

    Each round of ``bench serve`` takes its own, so every run starts with nothing of its system
    prompt in any prefix cache: the runs of a round, and the rounds, are the same load.
    """
    text = corpus_path().read_text(encoding="utf-8")
    ids = tok.encode(text[: 8 * n_tokens * count + 4096])
    if len(ids) < n_tokens * count:
        raise ValueError(f"the corpus gives {len(ids)} tokens, fewer than {count} system prompts of {n_tokens}")
    return [tok.decode(ids[i * n_tokens:(i + 1) * n_tokens]) for i in range(count)]


def serve_conversations(system: str, n_requests: int) -> list[list[dict[str, str]]]:
    """One chat per client: the shared ``system`` prompt, then a question no other client asks."""
    return [[{"role": "system", "content": system},
             {"role": "user", "content": f"Question {i + 1}: what does the text above say about "
                                         f"{SERVE_TOPICS[i % len(SERVE_TOPICS)]}? Answer in a few sentences."}]
            for i in range(n_requests)]


@dataclass
class _Plan:
    """One server to measure: its key in the report, its label, its request dialect, its command."""

    name: str
    label: str
    dialect: str  # "minillm" or "transformers"
    argv: list[str]


def _check_options(dtype: str, minillm_configs: tuple[str, ...], transformers_modes: tuple[str, ...],
                   counts: tuple[int, ...], rate: float) -> None:
    if dtype not in ("float32", "bfloat16"):
        raise ValueError(f"bench serve runs float32 or bfloat16 (minillm serve's --weights), not {dtype}")
    for name in minillm_configs:
        if name not in MINILLM_SERVE_CONFIGS:
            raise ValueError(f"unknown minillm configuration {name!r}: pick from {', '.join(MINILLM_SERVE_CONFIGS)}")
    for name in transformers_modes:
        if name not in TRANSFORMERS_SERVE_MODES:
            raise ValueError(f"unknown transformers mode {name!r}: pick from {', '.join(TRANSFORMERS_SERVE_MODES)}")
    if min(counts) < 1 or rate <= 0:
        raise ValueError("requests, rounds, max_tokens and system_tokens must be >= 1, and the rate > 0")


def _plans(folder: Path, device: str, dtype: str, max_batch_size: int, kv_tokens: int,
           minillm_configs: tuple[str, ...], transformers_modes: tuple[str, ...]) -> list[_Plan]:
    plans = []
    for name in minillm_configs:
        label, flags = MINILLM_SERVE_CONFIGS[name]
        plans.append(_Plan(f"minillm:{name}", label, "minillm",
                           [sys.executable, "-m", "minillm", "serve", "--model", str(folder), "--device", device,
                            "--weights", dtype, "--max-batch-size", str(max_batch_size), *flags]))
    for name in transformers_modes:
        argv = [sys.executable, "-m", "transformers.cli.transformers", "serve", str(folder), "--device", device,
                "--dtype", dtype, "--host", "127.0.0.1", "--log-level", "warning"]
        if name == "cb":
            argv += ["--continuous-batching", "--cb-num-blocks", str(-(-kv_tokens // HF_CB_PAGE_TOKENS))]
        plans.append(_Plan(f"transformers:{name}", TRANSFORMERS_SERVE_MODES[name], "transformers", argv))
    return plans


def _start(plan: _Plan, logs: Path, stack: ExitStack, warm_up: list[list[dict[str, str]]], entry: dict[str, Any],
           ready_timeout: float, request_timeout: float) -> ServerProcess | None:
    """Start ``plan``'s server (stopped when ``stack`` closes), wait until it is ready and warm it up.

    A minillm server that fails raises; a transformers one is stopped and its error noted in
    ``entry``, and None is returned, so that minillm's configurations are still measured."""
    port = free_port()
    argv = [*plan.argv, "--port", str(port)]
    start = time.perf_counter()
    print(f"bench serve: starting {plan.label} ...", file=sys.stderr, flush=True)
    server = ServerProcess(plan.name, argv, port, logs / f"{plan.name.replace(':', '-')}.log", children_env())
    stack.callback(server.stop)
    entry.update(command=" ".join(argv[1:]), runs=[])
    try:
        server.wait_ready(ready_timeout)
        rows = run_load(server.url, [serve_body(plan.dialect, m, 4) for m in warm_up], [0.0, 0.0], request_timeout)
        if any(row["error"] for row in rows):
            raise RuntimeError(f"{plan.label}: the warm-up requests failed: {load_summary(rows)['first_errors']}; "
                               f"its log ends:\n{server.log_tail()}")
    except RuntimeError as err:
        if plan.dialect == "minillm":
            raise
        server.stop()
        entry["error"] = str(err)
        print(f"bench serve: {plan.label} could not run: {err}", file=sys.stderr, flush=True)
        return None
    entry["ready_s"] = time.perf_counter() - start
    return server


def _one_run(server: ServerProcess, dialect: str, conversations: list[list[dict[str, str]]],
             arrivals: list[float], max_tokens: int, request_timeout: float) -> tuple[dict[str, Any], list[str]]:
    """One load against one server: its summary (with minillm's prefix-cache hit rate, read from
    its ``/metrics`` counters before and after) and the answers' texts."""
    before = fetch_metrics(server.url) if dialect == "minillm" else {}
    rows = run_load(server.url, [serve_body(dialect, m, max_tokens) for m in conversations], arrivals,
                    request_timeout)
    summary = load_summary(rows)
    if dialect == "minillm":
        after = fetch_metrics(server.url)
        hits, queries = (after.get(f"minillm_prefix_cache_{k}_tokens_total", 0.0)
                         - before.get(f"minillm_prefix_cache_{k}_tokens_total", 0.0) for k in ("hit", "query"))
        summary["prompt_tokens"] = queries
        summary["prefix_hit_rate"] = hits / queries if queries else 0.0
    else:
        summary["prefix_hit_rate"] = None  # transformers serve reports no such count
    return summary, [row["text"] for row in rows]


def _compare_answers(systems: dict[str, Any], texts: dict[str, list[list[str]]]) -> None:
    """The same greedy answers from the same weights: both sides did the same work."""
    if "minillm:on" not in texts:
        return
    for name, answers in texts.items():
        if name.startswith("transformers:"):
            pairs = [(a, b) for ours, theirs in zip(texts["minillm:on"], answers) for a, b in zip(ours, theirs)]
            systems[name]["same_answers_as_minillm"] = (sum(a == b for a, b in pairs), len(pairs))


def _best_of_rounds(entry: dict[str, Any], tokens_per_run: int) -> None:
    runs = entry["runs"]
    if not runs:
        return
    entry["best"] = {"tok_s": value_range([run["tok_s"] for run in runs], max)}
    for metric in ("ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms"):
        entry["best"][metric] = value_range([run[metric] for run in runs], min)
    entry["errors"] = sum(run["errors"] for run in runs)
    entry["tokens_expected"] = tokens_per_run * len(runs)
    entry["tokens_returned"] = sum(run["tokens"] for run in runs)


def serve_ratios(systems: dict[str, Any]) -> list[dict[str, Any]]:
    """minillm's default configuration against each transformers mode that ran: throughput
    (minillm / transformers) and p99 TTFT (minillm / transformers), best of rounds against best
    of rounds, and the range of the same ratio taken round by round (each round's runs were
    neighbours in time)."""
    ours = systems.get("minillm:on")
    out: list[dict[str, Any]] = []
    if not ours or not ours["runs"]:
        return out
    for name, theirs in systems.items():
        if not name.startswith("transformers:") or not theirs["runs"]:
            continue
        row: dict[str, Any] = {"against": name, "label": theirs["label"]}
        for metric, key in (("tok_s", "throughput"), ("ttft_p99_ms", "ttft_p99")):
            a, b = ours["best"][metric]["best"], theirs["best"][metric]["best"]
            row[key] = a / b if a is not None and b else None
            row[f"{key}_per_round"] = ratio_range([x[metric] for x in ours["runs"]], [y[metric] for y in theirs["runs"]])
        out.append(row)
    return out


@contextmanager
def _sigterm_interrupts() -> Iterator[None]:
    """SIGTERM ends the benchmark as Ctrl-C does, through the servers' cleanup (main thread only)."""
    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    in_main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, interrupt) if in_main else None
    try:
        yield
    finally:
        if in_main:
            signal.signal(signal.SIGTERM, previous)


def bench_serve(n_requests: int = 32, rate: float = 8.0, max_tokens: int = 32, system_tokens: int = 256,
                rounds: int = 2, seed: int = 0, source: Path | None = None, device: str | None = None,
                dtype: str = "float32", max_batch_size: int = 32,
                minillm_configs: tuple[str, ...] = tuple(MINILLM_SERVE_CONFIGS),
                transformers_modes: tuple[str, ...] = tuple(TRANSFORMERS_SERVE_MODES),
                ready_timeout: float = 900.0, request_timeout: float = 600.0) -> dict[str, Any]:
    """``python -m minillm serve`` under a seeded Poisson load of ``n_requests`` streaming chat
    clients (``rate`` per second; a shared ``system_tokens``-token system prompt from the corpus
    and a distinct question each; greedy, exactly ``max_tokens`` tokens each), once per
    configuration of prefix caching and chunked prefill, and ``transformers serve`` on the same
    weights (an HF folder: the default GGUF's conversion), in the same run.

    Every server is a subprocess on a free port of 127.0.0.1, started once, warmed up and ended
    at the end, whatever happens. In each of ``rounds`` rounds every server gets the same load
    (the same arrival times; a system prompt of that round's own, so no cache starts warm). Per
    run: output tokens/s, TTFT / TPOT p50 and p99, errors, and minillm's prefix-cache hit rate.

    transformers is run as its serving docs advise for concurrent clients, with continuous
    batching, its KV cache sized to minillm's pool (``max_batch_size`` x 1024 tokens); and
    plainly, one ``generate()`` after another. If it cannot start, the report says why and
    minillm's configurations are still measured.
    """
    import tempfile

    import torch

    from minillm.model.loading import convert_gguf

    _check_options(dtype, minillm_configs, transformers_modes, (n_requests, rounds, max_tokens, system_tokens), rate)
    source = Path(source) if source is not None else None
    folder = source if source is not None and source.is_dir() else convert_gguf(source or default_gguf_path())
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    tok = Tokenizer.from_file(folder / "tokenizer.json")
    systems_text = serve_system_prompts(tok, system_tokens, rounds + 1)  # the last one is the warm-up's
    arrivals = poisson_arrivals(n_requests, rate, seed)
    kv_tokens = max_batch_size * 1024  # minillm's pool (Engine's default), and transformers' cache size
    r: dict[str, Any] = {
        "model": str(folder), "device": device, "dtype": dtype, "threads": torch.get_num_threads(),
        "requests": n_requests, "rate": rate, "max_tokens": max_tokens, "system_tokens": system_tokens,
        "rounds": rounds, "seed": seed, "max_batch_size": max_batch_size, "kv_tokens": kv_tokens,
        "arrival_span_s": arrivals[-1], "systems": {}, "transformers_error": None,
    }
    plans = _plans(folder, device, dtype, max_batch_size, kv_tokens, minillm_configs, transformers_modes)
    with (_sigterm_interrupts(), tempfile.TemporaryDirectory(prefix="minillm-bench-serve-") as logs,
          ExitStack() as stack):
        servers: dict[str, tuple[ServerProcess, str]] = {}
        for plan in plans:
            entry = r["systems"][plan.name] = {"label": plan.label}
            server = _start(plan, Path(logs), stack, serve_conversations(systems_text[-1], 2), entry,
                            ready_timeout, request_timeout)
            if server is None:
                r["transformers_error"] = (r["transformers_error"] or "") + f"{plan.label}: {entry['error']}\n"
            else:
                servers[plan.name] = (server, plan.dialect)
        texts: dict[str, list[list[str]]] = {name: [] for name in servers}
        for round_index in range(rounds):
            conversations = serve_conversations(systems_text[round_index], n_requests)
            for name, (server, dialect) in servers.items():
                summary, answers = _one_run(server, dialect, conversations, arrivals, max_tokens, request_timeout)
                summary["round"] = round_index + 1
                r["systems"][name]["runs"].append(summary)
                texts[name].append(answers)
                print(f"bench serve: round {round_index + 1}, {r['systems'][name]['label']}: "
                      f"{summary['tok_s']:.1f} tok/s, {summary['errors']} errors", file=sys.stderr, flush=True)
        for name, (server, _) in servers.items():
            r["systems"][name]["peak_rss_mb"] = server.peak_rss_mb()
        _compare_answers(r["systems"], texts)
    for entry in r["systems"].values():
        _best_of_rounds(entry, n_requests * max_tokens)
    r["ratios"] = serve_ratios(r["systems"])
    return r


# --------------------------------------------------------------------------- the report
def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _print_runs(r: dict[str, Any]) -> None:
    print(f"  {'server':<48}{'round':>6}{'tok/s':>8}{'TTFT p50':>10}{'TTFT p99':>10}{'TPOT p50':>10}"
          f"{'TPOT p99':>10}{'prefix hits':>13}{'errors':>8}")
    for entry in r["systems"].values():
        if "error" in entry:
            print(f"  {entry['label']:<48}  did not run (see below)")
        for run in entry["runs"]:
            hits = "n/a" if run["prefix_hit_rate"] is None else f"{100 * run['prefix_hit_rate']:.0f}%"
            print(f"  {entry['label']:<48}{run['round']:>6}{run['tok_s']:>8.1f}{_fmt(run['ttft_p50_ms'], '.0f'):>10}"
                  f"{_fmt(run['ttft_p99_ms'], '.0f'):>10}{_fmt(run['tpot_p50_ms'], '.1f'):>10}"
                  f"{_fmt(run['tpot_p99_ms'], '.1f'):>10}{hits:>13}{run['errors']:>5}/{run['requests']}")
            for error in run["first_errors"]:
                print(f"      error: {error}")


def _print_best(entry: dict[str, Any]) -> None:
    b = entry["best"]

    def cell(key: str, spec: str) -> str:
        v = b[key]
        return f"{_fmt(v['best'], spec)} ({_fmt(v['min'], spec)}-{_fmt(v['max'], spec)})"

    short = "" if entry["tokens_returned"] == entry["tokens_expected"] else \
        f"; returned {entry['tokens_returned']} of {entry['tokens_expected']} tokens"
    if entry.get("peak_rss_mb"):
        short += f", peak RSS {entry['peak_rss_mb']:.0f} MB"
    if "same_answers_as_minillm" in entry:
        same, total = entry["same_answers_as_minillm"]
        short += f", {same}/{total} answers the same as minillm's"
    print(f"  {entry['label']:<48} {cell('tok_s', '.1f')} tok/s, TTFT p99 {cell('ttft_p99_ms', '.0f')}, "
          f"TPOT p50 {cell('tpot_p50_ms', '.1f')}{short}")


def _print_ratio(row: dict[str, Any]) -> None:
    def ratio(key: str) -> str:
        low_high = row[f"{key}_per_round"]
        per_round = f"; per round {low_high[0]:.2f}-{low_high[1]:.2f}x" if low_high else ""
        return f"{_fmt(row[key], '.2f')}x{per_round}"

    print(f"minillm serve (defaults) vs {row['label']}: throughput {ratio('throughput')} (goal: >= 2x); "
          f"p99 TTFT {ratio('ttft_p99')} (goal: <= 0.5x)")


def print_serve_report(r: dict[str, Any]) -> None:
    print(f"bench serve: {r['requests']} streaming chat clients per run, Poisson arrivals at {r['rate']:g}/s "
          f"(seed {r['seed']}; the last sent at {r['arrival_span_s']:.1f} s), a {r['system_tokens']}-token shared "
          f"system prompt + a distinct question each, {r['max_tokens']} greedy tokens per answer; "
          f"{r['rounds']} interleaved round(s); {r['device']}, {r['dtype']}, {r['threads']} threads; "
          f"weights: {r['model']}; times in ms")
    _print_runs(r)
    print("  best of rounds (range over rounds):")
    for entry in r["systems"].values():
        if entry["runs"]:
            _print_best(entry)
    for row in r["ratios"]:
        _print_ratio(row)
    late = max((run["late_max_ms"] for entry in r["systems"].values() for run in entry["runs"]), default=0.0)
    if late > 50:
        print(f"note: the client sent some requests up to {late:.0f} ms behind their schedule (a busy machine)")
    if r["transformers_error"]:
        print(f"transformers serve could not run here:\n{r['transformers_error'].rstrip()}")


def _names(value: str) -> tuple[str, ...]:
    """A comma-separated list of names ('none' or nothing: no names)."""
    names = tuple(name.strip() for name in value.split(",") if name.strip())
    return () if names == ("none",) else names


def run(args: argparse.Namespace) -> dict[str, Any]:
    return bench_serve(args.requests, args.rate, args.max_tokens, args.system_tokens, args.rounds, args.seed,
                       source=args.model, device=args.device, dtype=args.dtype, max_batch_size=args.max_batch_size,
                       minillm_configs=_names(args.minillm_configs),
                       transformers_modes=_names(args.transformers_modes))
