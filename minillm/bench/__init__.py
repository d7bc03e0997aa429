"""Benchmarks: minillm against the reference library, measured in the same run.

Speed goals are ratios, never absolute timings: both sides run on the same machine, on the
same input, taking turns in rounds (``timing``), and each side is timed as the best of its rounds.
One module per benchmark, each with ``run(args)`` (the command line's entry) and its printer:

    python -m minillm bench tokenizer [--json]
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import Any

from minillm.bench import (
    batching,
    cache,
    context,
    cpu,
    gpu,
    latency,
    load,
    model,
    quant,
    scheduler,
    serve,
    speculative,
    structured,
    tokenizer,
    tp,
)
from minillm.bench.batching import BATCH_PROMPTS, bench_batching, print_batching_report
from minillm.bench.cache import bench_cache, kv_waste, mixed_workload, print_cache_report
from minillm.bench.context import bench_context, print_context_report
from minillm.bench.cpu import bench_cpu_settings, print_cpu_settings_report
from minillm.bench.latency import bench_latency, latency_summary, print_latency_report, serve_arrivals
from minillm.bench.load import bench_load, print_load_report
from minillm.bench.load_client import ServerProcess, free_port, load_summary, prometheus_values, run_load, serve_body
from minillm.bench.model import bench_model, print_model_report
from minillm.bench.quant import (
    HELD_OUT_CHARS,
    QUANT_FORMATS,
    bench_quant,
    format_quality,
    held_out_tokens,
    print_quant_report,
)
from minillm.bench.scheduler import bench_scheduler, print_scheduler_report
from minillm.bench.serve import (
    HF_CB_PAGE_TOKENS,
    MINILLM_SERVE_CONFIGS,
    SERVE_TOPICS,
    TRANSFORMERS_SERVE_MODES,
    bench_serve,
    print_serve_report,
    serve_conversations,
    serve_ratios,
    serve_system_prompts,
)
from minillm.bench.timing import (
    BANDWIDTH_BYTES,
    bandwidth_reader,
    best_time,
    interleaved,
    interleaved_best,
    percentile,
)
from minillm.bench.tokenizer import bench_tokenizer, print_tokenizer_report
from minillm.bench.tp import bench_tp, print_tp_report
from minillm.bench.workloads import DECODE_PROMPT_TOKENS, corpus_prompt, poisson_arrivals

# `python -m minillm bench NAME`: its module's run(args), and the printer of its results
BENCHMARKS: dict[str, tuple[Callable[[argparse.Namespace], dict[str, Any]], Callable[[dict[str, Any]], None]]] = {
    "model": (model.run, print_model_report),
    "cpu": (cpu.run, print_cpu_settings_report),
    "tokenizer": (tokenizer.run, print_tokenizer_report),
    "cache": (cache.run, print_cache_report),
    "batching": (batching.run, print_batching_report),
    "context": (context.run, print_context_report),
    "latency": (latency.run, print_latency_report),
    "load": (load.run, print_load_report),
    "quant": (quant.run, print_quant_report),
    "scheduler": (scheduler.run, print_scheduler_report),
    "serve": (serve.run, print_serve_report),
    "structured": (structured.run, structured.print_structured_report),
    "speculative": (speculative.run, speculative.print_speculative_report),
    "gpu": (gpu.run, gpu.print_gpu_report),
    "tp": (tp.run, print_tp_report),
}


def main(args: argparse.Namespace) -> None:
    """Run the benchmark ``args.target`` names; print its report, or its results as one JSON object."""
    run, report = BENCHMARKS[args.target]
    results = run(args)
    if args.json:
        print(json.dumps(results))
    else:
        report(results)


__all__ = [
    "BANDWIDTH_BYTES", "BATCH_PROMPTS", "BENCHMARKS", "DECODE_PROMPT_TOKENS", "HELD_OUT_CHARS", "HF_CB_PAGE_TOKENS",
    "MINILLM_SERVE_CONFIGS", "QUANT_FORMATS", "SERVE_TOPICS", "TRANSFORMERS_SERVE_MODES", "ServerProcess",
    "bandwidth_reader", "bench_batching", "bench_cache", "bench_context", "bench_cpu_settings", "bench_latency",
    "bench_load", "bench_model", "bench_quant", "bench_scheduler", "bench_serve", "bench_tokenizer", "bench_tp", "best_time",
    "corpus_prompt", "format_quality", "free_port", "held_out_tokens", "interleaved", "interleaved_best",
    "kv_waste", "latency_summary", "load_summary", "main", "mixed_workload", "percentile", "poisson_arrivals",
    "print_batching_report", "print_cache_report", "print_context_report", "print_cpu_settings_report",
    "print_latency_report", "print_load_report", "print_model_report", "print_quant_report",
    "print_scheduler_report", "print_serve_report", "print_tokenizer_report", "print_tp_report", "prometheus_values", "run_load",
    "serve_arrivals", "serve_body", "serve_conversations", "serve_ratios", "serve_system_prompts",
]
