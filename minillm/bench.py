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


def _hf_static_compiled(reference: Any, prompt: list[int], new_tokens: int) -> Callable[[], Any]:
    """transformers' fair compiled baseline: ``generate()`` on its static cache with the forward
    compiled by ``torch.compile`` (the recipe of its "static cache and torch.compile" guide)."""
    import copy

    import torch

    compiled = copy.copy(reference)  # the same weights; a forward of its own to compile
    compiled.forward = torch.compile(reference.forward, fullgraph=True)
    ids = torch.tensor([prompt], device=reference.device)

    def run() -> Any:
        return compiled.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                 min_new_tokens=new_tokens, do_sample=False, cache_implementation="static",
                                 pad_token_id=0)

    return run


def bench_model(device: str | None = None, dtype: str = "float32", new_tokens: int = 128,
                prompt_tokens: int = 256, repeats: int = 5, source: Path | None = None,
                hf_compiled: bool = True, loaded: tuple[Any, Tokenizer] | None = None) -> dict[str, Any]:
    """Prefill and batch-1 decode tokens/s of the Engine and of transformers on the same weights,
    device and dtype, measured in one run; plus the device's bandwidth and the roofline fraction.

    ``source`` is a GGUF file or an HF checkpoint folder that both libraries read (default:
    SmolLM2-135M-Instruct's GGUF). The peers: transformers ``generate()`` eager, and (unless
    ``hf_compiled`` is False) ``generate()`` on its static cache with a compiled forward. The
    Engine's compile times are reported apart, not hidden; an eager Engine is timed too, to
    show what compiling buys. Pass ``loaded`` (the model and tokenizer ``source`` names, already
    loaded) to reuse them, and the decode step already compiled for them.
    """
    import torch

    from minillm.engine import Engine
    from minillm.model import load_model
    from minillm.reference import hf_causal_lm
    from minillm.sampling import SamplingParams

    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    model, tok = loaded or load_model(source, device=device, dtype=torch_dtype)
    if model.dtype != torch_dtype:
        raise ValueError(f"the loaded model is {model.dtype}, the benchmark was asked for {dtype}")
    dev = model.device
    reference = hf_causal_lm(source).to(device=dev, dtype=torch_dtype)

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize()

    prompt = corpus_prompt(tok, prompt_tokens)
    short = prompt[:DECODE_PROMPT_TOKENS]
    x = torch.tensor([prompt], device=dev)
    engine = Engine(model, tok, max_batch_size=8)
    eager = Engine(model, tok, max_batch_size=8, backend="eager")
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    results: dict[str, Any] = {
        "model": str(source or default_gguf_path().name), "device": str(dev), "dtype": dtype,
        "threads": torch.get_num_threads(),
        "prompt_tokens": len(prompt), "new_tokens": new_tokens, "compiled": engine.runner.compiled,
    }
    start = time.perf_counter()
    engine_tokens = engine.generate([short], params)[0].token_ids  # the first call compiles the decode step
    sync()
    results["compile_s"] = time.perf_counter() - start
    results["same_tokens_as_eager"] = engine_tokens == eager.generate([short], params)[0].token_ids

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

    decoders = {
        "minillm": timed(lambda: engine.generate([short], params)),
        "minillm_eager": timed(lambda: eager.generate([short], params)),
        "hf": hf_generate,
    }
    if hf_compiled:
        hf_static = _hf_static_compiled(reference, short, new_tokens)
        start = time.perf_counter()
        hf_static_tokens = hf_static()[0, len(short):].tolist()  # compiles
        results["hf_compile_s"] = time.perf_counter() - start
        results["same_tokens_as_hf_static"] = hf_static_tokens == engine_tokens
        decoders["hf_static_compiled"] = timed(hf_static)
    # the bandwidth too, in the same rounds: a busy spell on a shared machine lowers all alike
    decoders["bandwidth"] = bandwidth_reader(dev)
    with torch.inference_mode():
        prefill = interleaved_best({
            "minillm": timed(lambda: model(x, last_only=True)),
            "hf": timed(lambda: reference(x, logits_to_keep=1)),
        }, repeats=3)
        decode = interleaved_best(decoders, repeats)
    for side in ("minillm", "hf"):
        results[f"prefill_tok_s_{side}"] = len(prompt) / prefill[side]
    for side in decoders:
        if side != "bandwidth":
            results[f"decode_tok_s_{side}"] = new_tokens / decode[side]
    results["prefill_ratio"] = results["prefill_tok_s_minillm"] / results["prefill_tok_s_hf"]
    results["decode_ratio"] = results["decode_tok_s_minillm"] / results["decode_tok_s_hf"]
    results["decode_ratio_eager"] = results["decode_tok_s_minillm_eager"] / results["decode_tok_s_hf"]
    if hf_compiled:
        results["decode_ratio_hf_static"] = results["decode_tok_s_minillm"] / results["decode_tok_s_hf_static_compiled"]
    results["compile_s_per_variant"] = engine.runner.compile_seconds
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
    print(f"{'':<52}{'minillm':>10}{'transformers':>14}   ratio")
    print(f"{'prefill, ' + str(r['prompt_tokens']) + ' tokens (tok/s)':<52}"
          f"{r['prefill_tok_s_minillm']:>10.1f}{r['prefill_tok_s_hf']:>14.1f}   {r['prefill_ratio']:.2f}x")
    fast = "compiled" if r["compiled"] else "not compiled"
    print(f"{'decode, batch 1, ' + str(r['new_tokens']) + ' tokens (tok/s): Engine, ' + fast:<52}"
          f"{r['decode_tok_s_minillm']:>10.1f}{r['decode_tok_s_hf']:>14.1f}   {r['decode_ratio']:.2f}x "
          "vs generate() eager (goal: >= 2x)")
    if "decode_tok_s_hf_static_compiled" in r:
        print(f"{'  vs transformers static cache + torch.compile':<52}{'':>10}"
              f"{r['decode_tok_s_hf_static_compiled']:>14.1f}   {r['decode_ratio_hf_static']:.2f}x (goal: >= 1x); "
              f"its compile {r['hf_compile_s']:.1f} s, same tokens: {r['same_tokens_as_hf_static']}")
    print(f"{'  the Engine eager (not compiled)':<52}{r['decode_tok_s_minillm_eager']:>10.1f}{'':>14}   "
          f"{r['decode_ratio_eager']:.2f}x")
    variants = ", ".join(f"{k} {v:.1f} s" for k, v in r["compile_s_per_variant"].items())
    print(f"first call {r['compile_s']:.1f} s (compiling: {variants}); compiled tokens equal eager tokens: "
          f"{r['same_tokens_as_eager']}")
    print(f"memory bandwidth {r['bandwidth_gb_s']:.1f} GB/s; weights {r['weight_bytes'] / 1e6:.0f} MB per decode step "
          f"-> roofline {r['roofline_tok_s']:.1f} tok/s; minillm reaches {100 * r['roofline_fraction']:.0f}% of it "
          f"(goal: >= 70%), transformers {100 * r['roofline_fraction_hf']:.0f}%")


def bench_cpu_settings(new_tokens: int = 128, repeats: int = 5) -> dict[str, Any]:
    """Batch-1 decode tokens/s of the compiled Engine on the CPU for each thread count and weight
    dtype: the measurement the CPU defaults are chosen by.

    The decode is timed as ``bench model`` times it (the same prompt and length), so the two
    reports agree. Compiled CPU code fixes its thread count when it is generated, so each
    setting is compiled afresh, then run once untimed so that the timing starts warm. On the
    shared course machine one setting's decode moves by up to 1.5x from run to run, so the
    sweep ranks coarse differences only. bfloat16 halves the bytes per step but rounds the
    weights: its greedy tokens are compared with float32's.
    """
    import os

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


def bench_batching(new_tokens: int = 128, repeats: int = 2) -> dict[str, Any]:
    """8 greedy requests of mixed prompt lengths, ``new_tokens`` each, in the same run through:
    the Engine batched (continuous batching, 8 rows), the Engine one request at a time,
    transformers' own continuous batching (``generate_batch``, paged attention) and
    transformers' padded ``generate()`` (left-padded, one batch). Aggregate tokens/s, best of
    ``repeats`` interleaved rounds, and whether the outputs agree."""
    import torch

    from minillm.engine import Engine
    from minillm.model import load_model
    from minillm.reference import hf_causal_lm
    from minillm.sampling import SamplingParams
    from transformers import GenerationConfig

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


def bench_context(contexts: tuple[int, ...] = (256, 512, 1024, 2048, 4096, 8000), batch_sizes: tuple[int, ...] = (1, 8),
                  steps: int = 16, repeats: int = 3) -> dict[str, Any]:
    """Decode step time at batch 1 and 8 for growing contexts, against the roofline of the bytes
    a step must read: every weight once, plus every row's K and V of every layer.

    The K/V bytes grow with the context (46 KB per token here, fp32) while the weights stay at
    538 MB, so at batch 1 the KV reads overtake the weights near 11.7k tokens, and at batch B
    near 11.7k / B: this is where attention, not the matrix products, sets the speed.
    """
    import torch

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


def poisson_arrivals(n_requests: int, rate_per_s: float, seed: int = 0) -> list[float]:
    """Arrival times (seconds from the start) of a seeded Poisson stream: independent requests,
    ``rate_per_s`` of them per second on average, exponential gaps between them."""
    import random

    rng = random.Random(seed)
    times, now = [], 0.0
    for _ in range(n_requests):
        now += rng.expovariate(rate_per_s)
        times.append(now)
    return times


def percentile(values: list[float], q: float) -> float:
    """The ``q``-th percentile (0-100), interpolated between the nearest ranks."""
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


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


QUANT_FORMATS = ("float32", "native", "q8_0", "q4_0")
HELD_OUT_CHARS = 20_000  # the corpus's last characters: never among the training chunks of notebook 01


def held_out_tokens(tok: Tokenizer, n_tokens: int) -> list[int]:
    """``n_tokens`` ids from the end of the corpus (held out: notebook 01 trains on its start)."""
    text = corpus_path().read_text(encoding="utf-8")[-HELD_OUT_CHARS:]
    ids = tok.encode(text)
    if len(ids) < n_tokens:
        raise ValueError(f"the held-out text has {len(ids)} tokens, fewer than the {n_tokens} asked for")
    return ids[-n_tokens:]


def format_quality(logits: torch.Tensor, reference: torch.Tensor, targets: torch.Tensor) -> dict[str, float]:
    """How far one format's next-token distributions are from the reference's (float32), over the
    same positions: mean KL(reference || format) in nats, top-1 agreement, and the perplexity
    of the actual next tokens."""
    import torch.nn.functional as F

    logp = F.log_softmax(logits.double(), dim=-1)
    logp_ref = F.log_softmax(reference.double(), dim=-1)
    kl = (logp_ref.exp() * (logp_ref - logp)).sum(-1)
    nll = -logp.gather(-1, targets[:, None])[:, 0]
    return {"kl_mean": kl.mean().item(), "kl_p99": kl.quantile(0.99).item(),
            "top1_agreement": (logits.argmax(-1) == reference.argmax(-1)).double().mean().item(),
            "perplexity": nll.mean().exp().item()}


def _llama_cpp(path: Path, threads: int, logits_all: bool) -> Any:
    """llama.cpp on the same GGUF, through llama-cpp-python (``make bench-peers``); None if absent."""
    try:
        from llama_cpp import Llama
    except ImportError:
        return None
    return Llama(model_path=str(path), n_threads=threads, n_threads_batch=threads, n_ctx=1024, n_batch=512,
                 logits_all=logits_all, verbose=False)


def bench_quant(new_tokens: int = 128, prompt_tokens: int = 256, quality_windows: int = 4, window: int = 256,
                repeats: int = 3, formats: tuple[str, ...] = QUANT_FORMATS) -> dict[str, Any]:
    """Each weight format of the default model, CPU, batch 1, in one run: bytes in memory and read
    per decode token, decode and prefill tok/s (interleaved rounds, best of each), the fraction of
    the bandwidth roofline, and quality on held-out text against float32 (KL, top-1, perplexity);
    with llama.cpp on the same GGUF and the same thread count when llama-cpp-python is installed.
    """
    import numpy as np
    import torch

    from minillm.engine import Engine
    from minillm.gguf_io import open_gguf
    from minillm.model import load_model
    from minillm.model.quant import weight_bytes
    from minillm.sampling import SamplingParams

    path = default_gguf_path()
    threads = torch.get_num_threads()
    models = {fmt: load_model(device="cpu", weights=fmt) for fmt in formats}
    tok = models[formats[0]][1]
    engines = {fmt: Engine(model, tok, max_batch_size=1) for fmt, (model, tok) in models.items()}
    prompt = corpus_prompt(tok, prompt_tokens)
    short = prompt[:DECODE_PROMPT_TOKENS]
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    r: dict[str, Any] = {"threads": threads, "new_tokens": new_tokens, "prompt_tokens": prompt_tokens,
                         "gguf_tensor_bytes": sum(t.n_bytes for t in open_gguf(path).tensors), "formats": {}}
    tokens: dict[str, list[int]] = {}
    for fmt, engine in engines.items():
        start = time.perf_counter()
        tokens[fmt] = engine.generate([short], params)[0].token_ids  # compiles this format's step
        r["formats"][fmt] = {"bytes": weight_bytes(engine.model), "first_call_s": time.perf_counter() - start}

    decoders: dict[str, Callable[[], Any]] = {fmt: (lambda e=engine: e.generate([short], params))
                                              for fmt, engine in engines.items()}
    prefills: dict[str, Callable[[], Any]] = {}
    x = torch.tensor([prompt])
    for fmt, (model, _) in models.items():
        prefills[fmt] = lambda m=model: m(x, last_only=True)
    llm = _llama_cpp(path, threads, logits_all=False)
    if llm is not None:
        n_vocab = llm.n_vocab()

        def llama_decode() -> list[int]:
            llm.reset()
            llm.eval(short)
            out = []
            for _ in range(new_tokens):
                logits = np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(n_vocab,))
                out.append(int(logits.argmax()))
                llm.eval(out[-1:])
            return out

        def llama_prefill() -> None:
            llm.reset()
            llm.eval(prompt)

        tokens["llama.cpp"] = llama_decode()
        decoders["llama.cpp"] = llama_decode
        prefills["llama.cpp"] = llama_prefill
    decoders["bandwidth"] = bandwidth_reader(torch.device("cpu"))
    with torch.inference_mode():
        decode = interleaved_best(decoders, repeats)
        prefill = interleaved_best(prefills, repeats)
    bandwidth = BANDWIDTH_BYTES / decode["bandwidth"]
    r["bandwidth_gb_s"] = bandwidth / 1e9
    for fmt in [*formats, *(["llama.cpp"] if llm is not None else [])]:
        row = r["formats"].setdefault(fmt, {"bytes": r["gguf_tensor_bytes"]})
        row["decode_tok_s"] = new_tokens / decode[fmt]
        row["prefill_tok_s"] = len(prompt) / prefill[fmt]
        row["roofline_fraction"] = row["decode_tok_s"] * row["bytes"] / bandwidth  # each step reads every weight once
        row["same_tokens_as_float32"] = tokens[fmt] == tokens.get("float32")
    # quality on held-out text, against float32
    ids = held_out_tokens(tok, quality_windows * window + 1)
    windows = [ids[i * window:(i + 1) * window + 1] for i in range(quality_windows)]
    targets = torch.tensor([t for w in windows for t in w[1:]])
    with torch.inference_mode():
        logits = {fmt: torch.cat([model(torch.tensor([w[:-1]]))[0] for w in windows]) for fmt, (model, _) in
                  models.items()}
    if llm is not None:
        del llm
        scorer = _llama_cpp(path, threads, logits_all=True)
        rows = []
        for w in windows:
            scorer.reset()
            scorer.eval(w[:-1])
            rows.append(torch.from_numpy(np.array(scorer.scores[: len(w) - 1], dtype=np.float32)))
        logits["llama.cpp"] = torch.cat(rows)
    reference = logits.get("float32", next(iter(logits.values())))
    for fmt, values in logits.items():
        r["formats"][fmt].update(format_quality(values, reference, targets))
    if "llama.cpp" in logits and "native" in logits:
        r["top1_native_vs_llama_cpp"] = (logits["native"].argmax(-1) == logits["llama.cpp"].argmax(-1)).double().mean().item()
    r["quality_tokens"] = len(targets)
    return r


def print_quant_report(r: dict[str, Any]) -> None:
    print(f"weight formats of SmolLM2-135M-Instruct, CPU, {r['threads']} threads, batch 1; GGUF tensors "
          f"{r['gguf_tensor_bytes'] / 1e6:.1f} MB; bandwidth {r['bandwidth_gb_s']:.1f} GB/s (measured in the same rounds)")
    print(f"  {'format':<10}{'MB':>8}{'decode tok/s':>14}{'prefill tok/s':>15}{'roofline':>10}"
          f"{'KL nats':>10}{'top-1':>8}{'ppl':>8}  same greedy tokens as float32")
    for fmt, row in r["formats"].items():
        print(f"  {fmt:<10}{row['bytes'] / 1e6:>8.1f}{row['decode_tok_s']:>14.1f}{row['prefill_tok_s']:>15.1f}"
              f"{100 * row['roofline_fraction']:>9.0f}%{row.get('kl_mean', float('nan')):>10.4f}"
              f"{100 * row.get('top1_agreement', float('nan')):>7.1f}%{row.get('perplexity', float('nan')):>8.2f}"
              f"  {row['same_tokens_as_float32']}")
    if "top1_native_vs_llama_cpp" in r:
        print(f"  top-1 agreement, native vs llama.cpp on the same file: {100 * r['top1_native_vs_llama_cpp']:.1f}% "
              f"({r['quality_tokens']} held-out positions; llama.cpp rounds activations to 8 bits in its products)")
    else:
        print("  llama.cpp: not installed (`make bench-peers` builds llama-cpp-python, ~15 min)")


def bench_scheduler(system_tokens: int = 512, n_requests: int = 16, long_prompt_tokens: int = 4000,
                    streams: int = 8, chunk: int = 256) -> dict[str, Any]:
    """What prefix caching and chunked prefill change, measured on the Engine (CPU, float32), each
    side in the same run:

    * ``n_requests`` requests sharing a ``system_tokens``-token system prompt, each with its own
      question, arriving one after another: time to first token with and without prefix caching,
      the share of prompt tokens found in the cache, and whether the answers are the same.
    * ``streams`` requests decoding when one ``long_prompt_tokens``-token prompt arrives: the
      longest gap between two tokens of those streams, with the prompt prefilled whole and in
      ``chunk``-token chunks.
    """
    from minillm.engine import Engine
    from minillm.model import load_model
    from minillm.sampling import SamplingParams

    model, tok = load_model(device="cpu")
    corpus = tok.encode(corpus_path().read_text(encoding="utf-8")[:200_000])
    system = corpus[:system_tokens]
    questions = [tok.encode(f"\nQuestion {i}: who speaks next, and why?") for i in range(n_requests)]
    params = SamplingParams(max_new_tokens=16)
    r: dict[str, Any] = {"system_tokens": system_tokens, "n_requests": n_requests}
    answers = {}
    for caching in (False, True):
        engine = Engine(model, tok, max_batch_size=16, prefix_caching=caching)
        engine.generate([corpus[-64:]], params)  # compile the step, outside the timing
        ttfts = []
        for question in questions:
            request = engine.add_request(system + question, params)
            start = time.perf_counter()
            while not request.output_ids:
                engine.step()
            ttfts.append(time.perf_counter() - start)
            while engine.has_unfinished_requests():
                engine.step()
        answers[caching] = [engine.generate([system + q], params)[0].token_ids for q in questions[:4]]
        key = "cached" if caching else "uncached"
        r[f"ttft_mean_s_{key}"] = sum(ttfts) / len(ttfts)
        if caching:
            r["prefix_hit_rate"] = engine.cached_prompt_tokens / engine.prompt_tokens
    r["ttft_ratio"] = r["ttft_mean_s_cached"] / r["ttft_mean_s_uncached"]
    r["same_answers"] = answers[False] == answers[True]

    long_prompt = corpus[system_tokens : system_tokens + long_prompt_tokens]
    r.update({"long_prompt_tokens": len(long_prompt), "streams": streams, "chunk": chunk})
    for chunk_tokens in (None, chunk):
        engine = Engine(model, tok, max_batch_size=16, prefill_chunk_tokens=chunk_tokens)
        engine.generate([corpus[-64:]], params)
        running = [engine.add_request(corpus[i * 50 : i * 50 + 20], SamplingParams(max_new_tokens=1000))
                   for i in range(streams)]
        while any(not request.output_ids for request in running):
            engine.step()
        for _ in range(3):
            engine.step()
        long = engine.add_request(long_prompt, SamplingParams(max_new_tokens=1))
        last = time.perf_counter()
        worst = 0.0
        while not long.finished:
            engine.step()
            now = time.perf_counter()
            worst, last = max(worst, now - last), now
        for request in running:
            engine.abort(request)
        r[f"worst_gap_s_{'chunked' if chunk_tokens else 'whole'}"] = worst
    r["gap_ratio"] = r["worst_gap_s_chunked"] / r["worst_gap_s_whole"]
    return r


def print_scheduler_report(r: dict[str, Any]) -> None:
    print(f"prefix caching: {r['n_requests']} requests sharing a {r['system_tokens']}-token system prompt, one after "
          f"another: mean time to first token {1000 * r['ttft_mean_s_cached']:.0f} ms cached vs "
          f"{1000 * r['ttft_mean_s_uncached']:.0f} ms not = {r['ttft_ratio']:.2f}x (goal: <= 0.3x); "
          f"{100 * r['prefix_hit_rate']:.0f}% of prompt tokens found in the cache; same answers: {r['same_answers']}")
    print(f"chunked prefill: a {r['long_prompt_tokens']}-token prompt arrives while {r['streams']} requests stream: "
          f"their worst gap between tokens {1000 * r['worst_gap_s_chunked']:.0f} ms with {r['chunk']}-token chunks vs "
          f"{1000 * r['worst_gap_s_whole']:.0f} ms whole = {r['gap_ratio']:.2f}x (goal: <= 0.25x)")


# --------------------------------------------------------------------------- bench serve
# The HTTP server under load: clients arriving at random (a seeded Poisson stream), each with
# the same system prompt and a question of its own, streaming their answers over loopback from
# `python -m minillm serve` (with prefix caching and chunked prefill on and off) and from
# `transformers serve` (transformers' own OpenAI-compatible server) on the same weights.

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


def serve_body(server: str, messages: list[dict[str, str]], max_tokens: int) -> dict[str, Any]:
    """A streaming, greedy chat request for ``max_tokens`` tokens, no fewer, in each server's dialect.

    minillm: ``ignore_eos`` (as vLLM has it), and ``stream_options.include_usage`` for the token
    count. transformers serve has neither (it refuses unknown fields and ignores
    ``stream_options``; its last chunk carries the usage anyway): its ``generate()`` path gets a
    ``generation_config`` with ``min_new_tokens``; its continuous batching hands a request only
    ``max_new_tokens`` and an EOS id, which falls back to the first request's generation config,
    and this one names none (its log: "Setting to -1 (disabled)"). The token counts are checked
    anyway: ``bench serve`` reports any server that returned fewer.
    """
    body: dict[str, Any] = {"messages": messages, "max_tokens": max_tokens, "temperature": 0.0, "stream": True}
    if server == "minillm":
        body.update(ignore_eos=True, stream_options={"include_usage": True})
    else:
        import json

        body["generation_config"] = json.dumps({"max_new_tokens": max_tokens, "min_new_tokens": max_tokens,
                                                "do_sample": False})
    return body


async def _stream_chat(client: Any, body: dict[str, Any]) -> dict[str, Any]:
    """Send one streaming chat completion; timestamps (``time.perf_counter``) and counts of its answer."""
    import json

    import httpx

    row: dict[str, Any] = {"sent": time.perf_counter(), "first": None, "last": None, "chunks": 0,
                           "usage_tokens": None, "error": None, "text": ""}
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                detail = (await response.aread()).decode("utf-8", "replace")[:300]
                row["error"] = f"HTTP {response.status_code}: {detail}"
            else:
                async for line in response.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    event = json.loads(data)
                    if "error" in event:
                        row["error"] = f"error event: {str(event['error'])[:300]}"
                        break
                    choices = event.get("choices") or []
                    content = "".join((choice.get("delta") or {}).get("content") or "" for choice in choices)
                    if content:
                        row["first"] = row["first"] or time.perf_counter()
                        row["chunks"] += 1
                        row["text"] += content
                    if content or any(choice.get("finish_reason") for choice in choices):
                        # the last token's time: its content, or the finish that follows it at once (a
                        # token with no text of its own, as a special one, shows up only there)
                        row["last"] = time.perf_counter()
                    if event.get("usage"):
                        row["usage_tokens"] = event["usage"].get("completion_tokens")
    except (httpx.HTTPError, ValueError) as err:  # ValueError: a line that is not JSON
        row["error"] = f"{type(err).__name__}: {err}"
    row["done"] = time.perf_counter()
    if row["error"] is None and row["first"] is None:
        row["error"] = "the answer had no content"
    return row


async def _drive_load(url: str, bodies: list[dict[str, Any]], arrivals: list[float],
                      timeout: float) -> list[dict[str, Any]]:
    import asyncio

    import httpx

    limits = httpx.Limits(max_connections=len(bodies), max_keepalive_connections=len(bodies))
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(timeout), limits=limits) as client:
        start = time.perf_counter()

        async def one(i: int) -> dict[str, Any]:
            await asyncio.sleep(max(0.0, start + arrivals[i] - time.perf_counter()))
            row = await _stream_chat(client, bodies[i])
            row["late"] = row["sent"] - (start + arrivals[i])  # how far behind its schedule the client sent it
            return row

        return list(await asyncio.gather(*(one(i) for i in range(len(bodies)))))


def run_load(url: str, bodies: list[dict[str, Any]], arrivals: list[float],
             timeout: float = 600.0) -> list[dict[str, Any]]:
    """Send ``bodies[i]`` to ``url``'s ``/v1/chat/completions`` at ``arrivals[i]`` seconds from now,
    each streaming on a connection of its own (asyncio, httpx), and wait for every answer.

    Per request, in seconds: ``ttft`` (sent to first content), ``tpot`` ((last token - first
    content) / (tokens - 1), the last token's time being its content or the finish chunk),
    ``latency`` (sent to the end of the stream), ``tokens`` (the usage count the server reports,
    else the content chunks), ``chunks``, ``text``, ``late`` (sent behind schedule), and
    ``error`` (None, or what went wrong: a status, an error event, no content, an exception),
    plus the raw ``sent`` / ``done`` timestamps.
    """
    import asyncio

    rows = asyncio.run(_drive_load(url, bodies, arrivals, timeout))
    for row in rows:
        tokens = row["usage_tokens"] if row["usage_tokens"] is not None else row["chunks"]
        row["tokens"] = tokens
        row["latency"] = row["done"] - row["sent"]
        ok = row["error"] is None
        row["ttft"] = row["first"] - row["sent"] if ok else None
        row["tpot"] = (row["last"] - row["first"]) / (tokens - 1) if ok and tokens > 1 else None
    return rows


def load_summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """One run: request and error counts, tokens, output tokens/s over the run's span (first send
    to last answer), p50/p99 of TTFT, TPOT and latency (ms) over the requests that succeeded."""
    ok = [row for row in rows if row["error"] is None]
    span = max(row["done"] for row in rows) - min(row["sent"] for row in rows) if rows else 0.0
    tokens = sum(row["tokens"] for row in ok)
    summary: dict[str, Any] = {"requests": len(rows), "errors": len(rows) - len(ok), "tokens": tokens,
                               "span_s": span, "tok_s": tokens / span if span > 0 else 0.0,
                               "late_max_ms": 1000 * max((row["late"] for row in rows if "late" in row), default=0.0),
                               "first_errors": sorted({row["error"] for row in rows if row["error"]})[:3]}
    for metric in ("ttft", "tpot", "latency"):
        values = [1000 * row[metric] for row in ok if row[metric] is not None]
        summary[f"{metric}_p50_ms"] = percentile(values, 50) if values else None
        summary[f"{metric}_p99_ms"] = percentile(values, 99) if values else None
    return summary


def prometheus_values(text: str) -> dict[str, float]:
    """``name{labels} value`` lines of Prometheus text, by ``name{labels}``; comments skipped."""
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            try:
                values[name] = float(value)
            except ValueError:
                continue
    return values


def _die_with_parent() -> Callable[[], None] | None:
    """For Popen's ``preexec_fn`` on Linux: the child gets SIGTERM when this process dies, even by
    SIGKILL, so no server outlives the benchmark. (Looked up here, so the child only calls it.)"""
    import signal
    import sys

    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    return lambda: prctl(1, signal.SIGTERM)  # 1: PR_SET_PDEATHSIG


def free_port() -> int:
    import socket

    with socket.create_server(("127.0.0.1", 0)) as sock:
        return sock.getsockname()[1]


class ServerProcess:
    """A server in a subprocess: its own process group (ended as a whole, compile workers
    included), its output in ``log_path``; ``stop()`` always ends it, SIGTERM then SIGKILL."""

    def __init__(self, name: str, argv: list[str], port: int, log_path: Path, env: dict[str, str]) -> None:
        import subprocess

        self.name, self.argv, self.url, self.log_path = name, argv, f"http://127.0.0.1:{port}", log_path
        self.stopped = False
        self._log = open(log_path, "wb")  # noqa: SIM115 (closed by stop)
        self.process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT,
                                        env=env, start_new_session=True, preexec_fn=_die_with_parent())

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(encoding="utf-8", errors="replace")[-chars:]
        except OSError:
            return ""

    def peak_rss_mb(self) -> float | None:
        """The server process's peak resident memory (Linux: VmHWM), in MB; None where unknown."""
        try:
            status = Path(f"/proc/{self.process.pid}/status").read_text()
        except OSError:
            return None
        line = next((line for line in status.splitlines() if line.startswith("VmHWM:")), None)
        return int(line.split()[1]) / 1024 if line else None

    def wait_ready(self, timeout: float) -> None:
        """Poll ``/health`` until it answers 200 with status ok (bounded); the server's log in the error."""
        import httpx

        deadline = time.monotonic() + timeout
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.name} exited with status {self.process.returncode} before it was ready "
                                   f"({' '.join(self.argv)}); its log ends:\n{self.log_tail()}")
            try:
                response = httpx.get(f"{self.url}/health", timeout=5)
                if response.status_code == 200 and response.json().get("status") == "ok":
                    return
            except (httpx.HTTPError, ValueError):
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.name} was not ready after {timeout:.0f} s; its log ends:\n{self.log_tail()}")
            time.sleep(0.5)

    def stop(self) -> None:
        import os
        import signal
        import subprocess

        if self.stopped:  # once: the group id is not ours to signal after that
            return
        self.stopped = True
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(self.process.pid, sig)  # the group: the server and whatever it started
            except (ProcessLookupError, PermissionError):
                pass
            try:
                self.process.wait(15)
            except subprocess.TimeoutExpired:
                continue
        self._log.close()


def _serve_children_env() -> dict[str, str]:
    """The servers' environment: offline, unbuffered, and this very minillm importable."""
    import os

    import minillm

    env = dict(os.environ)
    env["HF_HUB_OFFLINE"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    root = str(Path(minillm.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def _range(values: list[float | None], best: Callable[[list[float]], float]) -> dict[str, float | None]:
    present = [v for v in values if v is not None]
    if not present:
        return {"best": None, "min": None, "max": None}
    return {"best": best(present), "min": min(present), "max": max(present)}


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

    Every server is a subprocess on a free port of 127.0.0.1, started once, warmed up (its first
    requests compile or allocate what they need) and ended at the end, whatever happens. The
    servers take turns: in each of ``rounds`` rounds every server gets the same load (the same
    arrival times; a system prompt of that round's own, so no cache starts warm), so a busy
    spell of a shared machine hits them alike. Per run: output tokens/s, TTFT / TPOT p50 and
    p99, errors, and minillm's prefix-cache hit rate (from its ``/metrics`` counters). The
    default load is a workshop room: 32 clients arriving at 8 per second, 32 seats in the batch.

    transformers is run as its serving docs advise for concurrent clients, with continuous
    batching (paged KV, its own prefix sharing), its KV cache sized to minillm's pool
    (``max_batch_size`` x 1024 tokens; left to itself it takes 90% of free memory); and plainly,
    one ``generate()`` after another. If it cannot start, the report says why and minillm's
    configurations are still measured.
    """
    import signal
    import sys
    import tempfile
    import threading
    from contextlib import ExitStack

    import torch

    from minillm.model.loading import convert_gguf

    if dtype not in ("float32", "bfloat16"):
        raise ValueError(f"bench serve runs float32 or bfloat16 (minillm serve's --weights), not {dtype}")
    for name in minillm_configs:
        if name not in MINILLM_SERVE_CONFIGS:
            raise ValueError(f"unknown minillm configuration {name!r}: pick from {', '.join(MINILLM_SERVE_CONFIGS)}")
    for name in transformers_modes:
        if name not in TRANSFORMERS_SERVE_MODES:
            raise ValueError(f"unknown transformers mode {name!r}: pick from {', '.join(TRANSFORMERS_SERVE_MODES)}")
    if n_requests < 1 or rounds < 1 or max_tokens < 1 or system_tokens < 1 or rate <= 0:
        raise ValueError("requests, rounds, max_tokens and system_tokens must be >= 1, and the rate > 0")
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
    plans: list[tuple[str, str, str, list[str]]] = []  # (name, label, dialect, argv)
    for name in minillm_configs:
        label, flags = MINILLM_SERVE_CONFIGS[name]
        plans.append((f"minillm:{name}", label, "minillm",
                      [sys.executable, "-m", "minillm", "serve", "--model", str(folder), "--device", device,
                       "--weights", dtype, "--max-batch-size", str(max_batch_size), *flags]))
    for name in transformers_modes:
        argv = [sys.executable, "-m", "transformers.cli.transformers", "serve", str(folder), "--device", device,
                "--dtype", dtype, "--host", "127.0.0.1", "--log-level", "warning"]
        if name == "cb":
            argv += ["--continuous-batching", "--cb-num-blocks", str(-(-kv_tokens // HF_CB_PAGE_TOKENS))]
        plans.append((f"transformers:{name}", TRANSFORMERS_SERVE_MODES[name], "transformers", argv))

    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt  # SIGTERM ends the benchmark as Ctrl-C does: through the cleanup below

    in_main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, interrupt) if in_main else None
    try:
        with tempfile.TemporaryDirectory(prefix="minillm-bench-serve-") as logs, ExitStack() as stack:
            env = _serve_children_env()
            servers: dict[str, tuple[ServerProcess, str]] = {}
            warm_up = serve_conversations(systems_text[-1], 2)
            for name, label, dialect, argv in plans:
                port = free_port()
                argv = [*argv, "--port", str(port)]
                start = time.perf_counter()
                print(f"bench serve: starting {label} ...", file=sys.stderr, flush=True)
                server = ServerProcess(name, argv, port, Path(logs) / f"{name.replace(':', '-')}.log", env)
                stack.callback(server.stop)
                entry = r["systems"][name] = {"label": label, "command": " ".join(argv[1:]), "runs": []}
                try:
                    server.wait_ready(ready_timeout)
                    rows = run_load(server.url, [serve_body(dialect, m, 4) for m in warm_up], [0.0, 0.0],
                                    request_timeout)
                    if any(row["error"] for row in rows):
                        raise RuntimeError(f"{label}: the warm-up requests failed: {load_summary(rows)['first_errors']}; "
                                           f"its log ends:\n{server.log_tail()}")
                except RuntimeError as err:
                    if dialect == "minillm":
                        raise
                    server.stop()
                    r["transformers_error"] = (r["transformers_error"] or "") + f"{label}: {err}\n"
                    entry["error"] = str(err)
                    print(f"bench serve: {label} could not run: {err}", file=sys.stderr, flush=True)
                    continue
                entry["ready_s"] = time.perf_counter() - start
                servers[name] = (server, dialect)
            texts: dict[str, list[list[str]]] = {name: [] for name in servers}
            for round_index in range(rounds):
                conversations = serve_conversations(systems_text[round_index], n_requests)
                for name, (server, dialect) in servers.items():
                    before = _metrics(server.url) if dialect == "minillm" else {}
                    rows = run_load(server.url, [serve_body(dialect, m, max_tokens) for m in conversations],
                                    arrivals, request_timeout)
                    summary = load_summary(rows)
                    texts[name].append([row["text"] for row in rows])
                    if dialect == "minillm":
                        after = _metrics(server.url)
                        hits, queries = (after.get(f"minillm_prefix_cache_{k}_tokens_total", 0.0)
                                         - before.get(f"minillm_prefix_cache_{k}_tokens_total", 0.0)
                                         for k in ("hit", "query"))
                        summary["prompt_tokens"] = queries
                        summary["prefix_hit_rate"] = hits / queries if queries else 0.0
                    else:
                        summary["prefix_hit_rate"] = None  # transformers serve reports no such count
                    summary["round"] = round_index + 1
                    r["systems"][name]["runs"].append(summary)
                    print(f"bench serve: round {round_index + 1}, {r['systems'][name]['label']}: "
                          f"{summary['tok_s']:.1f} tok/s, {summary['errors']} errors", file=sys.stderr, flush=True)
            for name, (server, _) in servers.items():
                r["systems"][name]["peak_rss_mb"] = server.peak_rss_mb()
            # the same greedy answers from the same weights: both sides did the same work
            for name in servers:
                if name.startswith("transformers:") and "minillm:on" in servers:
                    pairs = [(a, b) for ours, theirs in zip(texts["minillm:on"], texts[name])
                             for a, b in zip(ours, theirs)]
                    r["systems"][name]["same_answers_as_minillm"] = (sum(a == b for a, b in pairs), len(pairs))
    finally:
        if in_main:
            signal.signal(signal.SIGTERM, previous)
    for entry in r["systems"].values():
        runs = entry["runs"]
        if not runs:
            continue
        entry["best"] = {"tok_s": _range([run["tok_s"] for run in runs], max)}
        for metric in ("ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms"):
            entry["best"][metric] = _range([run[metric] for run in runs], min)
        entry["errors"] = sum(run["errors"] for run in runs)
        entry["tokens_expected"] = n_requests * max_tokens * len(runs)
        entry["tokens_returned"] = sum(run["tokens"] for run in runs)
    r["ratios"] = serve_ratios(r["systems"])
    return r


def _metrics(url: str) -> dict[str, float]:
    import httpx

    return prometheus_values(httpx.get(f"{url}/metrics", timeout=30).text)


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
            per_round = [x[metric] / y[metric] for x, y in zip(ours["runs"], theirs["runs"])
                         if x[metric] is not None and y[metric]]
            row[f"{key}_per_round"] = (min(per_round), max(per_round)) if per_round else None
        out.append(row)
    return out


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def print_serve_report(r: dict[str, Any]) -> None:
    print(f"bench serve: {r['requests']} streaming chat clients per run, Poisson arrivals at {r['rate']:g}/s "
          f"(seed {r['seed']}; the last sent at {r['arrival_span_s']:.1f} s), a {r['system_tokens']}-token shared "
          f"system prompt + a distinct question each, {r['max_tokens']} greedy tokens per answer; "
          f"{r['rounds']} interleaved round(s); {r['device']}, {r['dtype']}, {r['threads']} threads; "
          f"weights: {r['model']}; times in ms")
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
    print("  best of rounds (range over rounds):")
    for entry in r["systems"].values():
        if not entry["runs"]:
            continue
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
    for row in r["ratios"]:
        def ratio(key: str) -> str:
            low_high = row[f"{key}_per_round"]
            per_round = f"; per round {low_high[0]:.2f}-{low_high[1]:.2f}x" if low_high else ""
            return f"{_fmt(row[key], '.2f')}x{per_round}"

        print(f"minillm serve (defaults) vs {row['label']}: throughput {ratio('throughput')} (goal: >= 2x); "
              f"p99 TTFT {ratio('ttft_p99')} (goal: <= 0.5x)")
    late = max((run["late_max_ms"] for entry in r["systems"].values() for run in entry["runs"]), default=0.0)
    if late > 50:
        print(f"note: the client sent some requests up to {late:.0f} ms behind their schedule (a busy machine)")
    if r["transformers_error"]:
        print(f"transformers serve could not run here:\n{r['transformers_error'].rstrip()}")
