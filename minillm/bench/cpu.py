"""``bench cpu``: the compiled Engine's batch-1 decode for each thread count and weight dtype,
the measurement the CPU defaults are chosen by."""

from __future__ import annotations

import argparse
import os
from typing import Any

from minillm.bench.timing import best_time
from minillm.bench.workloads import DECODE_PROMPT_TOKENS, corpus_prompt


def run(args: argparse.Namespace) -> dict[str, Any]:
    return bench_cpu_settings()


def bench_cpu_settings(new_tokens: int = 128, repeats: int = 5) -> dict[str, Any]:
    """Batch-1 decode tokens/s of the compiled Engine on the CPU for each thread count and weight
    dtype, timed as ``bench model`` times it (the same prompt and length).

    Compiled CPU code fixes its thread count when it is generated, so each setting is compiled
    afresh, then run once untimed so that the timing starts warm. bfloat16 halves the bytes per
    step but rounds the weights: its greedy tokens are compared with float32's.
    """
    import torch

    from minillm.engine import Engine
    from minillm.model import load_model
    from minillm.sampling import SamplingParams

    threads_before = torch.get_num_threads()
    rows = []
    reference_tokens: list[int] | None = None  # float32's, the first setting measured
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    try:
        for dtype in (torch.float32, torch.bfloat16):
            model, tok = load_model(device="cpu", dtype=dtype)
            prompt = corpus_prompt(tok, DECODE_PROMPT_TOKENS)
            for threads in range(1, (os.cpu_count() or 1) + 1):
                torch.set_num_threads(threads)
                torch._dynamo.reset()  # recompile for this thread count
                engine = Engine(model, tok, max_batch_size=1)
                tokens = engine.generate([prompt], params)[0].token_ids  # compiles
                engine.generate([prompt], params)  # warms up
                if reference_tokens is None:
                    reference_tokens = tokens
                seconds = best_time(lambda: engine.generate([prompt], params), repeats)
                rows.append({"dtype": str(dtype).removeprefix("torch."), "threads": threads,
                             "decode_tok_s": new_tokens / seconds, "same_tokens_as_float32": tokens == reference_tokens})
    finally:
        torch.set_num_threads(threads_before)
        torch._dynamo.reset()
    best = max(rows, key=lambda row: row["decode_tok_s"])
    return {"new_tokens": new_tokens, "rows": rows, "best": best}


def print_cpu_settings_report(r: dict[str, Any]) -> None:
    print(f"compiled Engine decode on this CPU, batch 1, {r['new_tokens']} tokens:")
    for row in r["rows"]:
        same = "" if row["dtype"] == "float32" else f"  (greedy tokens equal float32's: {row['same_tokens_as_float32']})"
        print(f"  {row['dtype']:<9} {row['threads']} thread(s): {row['decode_tok_s']:6.1f} tok/s{same}")
    b = r["best"]
    print(f"fastest: {b['dtype']}, {b['threads']} thread(s)")
