"""``bench tp``: tensor parallelism on this machine's CPU, measured, and the cost model that carries it to real links.

A rank stands for a device: one thread each (``threads``), so two ranks use twice the cores one
process does, as two GPUs are twice one. Measured (eager backend, gloo over loopback, the ranks
started by ``launch.run_ranks``), seconds per decode step at batch 1 and 8:

* **1 process**: the whole model;
* **2 ranks**, the engine's way: rank 0 drives a ``ModelRunner`` whose backend is
  ``TensorParallelBackend`` (it broadcasts each step's inputs), rank 1 runs ``serve_steps``;
* **2 ranks, collectives off**: the same, with the model's all-reduces returning the rank's own
  partial sum and its all-gather padding the rank's own logits (the step broadcast still runs): a
  rank's arithmetic alone, under the same contention as the real run. Its tokens are garbage;
  its time is the compute;
* **collectives alone**: the step's ``2L + 1`` all-reduces and its all-gather, with nothing
  between them: what the link costs.

Compute and communication are told apart two ways, which should roughly agree: (1) the real step
minus the step with the collectives off; (2) the seconds spent inside the collectives, timed on
rank 0 by wrapping its ``Group``'s ``all_reduce``, ``all_gather`` and ``broadcast`` (the wrappers
count calls and bytes too). Time inside a collective includes waiting for the slower rank: rank 0
holds 2 of SmolLM2's 3 GQA groups, so rank 1 waits for it (its seconds in the all-reduces are
reported too). So (2) is transfer plus skew; (1) is what the collectives add to the step. On a
machine busy with other work each collective also waits until both ranks are scheduled: the
step's ``2L + 1`` meeting points make tensor parallelism sensitive to that.

The configurations take turns, round after round, so a slow spell of the machine hits all alike:
rank 0 holds the whole model as well as its shard and runs the one-process configuration between
the two-rank ones, while rank 1 waits in ``serve_steps``. Each configuration prefills the same
prompts, then decodes ``new_tokens`` steps greedily (argmax read back on the host, as the engine
does); a round's figure is its mean step; the report gives the best round and the range.

The bytes the collectives carried are checked against ``tp_cost.step_bytes``. A link fitted to
the collectives-alone times (latency per message, bandwidth) is this machine's gloo in the cost
model, which then predicts the two-rank step from the one-process step (set beside the measured
one), and the step over NVLink, PCIe and Ethernet (stated parameters), and where splitting pays.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import Any

import torch

from minillm.assets import corpus_path, default_gguf_path
from minillm.bench import tp_cost
from minillm.cache.paged import PagedKVCache
from minillm.distributed.group import Group
from minillm.distributed.launch import run_ranks
from minillm.distributed.loader import load_tensor_parallel, read_config
from minillm.distributed.step import TensorParallelBackend, TensorParallelKVCache, receive_pool_size, serve_steps
from minillm.engine.backends.eager import EagerBackend
from minillm.engine.runner import ModelRunner
from minillm.engine.tensor_parallel import follow
from minillm.model.loading import DTYPES, convert_gguf, load_model
from minillm.tokenizer import Tokenizer

PHASES = ("1 process", "2 ranks", "2 ranks, collectives off", "collectives alone")
OPS = ("all_reduce", "all_gather", "broadcast")
BLOCK_SIZE = 16
TEXT_CHARS = 20_000  # of the corpus, for the prompts


class CollectiveMeter:
    """Wraps a ``Group``'s collectives, on the instance (the model's layers call them through it):
    seconds, calls and bytes of each while ``counting``. ``off`` makes ``all_reduce`` and
    ``all_gather`` local no-ops of the right shape; ``broadcast`` always runs (the workers need the steps)."""

    def __init__(self, group: Group) -> None:
        self.rank, self.world = group.rank, group.world_size
        self.counting, self.off = False, False
        self.reset()
        for op in OPS:
            setattr(group, op, self._wrap(op, getattr(group, op)))

    def reset(self) -> None:
        self.seconds = dict.fromkeys(OPS, 0.0)
        self.calls = dict.fromkeys(OPS, 0)
        self.bytes = dict.fromkeys(OPS, 0)

    def _wrap(self, op: str, original: Any) -> Any:
        def collective(x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            start = time.perf_counter()
            if self.off and op == "all_reduce":
                out = x
            elif self.off and op == "all_gather":
                out = torch.nn.functional.pad(x, (0, sum(args[0]) - x.shape[-1]))
            else:
                out = original(x, *args, **kwargs)
            if self.counting:
                self.seconds[op] += time.perf_counter() - start
                self.calls[op] += 1
                moved = x.numel() // x.shape[-1] * max(args[0]) * self.world if op == "all_gather" else x.numel()
                self.bytes[op] += moved * x.element_size()
            return out

        return collective


class DecodeCounted:
    """A worker's backend: its meter counts during decode steps only (the report is per decode step)."""

    def __init__(self, inner: EagerBackend, meter: CollectiveMeter) -> None:
        self.inner, self.meter = inner, meter

    def prefill(self, token_ids: torch.Tensor, step: Any) -> torch.Tensor:
        return self.inner.prefill(token_ids, step)

    def decode(self, token_ids: torch.Tensor, step: Any) -> torch.Tensor:
        self.meter.counting = True
        try:
            return self.inner.decode(token_ids, step)
        finally:
            self.meter.counting = False


def decode_run(runner: ModelRunner, cache: PagedKVCache, prompts: list[list[int]], new_tokens: int,
               meter: CollectiveMeter | None = None) -> tuple[float, list[list[int]]]:
    """Prefill ``prompts``, then ``new_tokens`` greedy decode steps over all of them: (mean
    seconds per decode step, each row's tokens). The meter counts the decode steps only."""
    ids = list(range(len(prompts)))
    for s in ids:
        cache.add_sequence(s)
    cache.copy_blocks(cache.manager.reserve(ids, [len(p) for p in prompts]))
    last = runner.prefill(ids, prompts).argmax(-1).tolist()
    out = [[t] for t in last]
    if meter:
        meter.reset()
        meter.counting = True
    start = time.perf_counter()
    for _ in range(new_tokens):
        cache.copy_blocks(cache.manager.reserve(ids, [1] * len(ids)))
        last = runner.decode(ids, last).argmax(-1).tolist()
        for row, t in zip(out, last):
            row.append(t)
    seconds = (time.perf_counter() - start) / new_tokens
    if meter:
        meter.counting = False
    for s in ids:
        cache.free_sequence(s)
    return seconds, out


def collectives_alone(group: Group, model: Any, batch: int, steps: int) -> float:
    """Seconds per step of a decode step's collectives with no arithmetic between them: ``2L + 1``
    all-reduces of [batch, 1, hidden] and the all-gather of the logits (every rank calls it).
    ``model`` is the rank's (its config is the rank's: the hidden size and layers are the model's)."""
    config, sizes, dtype = model.config, model.lm_head.sizes, model.dtype
    x = torch.zeros(batch, 1, config.hidden_size, dtype=dtype)
    logits = torch.zeros(batch, 1, sizes[group.rank], dtype=dtype)
    group.barrier()
    start = time.perf_counter()
    for _ in range(steps):
        for _ in range(2 * config.n_layers + 1):
            group.all_reduce(x)
        group.all_gather(logits, sizes)
    return (time.perf_counter() - start) / steps


def measure_ranks(group: Group, source: str | None, dtype: str, prompts: list[list[int]], new_tokens: int,
                  rounds: int, batches: tuple[int, ...], threads: int) -> dict[str, Any]:
    """Every rank of ``bench_tp``'s run (module-level: the spawned processes import it by name)."""
    torch.set_num_threads(threads)
    model, _, shard = load_tensor_parallel(source, group, dtype=dtype)
    local = shard.local_config(model.config)
    num_blocks = max(batches) * -(-(len(prompts[0]) + new_tokens + 1) // BLOCK_SIZE) + 1
    meter = CollectiveMeter(group)
    schedule = [(batch, phase) for _ in range(rounds) for batch in batches for phase in PHASES]
    if group.rank:
        cache = PagedKVCache(local, *receive_pool_size(group), dtype=model.dtype)  # rank 0's cache says its size
        backend = DecodeCounted(EagerBackend(model), meter)
        waits: dict[str, list[float]] = {f"b{batch}": [] for batch in batches}
        for batch, phase in schedule:
            if phase == "collectives alone":
                meter.off = False
                collectives_alone(group, model, batch, new_tokens)
            elif phase.startswith("2 ranks"):
                meter.reset()
                meter.off = phase.endswith("off")
                serve_steps(group, backend, cache)
                if not meter.off:
                    waits[f"b{batch}"].append(meter.seconds["all_reduce"] / new_tokens)
        return {"rank1_all_reduce_s": waits}
    whole, _ = load_model(source, device="cpu", dtype=dtype)
    whole_cache = PagedKVCache(whole.config, num_blocks, BLOCK_SIZE, dtype=whole.dtype)
    whole_runner = ModelRunner(whole, whole_cache, backend="eager")
    tp_cache = TensorParallelKVCache(group, local, num_blocks, BLOCK_SIZE, dtype=model.dtype)
    tp_runner = ModelRunner(model, tp_cache, backend="eager")
    tp_runner.backend = TensorParallelBackend(tp_runner.backend, group)
    r: dict[str, Any] = {f"b{batch}": {phase: [] for phase in PHASES} for batch in batches}
    for batch in batches:
        r[f"b{batch}_collectives"] = {op: [] for op in OPS}
    for batch, phase in schedule:
        rows = prompts[:batch]
        tokens = None
        if phase == "1 process":
            seconds, tokens = decode_run(whole_runner, whole_cache, rows, new_tokens)
        elif phase == "collectives alone":
            meter.off = False
            seconds = collectives_alone(group, model, batch, new_tokens)
        else:
            meter.off = phase.endswith("off")
            seconds, tokens = decode_run(tp_runner, tp_cache, rows, new_tokens, meter)
            tp_runner.backend.stop()
            if not meter.off:
                for op in OPS:
                    r[f"b{batch}_collectives"][op].append(meter.seconds[op] / new_tokens)
                r[f"b{batch}_calls"] = {op: meter.calls[op] / new_tokens for op in OPS}
                r[f"b{batch}_bytes"] = {op: meter.bytes[op] / new_tokens for op in OPS}
        r[f"b{batch}"][phase].append(seconds)
        if phase in ("1 process", "2 ranks"):
            r.setdefault(f"b{batch}_tokens", {})[phase] = tokens
    return r


def greedy_on_ranks(group: Group, source: str | None, dtype: str, prompt: list[int], new_tokens: int) -> dict:
    """Greedy decoding of ``prompt`` on ``group.world_size`` ranks, the engine's way: every rank
    loads its shard; rank 0 plans and samples, and returns the tokens and the logits of every
    step; each other rank follows them (``Engine(model, tok, tensor_parallel=group)`` does rank 0's
    part for every request). Every rank reports its share of the model."""
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // group.world_size))  # its share of the cores (torchrun: 1)
    model, _, shard = load_tensor_parallel(source, group, dtype=dtype)
    local = shard.local_config(model.config)
    held = {"rank": group.rank, "q_heads": shard.q_heads, "kv_heads": shard.kv_heads, "ffn": shard.ffn,
            "vocab": shard.vocab, "parameters": sum({p.data_ptr(): p.numel() for p in model.parameters()}.values())}
    if group.rank:  # a worker: pools the size of rank 0's, then runs the steps rank 0 sends until it says stop
        return {**held, "steps": follow(group, model)}
    blocks = -(-(len(prompt) + new_tokens) // BLOCK_SIZE)
    cache = TensorParallelKVCache(group, local, blocks, BLOCK_SIZE, dtype=model.dtype)  # tells the others its size
    runner = ModelRunner(model, cache, backend="eager")
    runner.backend = TensorParallelBackend(runner.backend, group)  # sends each step to the others first
    cache.add_sequence(0)
    cache.copy_blocks(cache.manager.reserve([0], [len(prompt)]))
    logits = [runner.prefill([0], [prompt])[0]]
    for _ in range(new_tokens - 1):
        cache.copy_blocks(cache.manager.reserve([0], [1]))
        logits.append(runner.decode([0], [int(logits[-1].argmax())])[0])
    runner.backend.stop()
    return {**held, "tokens": [int(x.argmax()) for x in logits], "logits": torch.stack(logits),
            "backend": runner.backend.name}


def run(args: argparse.Namespace) -> dict[str, Any]:
    return bench_tp(dtype=args.dtype, source=args.model)


def bench_tp(dtype: str = "float32", source: Any = None, new_tokens: int = 16, rounds: int = 4,
             batches: tuple[int, ...] = (1, 8), prompt_tokens: int = 48, threads: int = 1) -> dict[str, Any]:
    """The measurements above, the bytes checked against the formula, and the cost model's predictions."""
    path = None if source is None else Path(source)
    folder = path if path is not None and path.suffix != ".gguf" else convert_gguf(path or default_gguf_path())
    config, tok = read_config(folder), Tokenizer.from_file(folder)
    ids = tok.encode(corpus_path().read_text(encoding="utf-8")[:TEXT_CHARS])
    prompts = [ids[i * prompt_tokens:(i + 1) * prompt_tokens] for i in range(max(batches))]
    start = time.perf_counter()
    outcomes = run_ranks(measure_ranks, 2, (None if source is None else str(source), dtype, prompts, new_tokens,
                                            rounds, tuple(batches), threads), timeout=120, deadline=600)
    errors = [f"rank {o.rank}: {o.error}" for o in outcomes if o.error or o.exitcode]
    if errors:
        raise RuntimeError("bench tp: " + "; ".join(errors))
    r = summarize(outcomes[0].value, outcomes[1].value, config, DTYPES[dtype])
    r.update(dtype=dtype, threads=threads, new_tokens=new_tokens, rounds=rounds, prompt_tokens=prompt_tokens,
             seconds=time.perf_counter() - start)
    return r


def summarize(rank0: dict[str, Any], rank1: dict[str, Any], config: Any, dtype: torch.dtype) -> dict[str, Any]:
    """``measure_ranks``' results with the formula's bytes, this machine's fitted link and the cost
    model's predictions beside them."""
    dtype_bytes = torch.empty(0, dtype=dtype).element_size()
    batches = sorted(int(key[1:]) for key in rank0 if key[1:].isdigit())
    r = {**rank0, "batches": batches, "model": _shape(config), "rank1_all_reduce_s": rank1["rank1_all_reduce_s"]}
    gloo = tp_cost.fit_link("gloo, this machine (fitted)", tp_cost.step_messages(config, 2),
                            [tp_cost.sent_per_rank(config, 2, b, dtype_bytes) for b in batches],
                            [min(r[f"b{b}"]["collectives alone"]) for b in batches])
    r["gloo_latency_s"] = gloo.latency
    r["gloo_bandwidth"] = None if gloo.bandwidth == float("inf") else gloo.bandwidth
    links, worlds = (gloo, *tp_cost.LINKS), [w for w in (2, 3) if w <= config.n_kv_heads]
    for batch in batches:
        tokens = r.pop(f"b{batch}_tokens")
        r[f"b{batch}_same_tokens"] = tokens["1 process"] == tokens["2 ranks"]
        expected = tp_cost.step_bytes(config, 2, batch, dtype_bytes)
        r[f"b{batch}_formula"] = {"all_reduce_calls": expected.all_reduces,
                                  "all_reduce": expected.total_all_reduce_bytes, "all_gather": expected.all_gather_bytes}
        compute = min(r[f"b{batch}"]["1 process"])
        r[f"b{batch}_predicted"] = {link.name: {w: tp_cost.predict_seconds(compute, config, w, batch, dtype_bytes, link)
                                                for w in worlds} for link in links}
        r[f"b{batch}_break_even"] = {link.name: tp_cost.break_even_seconds(config, 2, batch, dtype_bytes, link)
                                     for link in links}
    r["rank_share"] = {w: tp_cost.rank_share(config, w) for w in worlds}
    r["gpu_step_s"] = tp_cost.roofline_seconds(config, dtype_bytes)
    r["gpu_break_even"] = {link.name: tp_cost.break_even_seconds(config, 2, 1, dtype_bytes, link)
                           for link in tp_cost.LINKS}
    big = tp_cost.LLAMA3_8B
    r["llama3_8b"] = {"step_s": tp_cost.roofline_seconds(big, 2), "predicted": {
        link.name: tp_cost.predict_seconds(tp_cost.roofline_seconds(big, 2), big, 2, 1, 2, link) for link in tp_cost.LINKS}}
    return r


def _shape(config: Any) -> dict[str, int]:
    return {"n_layers": config.n_layers, "hidden_size": config.hidden_size, "vocab_size": config.vocab_size,
            "n_heads": config.n_heads, "n_kv_heads": config.n_kv_heads}


def _ms(values: list[float]) -> str:
    return f"{1000 * min(values):7.1f} ms ({1000 * min(values):.1f}-{1000 * max(values):.1f})"


def print_tp_report(r: dict[str, Any]) -> None:
    m, first = r["model"], r["batches"][0]
    print(f"tensor parallelism on the CPU: {r['dtype']}, eager, gloo over loopback, {r['threads']} thread(s) per rank "
          f"(1 process against 2 ranks); {m['n_layers']} layers, hidden {m['hidden_size']}, {m['n_heads']} query heads "
          f"in {m['n_kv_heads']} KV groups; {r['new_tokens']} decode steps after {r['prompt_tokens']} prompt tokens, "
          f"{r['rounds']} rounds taking turns (best, range over rounds); {r['seconds']:.0f} s in all")
    for batch in r["batches"]:
        b = r[f"b{batch}"]
        print(f"batch {batch}, seconds per decode step (a token for each of the {batch} rows):")
        for phase in PHASES:
            print(f"  {phase:<26}{_ms(b[phase])}")
        c = r[f"b{batch}_collectives"]
        print(f"  the collectives in the step: real - off = {1000 * (min(b['2 ranks']) - min(b['2 ranks, collectives off'])):.1f} ms; "
              f"inside rank 0's all-reduces {1000 * min(c['all_reduce']):.1f} ms, all-gather {1000 * min(c['all_gather']):.1f} ms, "
              f"step broadcast {1000 * min(c['broadcast']):.1f} ms; rank 1 (lighter) inside its all-reduces "
              f"{1000 * min(r['rank1_all_reduce_s'][f'b{batch}']):.1f} ms")
        parts = min(b["2 ranks, collectives off"]) + min(b["collectives alone"])
        print(f"  collectives off + collectives alone = {1000 * parts:.1f} ms against the real step's "
              f"{1000 * min(b['2 ranks']):.1f}: the rest is the ranks waiting for each other between collectives")
        calls, counted, formula = r[f"b{batch}_calls"], r[f"b{batch}_bytes"], r[f"b{batch}_formula"]
        ok = (calls["all_reduce"] == formula["all_reduce_calls"] and counted["all_reduce"] == formula["all_reduce"]
              and counted["all_gather"] == formula["all_gather"])
        print(f"  bytes per step: {calls['all_reduce']:.0f} all-reduces of {counted['all_reduce'] / calls['all_reduce']:,.0f} B, "
              f"all-gather {counted['all_gather']:,.0f} B, broadcast {counted['broadcast']:,.0f} B; the formula's "
              f"(2L + 1 all-reduces of batch x hidden x dtype, W x ceil(V / W) x batch x dtype): "
              f"{'the same' if ok else 'DIFFERENT'}; greedy tokens the same as 1 process: {r[f'b{batch}_same_tokens']}")
    bandwidth = r["gloo_bandwidth"]
    print(f"this machine's gloo, fitted to the collectives alone: {1e6 * r['gloo_latency_s']:.0f} us per message, "
          + (f"{bandwidth / 1e9:.2f} GB/s" if bandwidth else "no bandwidth term visible (latency-bound)"))
    gloo = next(iter(r[f"b{first}_predicted"]))
    print("the cost model with it, from the 1-process step: 2 ranks predicted "
          + ", ".join(f"batch {batch} {1000 * r[f'b{batch}_predicted'][gloo][2]:.1f} ms (measured "
                      f"{1000 * min(r[f'b{batch}']['2 ranks']):.1f})" for batch in r["batches"]))
    for batch in r["batches"]:
        print(f"batch {batch}: W=2 pays once one process's step exceeds: "
              + ", ".join(f"{name} {1000 * s:.2f} ms" for name, s in r[f"b{batch}_break_even"].items())
              + f" (it is {1000 * min(r[f'b{batch}']['1 process']):.1f} ms here)")
        print("  this CPU's step predicted over: " + "; ".join(
            f"{name} " + ", ".join(f"W={w} {1000 * t:.1f} ms" for w, t in p.items())
            for name, p in r[f"b{batch}_predicted"].items()))
    print("the busiest rank's share of the weights: "
          + ", ".join(f"{share:.3f} at W={w}" for w, share in r["rank_share"].items()))
    big, gpu = r["llama3_8b"], r["gpu_step_s"]
    pays = [name for name, s in r["gpu_break_even"].items() if gpu > s]
    print(f"on H100s (HBM {tp_cost.HBM_BANDWIDTH / 1e12:.2f} TB/s, links as stated: parameters) this model's batch-1 "
          f"step would take {1e6 * gpu:.0f} us on one: W=2 pays over {', '.join(pays) if pays else 'none of the links'}. "
          f"A Llama-3-8B shape in bfloat16, {1000 * big['step_s']:.2f} ms a step on one, at W=2: "
          + ", ".join(f"{name} {1000 * s:.2f} ms" for name, s in big["predicted"].items()))
