"""The benchmarks package: the names notebooks and scripts import, the timing of peers in
rounds, the command line's ``bench`` targets, and the GPU check's watch on the compiler.

Nothing here runs a benchmark at full size, and nothing asserts on wall time.
"""

from __future__ import annotations

import json

import torch

import minillm.bench as bench
from minillm.__main__ import main
from minillm.bench.gpu import CompileWatch
from minillm.bench.timing import interleaved, interleaved_best, ratio_range, value_range

# imported by name in the notebooks, the tests and the README
NAMES = ["bench_model", "corpus_prompt", "percentile", "poisson_arrivals", "bandwidth_reader", "format_quality",
         "held_out_tokens", "interleaved_best", "kv_waste", "mixed_workload", "latency_summary", "serve_arrivals",
         "BATCH_PROMPTS", "bench_context", "best_time", "print_context_report", "print_model_report",
         "print_serve_report", "ServerProcess", "load_summary", "prometheus_values", "run_load", "serve_body",
         "serve_conversations", "serve_ratios", "serve_system_prompts"]


def test_the_package_keeps_every_name_it_is_imported_by():
    missing = [name for name in NAMES if not hasattr(bench, name)]
    assert not missing
    assert set(bench.BENCHMARKS) == {"model", "cpu", "tokenizer", "cache", "batching", "context", "latency", "load",
                                     "quant", "scheduler", "serve", "structured", "gpu", "speculative", "tp"}


def test_bench_structured_reports_both_batches_and_a_missing_peer(capsys):
    from minillm.bench.structured import print_structured_report

    print_structured_report({"weights": "native", "backend": "packed-cpu", "new_tokens": 64,
                             "b1_free_tok_s": 100.0, "b1_constrained_tok_s": 97.0, "b1_ratio_range": (0.95, 0.99),
                             "b8_free_tok_s": 300.0, "b8_constrained_tok_s": 291.0, "b8_ratio_range": (0.96, 0.98),
                             "index_first_state_s": 0.4, "index_all_states_s": 2.9, "index_states": 4536,
                             "outlines_core_index_s": None})
    out = capsys.readouterr().out
    assert "batch 1: 97.0 tok/s constrained vs 100.0 free: 0.95-0.99x" in out
    assert "batch 8" in out and "4536 states" in out and "outlines-core not installed" in out


def test_peers_take_turns_and_each_keeps_every_round():
    calls: list[str] = []
    measured = interleaved({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}, repeats=3)
    assert calls == ["a", "b"] * 3  # A, B, A, B: a slow spell hits both alike
    assert {name: len(m.times) for name, m in measured.items()} == {"a": 3, "b": 3}
    best = interleaved_best({"x": lambda: None}, repeats=2)
    assert list(best) == ["x"] and best["x"] >= 0


def test_ranges_and_round_by_round_ratios_by_hand():
    assert value_range([3.0, None, 1.0, 2.0], max) == {"best": 3.0, "min": 1.0, "max": 3.0}
    assert value_range([None], min) == {"best": None, "min": None, "max": None}
    assert ratio_range([4.0, 3.0, None], [2.0, 1.0, 5.0]) == (2.0, 3.0)
    assert ratio_range([1.0], [0.0]) is None


def test_bench_gpu_prepare_writes_the_config_and_tokenizer(tmp_path, capsys):
    assert main(["bench", "gpu", "prepare", str(tmp_path / "assets"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == {"prepared": str(tmp_path / "assets")}
    assert sorted(p.name for p in (tmp_path / "assets").iterdir()) == ["config.json", "tokenizer.json"]


def test_bench_load_prints_its_report(capsys):
    assert main(["bench", "load"]) == 0
    assert capsys.readouterr().out.startswith("load_model() after conversion: ")


def test_the_compile_watch_counts_recompiles_and_no_cuda_graph_on_a_cpu(cxx_compiler):
    double = torch.compile(lambda x: (2 * x).sum(), dynamic=False)
    double(torch.ones(3))
    with CompileWatch() as watch:
        double(torch.ones(4))  # a new shape: a recompile
        double(torch.ones(4))  # the same: none
    r = watch.result()
    assert r["recompiles"] == 1 and "size mismatch" in r["recompile_reasons"][0]
    assert r["cuda_graphs_captured"] == r["cuda_graphs_replayed"] == 0 and not r["recompile_limit_hit"]
