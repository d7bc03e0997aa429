"""``bench context``: the decode step as the context grows, against the roofline of the bytes a
step reads (the weights once, plus every row's K and V)."""

from __future__ import annotations

import argparse
from typing import Any

from minillm.bench.timing import BANDWIDTH_BYTES, bandwidth_reader, interleaved_best


def run(args: argparse.Namespace) -> dict[str, Any]:
    return bench_context()


def bench_context(contexts: tuple[int, ...] = (256, 512, 1024, 2048, 4096, 8000), batch_sizes: tuple[int, ...] = (1, 8),
                  steps: int = 16, repeats: int = 3) -> dict[str, Any]:
    """Decode step time at batch 1 and 8 for growing contexts, against the roofline of the bytes
    a step must read: every weight once, plus every row's K and V of every layer.

    The K/V bytes grow with the context (46 KB per token here, fp32) while the weights stay at
    538 MB, so at batch 1 the KV reads overtake the weights near 11.7k tokens, and at batch B
    near 11.7k / B: this is where attention, not the matrix products, sets the speed.
    """
    from minillm.cache import kv_bytes_per_token
    from minillm.engine import Engine
    from minillm.model import load_model

    model, tok = load_model(device="cpu")
    grown = (repeats + 1) * steps + 2  # tokens each row gains while it is timed
    contexts = tuple(c for c in contexts if c + grown <= model.config.max_position_embeddings)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    per_token = kv_bytes_per_token(model.config, model.dtype)
    read = bandwidth_reader(model.device)
    rows = []
    for batch in batch_sizes:
        engine = Engine(model, tok, max_batch_size=batch, kv_cache_tokens=batch * (max(contexts) + grown + 32))
        for context in contexts:
            seq_ids = list(range(10_000, 10_000 + batch))
            for seq_id in seq_ids:  # fill the cache with `context` tokens per row, without a prefill
                engine.manager.add_sequence(seq_id)
            engine.manager.reserve(seq_ids, [context] * batch)
            engine.manager.advance(seq_ids, [context] * batch)
            tokens = [1] * batch

            def decode_steps(n: int = steps) -> None:
                for _ in range(n):
                    engine.manager.reserve(seq_ids, [1] * batch)
                    engine.runner.decode(seq_ids, tokens)

            decode_steps(2)  # compile / warm up
            best = interleaved_best({"step": lambda: decode_steps(), "bandwidth": read}, repeats)
            for seq_id in seq_ids:
                engine.manager.free_sequence(seq_id)
            step_s = best["step"] / steps
            bandwidth = BANDWIDTH_BYTES / best["bandwidth"]
            kv_bytes = batch * (context + grown / 2) * per_token  # the average context while timed
            rows.append({"batch": batch, "context": context, "step_ms": 1000 * step_s,
                         "tok_s": batch / step_s, "weight_bytes": weight_bytes, "kv_bytes": kv_bytes,
                         "bandwidth_gb_s": bandwidth / 1e9,
                         "roofline_fraction": (weight_bytes + kv_bytes) / bandwidth / step_s})
    return {"rows": rows, "kv_bytes_per_token": per_token, "weight_bytes": weight_bytes}


def print_context_report(r: dict[str, Any]) -> None:
    print(f"decode step vs context (CPU, fp32): weights {r['weight_bytes'] / 1e6:.0f} MB + K/V "
          f"{r['kv_bytes_per_token'] / 1e3:.1f} KB per token per row read every step")
    print(f"  {'batch':>5} {'context':>8} {'step ms':>9} {'tok/s':>8} {'KV MB':>8} {'GB/s here':>10} {'roofline':>9}")
    for row in r["rows"]:
        print(f"  {row['batch']:>5} {row['context']:>8} {row['step_ms']:>9.1f} {row['tok_s']:>8.1f} "
              f"{row['kv_bytes'] / 1e6:>8.0f} {row['bandwidth_gb_s']:>10.1f} {100 * row['roofline_fraction']:>8.0f}%")
