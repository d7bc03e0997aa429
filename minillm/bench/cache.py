"""``bench cache``: what the KV cache buys (against recomputing), what paging costs (against a
contiguous cache), and how much reserved KV memory each leaves empty."""

from __future__ import annotations

import argparse
import random
import time
from typing import Any

from minillm.bench.timing import best_time


def mixed_workload(n_requests: int = 64, seed: int = 0) -> list[tuple[int, int]]:
    """(prompt length, output length) pairs: prompts 20-500 tokens, outputs 10-400 tokens."""
    rng = random.Random(seed)
    return [(rng.randint(20, 500), rng.randint(10, 400)) for _ in range(n_requests)]


def kv_waste(workload: list[tuple[int, int]], block_size: int = 16, max_new_tokens: int = 400) -> dict[str, float]:
    """Fraction of reserved KV slots that hold no token, averaged over every decode step.

    Paging is measured by driving the real ``PagedKVCache`` bookkeeping through the workload
    (all requests running at once, each freed when done); contiguous preallocation reserves
    ``prompt + max_new_tokens`` slots per request, since the output length is unknown upfront.
    """
    from minillm.cache import PagedKVCache
    from minillm.model.config import ModelConfig

    tiny = ModelConfig(vocab_size=1, hidden_size=2, n_layers=1, n_heads=1, n_kv_heads=1,
                       intermediate_size=1, max_position_embeddings=8192)
    n_blocks = sum(-(-(p + o) // block_size) for p, o in workload)
    cache = PagedKVCache(tiny, n_blocks, block_size)
    remaining = {}
    for seq_id, (prompt, output) in enumerate(workload):
        cache.add_sequence(seq_id)
        cache.prepare([seq_id], prompt)
        remaining[seq_id] = output
    paged_reserved = paged_used = contiguous_reserved = 0
    while remaining:
        active = list(remaining)
        cache.prepare(active, 1)
        paged_reserved += cache.slots_in_use()
        paged_used += cache.tokens_stored()
        contiguous_reserved += sum(workload[s][0] + max_new_tokens for s in active)
        for seq_id in active:
            remaining[seq_id] -= 1
            if remaining[seq_id] == 0:
                del remaining[seq_id]
                cache.free_sequence(seq_id)
    return {
        "paged_waste": 1 - paged_used / paged_reserved,
        "contiguous_waste": 1 - paged_used / contiguous_reserved,
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    return bench_cache()


def bench_cache(new_tokens: int = 256, decode_tokens: int = 128) -> dict[str, Any]:
    """KV cache vs full recompute, paged vs contiguous decode, and KV memory waste.

    All eager and batch 1, the teaching loops of notebooks 07 and 08: what the cache itself
    buys, before compiling (that is ``bench model``)."""
    import torch

    from minillm.cache import ContiguousKVCache, PagedKVCache
    from minillm.generate import greedy_contiguous, greedy_recompute
    from minillm.model import load_model

    model, tok = load_model(device="cpu")
    # a typical request to an instruct model: the chat template (with its system prompt) and a question
    prompt = tok.apply_chat_template([{"role": "user", "content": "Tell me a long story about a dragon."}])
    assert isinstance(prompt, list)
    results: dict[str, Any] = {"new_tokens": new_tokens, "prompt_tokens": len(prompt)}
    with torch.inference_mode():
        results["recompute_s"] = best_time(lambda: greedy_recompute(model, prompt, new_tokens), repeats=1)
        results["cached_s"] = best_time(lambda: greedy_contiguous(model, [prompt], new_tokens), repeats=2)
        results["cache_speedup"] = results["recompute_s"] / results["cached_s"]

        def decode_time(paged: bool) -> float:
            """Seconds for ``decode_tokens`` one-token steps after a prefill (batch 1)."""
            if paged:
                cache = PagedKVCache(model.config, -(-(len(prompt) + decode_tokens) // 16), 16)
                cache.add_sequence(0)
                step = lambda n: {"paged": cache.prepare([0], n)}  # noqa: E731
            else:
                contiguous = ContiguousKVCache(model.config, 1, len(prompt) + decode_tokens)
                step = lambda n: {"cache": contiguous}  # noqa: E731
            logits = model(torch.tensor([prompt]), last_only=True, **step(len(prompt)))
            token = logits[:, -1].argmax(-1, keepdim=True)
            start = time.perf_counter()  # the prefill above is not timed
            for _ in range(decode_tokens - 1):
                token = model(token, last_only=True, **step(1))[:, -1].argmax(-1, keepdim=True)
            return time.perf_counter() - start

        results["contiguous_decode_s"] = min(decode_time(False) for _ in range(3))
        results["paged_decode_s"] = min(decode_time(True) for _ in range(3))
    results["paged_over_contiguous"] = results["paged_decode_s"] / results["contiguous_decode_s"]
    results.update(kv_waste(mixed_workload()))
    return results


def print_cache_report(r: dict[str, Any]) -> None:
    print(f"greedy, {r['new_tokens']} new tokens after a {r['prompt_tokens']}-token chat prompt (CPU, fp32, batch 1):")
    print(f"  full recompute {r['recompute_s']:.1f} s, contiguous KV cache {r['cached_s']:.1f} s: "
          f"cache is {r['cache_speedup']:.1f}x faster (goal: >= 5x)")
    print(f"  decode only: contiguous {r['contiguous_decode_s']:.2f} s, paged {r['paged_decode_s']:.2f} s: "
          f"paged takes {r['paged_over_contiguous']:.2f}x contiguous's time (goal: <= 1.3x)")
    print(f"KV memory waste on a mixed workload (64 requests, prompts 20-500, outputs 10-400, block 16):")
    print(f"  paged {100 * r['paged_waste']:.1f}% (goal: < 4%), contiguous preallocation {100 * r['contiguous_waste']:.1f}%")
