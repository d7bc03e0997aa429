"""Benchmarks: minillm against the reference library, measured in the same run.

Speed goals are ratios, never absolute timings: both sides run on the same machine, on the
same input, one after the other, and each is timed as the best of a few repeats.

    python -m minillm bench tokenizer [--json]
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from minillm.assets import corpus_path, default_gguf_path, gpt2_vocab_dir
from minillm.tokenizer import Tokenizer, train_bpe

if TYPE_CHECKING:
    import torch

    from minillm.engine.fast import FastDecoder


def best_time(fn: Callable[[], Any], repeats: int = 3) -> float:
    """The fastest of ``repeats`` wall-clock timings of ``fn()``, in seconds."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def bench_tokenizer(vocab_size: int = 4096, corpus: Path | None = None) -> dict[str, Any]:
    """Training (minillm vs HF ``BpeTrainer``) and encoding (minillm vs HF ``tokenizers``)."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models, pre_tokenizers, trainers

    from minillm.reference import hf_gguf_tokenizer, hf_gpt2_tokenizer

    corpus = corpus or corpus_path()
    text = corpus.read_text(encoding="utf-8")
    special = ["<|endoftext|>"]

    def train_hf() -> None:
        tok = HFTokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=special,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        tok.train([str(corpus)], trainer)

    results: dict[str, Any] = {
        "corpus": str(corpus),
        "corpus_bytes": len(text.encode("utf-8")),
        "train_vocab_size": vocab_size,
    }
    results["train_s_minillm"] = best_time(lambda: train_bpe(text, vocab_size, special, progress=False))
    results["train_s_hf"] = best_time(train_hf)
    results["train_ratio"] = results["train_s_minillm"] / results["train_s_hf"]

    for name, ours, theirs in (
        ("smollm2", Tokenizer.from_file(default_gguf_path()), hf_gguf_tokenizer().backend_tokenizer),
        ("gpt2", Tokenizer.from_file(gpt2_vocab_dir()), hf_gpt2_tokenizer()),
    ):

        def encode_cold(tok: Tokenizer = ours) -> None:
            tok._cache.clear()  # measure from an empty chunk cache: no head start
            tok.encode(text)

        results[f"encode_s_minillm_{name}"] = best_time(encode_cold)
        results[f"encode_s_hf_{name}"] = best_time(lambda h=theirs: h.encode(text, add_special_tokens=False))
        results[f"encode_speedup_{name}"] = results[f"encode_s_hf_{name}"] / results[f"encode_s_minillm_{name}"]
        results[f"encode_ids_equal_{name}"] = ours.encode(text) == theirs.encode(text, add_special_tokens=False).ids
    return results


def print_tokenizer_report(r: dict[str, Any]) -> None:
    mb = r["corpus_bytes"] / 1e6
    print(f"corpus: {r['corpus']} ({mb:.2f} MB)")
    print(f"{'task':<34}{'minillm':>10}{'HF':>10}   ratio")
    print(
        f"{'train BPE, vocab ' + str(r['train_vocab_size']):<34}{r['train_s_minillm']:>9.2f}s{r['train_s_hf']:>9.2f}s"
        f"   minillm takes {r['train_ratio']:.2f}x HF's time (goal: <= 3x)"
    )
    for name in ("smollm2", "gpt2"):
        print(
            f"{'encode corpus, ' + name:<34}{r[f'encode_s_minillm_{name}']:>9.2f}s{r[f'encode_s_hf_{name}']:>9.2f}s"
            f"   minillm is {r[f'encode_speedup_{name}']:.2f}x HF's speed (goal: >= 1x);"
            f" ids equal: {r[f'encode_ids_equal_{name}']}"
        )


def bench_load() -> dict[str, Any]:
    """Seconds for ``load_model()`` once the default model is converted (best of 3, fresh process state)."""
    from minillm.model import load_model

    load_model()  # make sure the conversion is done
    return {"load_s": best_time(lambda: load_model(device="cpu"))}


def mixed_workload(n_requests: int = 64, seed: int = 0) -> list[tuple[int, int]]:
    """(prompt length, output length) pairs: prompts 20-500 tokens, outputs 10-400 tokens."""
    import random

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
        cache.prepare([seq_id], prompt).advance(prompt)
        remaining[seq_id] = output
    paged_reserved = paged_used = contiguous_reserved = 0
    while remaining:
        active = list(remaining)
        cache.prepare(active, 1).advance(1)
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


def bench_cache(new_tokens: int = 256, decode_tokens: int = 128) -> dict[str, Any]:
    """KV cache vs full recompute, paged vs contiguous decode, and KV memory waste."""
    import torch

    from minillm.cache import ContiguousKVCache, PagedKVCache
    from minillm.engine.fast import FastDecoder
    from minillm.generate import greedy_recompute
    from minillm.model import load_model

    model, tok = load_model(device="cpu")
    # a typical request to an instruct model: the chat template (with its system prompt) and a question
    prompt = tok.apply_chat_template([{"role": "user", "content": "Tell me a long story about a dragon."}])
    assert isinstance(prompt, list)
    results: dict[str, Any] = {"new_tokens": new_tokens, "prompt_tokens": len(prompt)}
    with torch.inference_mode():
        results["recompute_s"] = best_time(lambda: greedy_recompute(model, prompt, new_tokens), repeats=1)
        cached = FastDecoder(model, max_len=len(prompt) + new_tokens, compile=False)  # eager, like recompute
        results["cached_s"] = best_time(lambda: cached.greedy(prompt, new_tokens), repeats=2)
        results["cache_speedup"] = results["recompute_s"] / results["cached_s"]

        def decode_time(paged: bool) -> float:
            """Seconds for ``decode_tokens`` one-token steps after a prefill (batch 1)."""
            if paged:
                cache = PagedKVCache(model.config, -(-(len(prompt) + decode_tokens) // 16), 16)
                cache.add_sequence(0)
                step = lambda n: cache.prepare([0], n)  # noqa: E731
            else:
                contiguous = ContiguousKVCache(model.config, 1, len(prompt) + decode_tokens)
                step = lambda n: contiguous  # noqa: E731
            logits = model(torch.tensor([prompt]), cache=step(len(prompt)), last_only=True)
            token = logits[:, -1].argmax(-1, keepdim=True)
            start = time.perf_counter()
            for _ in range(decode_tokens - 1):
                token = model(token, cache=step(1), last_only=True)[:, -1].argmax(-1, keepdim=True)
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


BANDWIDTH_BYTES = 512 * 2**20
DECODE_PROMPT_TOKENS = 16  # the decode benchmarks start from this many tokens of the corpus


def corpus_prompt(tok: Tokenizer, n_tokens: int) -> list[int]:
    """The first ``n_tokens`` ids of the training corpus: a real, reproducible prompt."""
    return tok.encode(corpus_path().read_text(encoding="utf-8"))[:n_tokens]


def bandwidth_reader(device: torch.device, nbytes: int = BANDWIDTH_BYTES) -> Callable[[], None]:
    """A function that reads ``nbytes`` once, by summing a buffer that size (a STREAM-like read).

    Its best time gives the bandwidth the roofline divides by: a measured proxy, not the
    datasheet, so a decode step streaming its weights at the machine's best can read slightly
    faster than this one ``sum`` (a roofline fraction just above 100%).
    """
    import torch

    buffer = torch.ones(nbytes // 4, dtype=torch.float32, device=device)

    def read() -> None:
        buffer.sum()
        if device.type == "cuda":
            torch.cuda.synchronize()

    return read


def interleaved_best(fns: dict[str, Callable[[], Any]], repeats: int) -> dict[str, float]:
    """The fastest time of each function over ``repeats`` rounds, the functions taking turns.

    Taking turns (A, B, A, B, ...) rather than all of A then all of B means a slow spell of a
    shared machine hits both sides alike, so their ratio stays fair.
    """
    best = {name: float("inf") for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            best[name] = min(best[name], best_time(fn, repeats=1))
    return best


def bench_model(device: str | None = None, dtype: str = "float32", new_tokens: int = 128,
                prompt_tokens: int = 256, repeats: int = 5, source: Path | None = None,
                decoder: FastDecoder | None = None) -> dict[str, Any]:
    """Prefill and decode tokens/s of minillm and transformers on the same weights, device and
    dtype, measured in one run; plus the device's bandwidth and the roofline fraction reached.

    ``source`` is a GGUF file or an HF checkpoint folder that both libraries read (default:
    SmolLM2-135M-Instruct's GGUF). minillm decodes with the compiled ``FastDecoder`` (its
    compile time is reported apart, not hidden); the eager decode loop is timed too, to show
    what compiling buys. Pass ``decoder`` (wrapping the model ``source`` names) to benchmark
    one that is already built, and compiled.
    """
    import torch

    from minillm.engine.fast import FastDecoder
    from minillm.model import load_model
    from minillm.reference import hf_causal_lm
    from minillm.tokenizer import Tokenizer

    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    if decoder is None:
        model, tok = load_model(source, device=device, dtype=torch_dtype)
    else:
        model = decoder.model
        tok = Tokenizer.from_file(source or default_gguf_path())  # a GGUF or a checkpoint folder
        if model.dtype != torch_dtype:
            raise ValueError(f"the decoder's model is {model.dtype}, the benchmark was asked for {dtype}")
    dev = model.device
    reference = hf_causal_lm(source).to(device=dev, dtype=torch_dtype)

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize()

    prompt = corpus_prompt(tok, prompt_tokens)
    short = prompt[:DECODE_PROMPT_TOKENS]
    x = torch.tensor([prompt], device=dev)
    fast = decoder or FastDecoder(model, max_len=len(short) + new_tokens)
    eager = FastDecoder(model, max_len=len(short) + new_tokens, compile=False)
    results: dict[str, Any] = {
        "model": str(source or default_gguf_path().name), "device": str(dev), "dtype": dtype,
        "threads": torch.get_num_threads(),
        "prompt_tokens": len(prompt), "new_tokens": new_tokens, "compiled": fast.compiled,
    }
    start = time.perf_counter()
    fast_tokens = fast.greedy(short, new_tokens)  # the first call compiles the decode step
    sync()
    results["compile_s"] = time.perf_counter() - start  # ~0 for a decoder that was already compiled
    results["same_tokens_as_eager"] = fast_tokens == eager.greedy(short, new_tokens)

    def hf_generate() -> None:
        ids = torch.tensor([short], device=dev)
        reference.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                           min_new_tokens=new_tokens, do_sample=False, pad_token_id=tok.pad_id)
        sync()

    def timed(fn: Callable[[], Any]) -> Callable[[], None]:
        def run() -> None:
            fn()
            sync()
        return run

    with torch.inference_mode():
        prefill = interleaved_best({
            "minillm": timed(lambda: model(x, last_only=True)),
            "hf": timed(lambda: reference(x, logits_to_keep=1)),
        }, repeats=3)
        decode = interleaved_best({
            "minillm": timed(lambda: fast.greedy(short, new_tokens)),
            "minillm_eager": timed(lambda: eager.greedy(short, new_tokens)),
            "hf": hf_generate,
            # the bandwidth too, in the same rounds: a busy spell on a shared machine lowers all alike
            "bandwidth": bandwidth_reader(dev),
        }, repeats)
    for side in ("minillm", "hf"):
        results[f"prefill_tok_s_{side}"] = len(prompt) / prefill[side]
    for side in ("minillm", "minillm_eager", "hf"):
        results[f"decode_tok_s_{side}"] = new_tokens / decode[side]
    results["prefill_ratio"] = results["prefill_tok_s_minillm"] / results["prefill_tok_s_hf"]
    results["decode_ratio"] = results["decode_tok_s_minillm"] / results["decode_tok_s_hf"]
    results["decode_ratio_eager"] = results["decode_tok_s_minillm_eager"] / results["decode_tok_s_hf"]
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    bandwidth = BANDWIDTH_BYTES / decode["bandwidth"]
    results["weight_bytes"] = weight_bytes
    results["bandwidth_gb_s"] = bandwidth / 1e9
    results["roofline_tok_s"] = bandwidth / weight_bytes  # every decode step reads every weight once
    results["roofline_fraction"] = results["decode_tok_s_minillm"] / results["roofline_tok_s"]
    results["roofline_fraction_hf"] = results["decode_tok_s_hf"] / results["roofline_tok_s"]
    return results


def print_model_report(r: dict[str, Any]) -> None:
    print(f"{r['model']} on {r['device']} ({r['dtype']}, {r['threads']} threads)")
    print(f"{'':<48}{'minillm':>12}{'transformers':>14}   ratio")
    print(f"{'prefill, ' + str(r['prompt_tokens']) + ' tokens (tok/s)':<48}"
          f"{r['prefill_tok_s_minillm']:>12.1f}{r['prefill_tok_s_hf']:>14.1f}   {r['prefill_ratio']:.2f}x")
    fast = "compiled" if r["compiled"] else "not compiled"
    print(f"{'decode, batch 1, ' + str(r['new_tokens']) + ' tokens (tok/s), ' + fast:<48}"
          f"{r['decode_tok_s_minillm']:>12.1f}{r['decode_tok_s_hf']:>14.1f}   {r['decode_ratio']:.2f}x (goal: >= 1.5x)")
    print(f"{'  the same loop, eager':<48}{r['decode_tok_s_minillm_eager']:>12.1f}{'':>14}   {r['decode_ratio_eager']:.2f}x")
    print(f"first call (compiles the decode step): {r['compile_s']:.1f} s; "
          f"compiled tokens equal eager tokens: {r['same_tokens_as_eager']}")
    print(f"memory bandwidth {r['bandwidth_gb_s']:.1f} GB/s; weights {r['weight_bytes'] / 1e6:.0f} MB per decode step "
          f"-> roofline {r['roofline_tok_s']:.1f} tok/s; minillm reaches {100 * r['roofline_fraction']:.0f}% of it "
          f"(goal: >= 60%), transformers {100 * r['roofline_fraction_hf']:.0f}%")


def bench_cpu_settings(new_tokens: int = 128, repeats: int = 5) -> dict[str, Any]:
    """Decode tokens/s of the compiled ``FastDecoder`` on the CPU for each thread count and
    weight dtype: the measurement the CPU defaults are chosen by.

    The decode is timed as ``bench model`` times it (the same prompt and length), so the two
    reports agree. Compiled CPU code fixes its thread count when it is generated, so each
    setting is compiled afresh, then run once untimed so that the timing starts warm. On the
    shared course machine one setting's decode still flips between ~51 and ~72 tok/s from run
    to run (measured in runs of ten), so the sweep ranks coarse differences only. bfloat16 halves the bytes per step but rounds the weights: its greedy tokens are compared
    with float32's.
    """
    import os

    import torch

    from minillm.engine.fast import FastDecoder
    from minillm.model import load_model

    threads_before = torch.get_num_threads()
    rows = []
    reference_tokens: list[int] | None = None  # float32's, the first setting measured
    try:
        for dtype in (torch.float32, torch.bfloat16):
            model, tok = load_model(device="cpu", dtype=dtype)
            prompt = corpus_prompt(tok, DECODE_PROMPT_TOKENS)
            for threads in range(1, (os.cpu_count() or 1) + 1):
                torch.set_num_threads(threads)
                torch._dynamo.reset()  # recompile for this thread count
                decoder = FastDecoder(model, max_len=len(prompt) + new_tokens)
                tokens = decoder.greedy(prompt, new_tokens)  # compiles
                decoder.greedy(prompt, new_tokens)  # warms up
                if reference_tokens is None:
                    reference_tokens = tokens
                seconds = best_time(lambda: decoder.greedy(prompt, new_tokens), repeats)
                rows.append({"dtype": str(dtype).removeprefix("torch."), "threads": threads,
                             "decode_tok_s": new_tokens / seconds, "same_tokens_as_float32": tokens == reference_tokens})
    finally:
        torch.set_num_threads(threads_before)
        torch._dynamo.reset()
    best = max(rows, key=lambda row: row["decode_tok_s"])
    return {"new_tokens": new_tokens, "rows": rows, "best": best}


def print_cpu_settings_report(r: dict[str, Any]) -> None:
    print(f"compiled decode on this CPU, batch 1, {r['new_tokens']} tokens:")
    for row in r["rows"]:
        same = "" if row["dtype"] == "float32" else f"  (greedy tokens equal float32's: {row['same_tokens_as_float32']})"
        print(f"  {row['dtype']:<9} {row['threads']} thread(s): {row['decode_tok_s']:6.1f} tok/s{same}")
    b = r["best"]
    print(f"fastest: {b['dtype']}, {b['threads']} thread(s)")


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


def bench_batching(max_batch_size: int = 8) -> dict[str, Any]:
    """Continuous batching: 8 greedy requests of mixed prompt and output lengths, run one by one
    and then together on one engine; same outputs, aggregate tokens/s compared."""
    from minillm.engine import Engine
    from minillm.model import load_model
    from minillm.sampling import SamplingParams

    model, tok = load_model()
    engine = Engine(model, tok, max_batch_size=max_batch_size)
    prompts = [p for p, _ in BATCH_PROMPTS]
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for _, n in BATCH_PROMPTS]
    start = time.perf_counter()
    alone = [engine.generate([p], ps)[0] for p, ps in zip(prompts, params)]
    one_by_one_s = time.perf_counter() - start
    start = time.perf_counter()
    together = engine.generate(prompts, params)
    batched_s = time.perf_counter() - start
    tokens = sum(len(c.token_ids) for c in together)
    return {
        "requests": len(prompts),
        "tokens": tokens,
        "one_by_one_tok_s": tokens / one_by_one_s,
        "batched_tok_s": tokens / batched_s,
        "speedup": one_by_one_s / batched_s,
        "same_outputs": [c.token_ids for c in alone] == [c.token_ids for c in together],
    }


def print_batching_report(r: dict[str, Any]) -> None:
    print(f"{r['requests']} requests, {r['tokens']} generated tokens (greedy, mixed lengths):")
    print(f"  one by one {r['one_by_one_tok_s']:.1f} tok/s, continuous batching {r['batched_tok_s']:.1f} tok/s: "
          f"{r['speedup']:.2f}x (goal: >= 3x); identical outputs: {r['same_outputs']}")
