"""``bench model`` (the default): prefill and batch-1 decode of the Engine against transformers
on the same weights, with the memory bandwidth measured in the same rounds for the roofline."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch.utils.benchmark import timer

from minillm.assets import default_gguf_path
from minillm.bench.timing import BANDWIDTH_BYTES, bandwidth_reader, interleaved_best
from minillm.bench.workloads import DECODE_PROMPT_TOKENS, corpus_prompt
from minillm.tokenizer import Tokenizer


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


def run(args: argparse.Namespace) -> dict[str, Any]:
    return bench_model(args.device, args.dtype, source=args.model)


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

    prompt = corpus_prompt(tok, prompt_tokens)
    short = prompt[:DECODE_PROMPT_TOKENS]
    x = torch.tensor([prompt], device=dev)
    engine = Engine(model, tok, max_batch_size=8)
    eager = Engine(model, tok, max_batch_size=8, backend="eager")
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    results: dict[str, Any] = {
        "model": str(source or default_gguf_path().name), "device": str(dev), "dtype": dtype,
        "threads": torch.get_num_threads(),
        "prompt_tokens": len(prompt), "new_tokens": new_tokens, "backend": engine.backend,
    }
    start = timer()  # (torch.utils.benchmark's clock synchronizes the device)
    engine_tokens = engine.generate([short], params)[0].token_ids  # the first call compiles the decode step
    results["compile_s"] = timer() - start
    results["same_tokens_as_eager"] = engine_tokens == eager.generate([short], params)[0].token_ids

    def hf_generate() -> None:
        ids = torch.tensor([short], device=dev)
        reference.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                           min_new_tokens=new_tokens, do_sample=False, pad_token_id=tok.pad_id)

    decoders: dict[str, Callable[[], Any]] = {
        "minillm": lambda: engine.generate([short], params),
        "minillm_eager": lambda: eager.generate([short], params),
        "hf": hf_generate,
    }
    if hf_compiled:
        hf_static = _hf_static_compiled(reference, short, new_tokens)
        start = timer()
        hf_static_tokens = hf_static()[0, len(short):].tolist()  # compiles
        results["hf_compile_s"] = timer() - start
        results["same_tokens_as_hf_static"] = hf_static_tokens == engine_tokens
        decoders["hf_static_compiled"] = hf_static
    # the bandwidth too, in the same rounds: a busy spell on a shared machine lowers all alike
    decoders["bandwidth"] = bandwidth_reader(dev)
    with torch.inference_mode():
        prefill = interleaved_best({
            "minillm": lambda: model(x, last_only=True),
            "hf": lambda: reference(x, logits_to_keep=1),
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
    print(f"{'decode, batch 1, ' + str(r['new_tokens']) + ' tokens (tok/s): Engine, ' + r['backend']:<52}"
          f"{r['decode_tok_s_minillm']:>10.1f}{r['decode_tok_s_hf']:>14.1f}   {r['decode_ratio']:.2f}x "
          "vs generate() eager")
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
