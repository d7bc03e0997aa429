"""``bench batching``: 8 mixed requests through the Engine's continuous batching, against the
Engine one request at a time and transformers' own batched generation."""

from __future__ import annotations

import argparse
from typing import Any

from minillm.bench.timing import interleaved_best

BATCH_PROMPTS = [
    ("The capital of France is", 24),
    ("def fibonacci(n):\n    ", 64),
    ("Once upon a time, in a small village at the edge of a great forest, there lived", 48),
    ("List three colors:", 16),
    ("The quick brown fox", 56),
    ("In 1969, astronauts", 32),
    ("import numpy as np\n", 40),
    ("Dear diary, today I", 20),
]


def run(args: argparse.Namespace) -> dict[str, Any]:
    return bench_batching()


def bench_batching(new_tokens: int = 128, repeats: int = 2) -> dict[str, Any]:
    """8 greedy requests of mixed prompt lengths, ``new_tokens`` each, in the same run through:
    the Engine batched (continuous batching, 8 rows), the Engine one request at a time,
    transformers' own continuous batching (``generate_batch``, paged attention) and
    transformers' padded ``generate()`` (left-padded, one batch). Aggregate tokens/s, best of
    ``repeats`` interleaved rounds, and whether the outputs agree."""
    import torch
    from transformers import GenerationConfig

    from minillm.engine import Engine
    from minillm.model import load_model
    from minillm.reference import hf_causal_lm
    from minillm.sampling import SamplingParams

    model, tok = load_model(device="cpu")
    reference = hf_causal_lm(None)
    engine = Engine(model, tok, max_batch_size=8)
    prompts = [tok.encode(p) for p, _ in BATCH_PROMPTS]
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    outputs: dict[str, list[list[int]]] = {}

    def batched() -> None:
        outputs["batched"] = [c.token_ids for c in engine.generate(prompts, params)]

    def one_by_one() -> None:
        outputs["one_by_one"] = [engine.generate([p], params)[0].token_ids for p in prompts]

    config = GenerationConfig(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                              eos_token_id=None, pad_token_id=tok.pad_id or 0)

    def hf_generate_batch() -> None:
        results = reference.generate_batch(prompts, generation_config=config, progress_bar=False)
        outputs["hf_generate_batch"] = [out.generated_tokens for out in results.values()]

    def hf_padded() -> None:
        batch = tok.encode_batch([tok.decode(p) for p in prompts], padding_side="left")
        out = reference.generate(batch.input_ids, attention_mask=batch.attention_mask, max_new_tokens=new_tokens,
                                 min_new_tokens=new_tokens, do_sample=False, pad_token_id=tok.pad_id or 0)
        outputs["hf_padded"] = out[:, batch.input_ids.shape[1]:].tolist()

    batched()  # compiles the engine's step (rows=1 is compiled by one_by_one's first request)
    one_by_one()
    with torch.inference_mode():
        best = interleaved_best({"batched": batched, "one_by_one": one_by_one,
                                 "hf_generate_batch": hf_generate_batch, "hf_padded": hf_padded}, repeats)
    tokens = len(prompts) * new_tokens
    r: dict[str, Any] = {"requests": len(prompts), "new_tokens": new_tokens, "tokens": tokens,
                         "prompt_tokens": [len(p) for p in prompts]}
    for name, seconds in best.items():
        r[f"{name}_tok_s"] = tokens / seconds
    for peer in ("one_by_one", "hf_generate_batch", "hf_padded"):
        r[f"speedup_vs_{peer}"] = r["batched_tok_s"] / r[f"{peer}_tok_s"]
    r["same_outputs_as_one_by_one"] = outputs["batched"] == outputs["one_by_one"]
    r["same_outputs_as_hf_generate_batch"] = sorted(outputs["batched"]) == sorted(outputs["hf_generate_batch"])
    return r


def print_batching_report(r: dict[str, Any]) -> None:
    print(f"{r['requests']} greedy requests (prompts of {min(r['prompt_tokens'])}-{max(r['prompt_tokens'])} tokens), "
          f"{r['new_tokens']} new tokens each, {r['tokens']} tokens in all (tok/s, best of interleaved rounds):")
    rows = [("Engine, continuous batching (8 rows)", "batched", ""),
            ("Engine, one request at a time", "one_by_one", "goal: >= 3x"),
            ("transformers generate_batch (continuous batching)", "hf_generate_batch", "goal: >= 4x"),
            ("transformers generate(), left-padded batch", "hf_padded", "goal: >= 2.5x")]
    for label, key, goal in rows:
        ratio = "" if key == "batched" else f"   Engine batched is {r[f'speedup_vs_{key}']:.2f}x ({goal})"
        print(f"  {label:<52}{r[f'{key}_tok_s']:>8.1f}{ratio}")
    print(f"  identical outputs: batched == one by one {r['same_outputs_as_one_by_one']}, "
          f"== transformers generate_batch {r['same_outputs_as_hf_generate_batch']}")
