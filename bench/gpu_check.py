"""The GPU check: one script for a lent CUDA machine, run in one go (a few minutes).

The real SmolLM2 weights (a 98 MB GGUF, 540 MB once converted) are too big to carry to the
device machine, so this builds a checkpoint with SmolLM2-135M-Instruct's exact shapes, the real
tokenizer and random weights, with transformers itself. Decode speed depends on the shapes,
not the values; exactness is checked as everywhere else, minillm against transformers on the
same weights.

    python bench/gpu_check.py prepare .gpu                              # here: config + tokenizer
    PYTHONPATH=. python3 bench/gpu_check.py run .gpu --out $OUT        # there, carrying .gpu

It writes ``gpu_check.json`` to ``--out``: greedy parity of the compiled (CUDA-graph) Engine,
the eager Engine and transformers in float32 (batch 1 and the three prompts batched), then
``bench_model`` and ``bench batching``-style batch-8 decode in bfloat16 and float32.
It runs on a CPU too (``--device cpu``), which is how it was tested before a GPU was lent.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

import torch

from minillm import load_model
from minillm.bench import bench_model
from minillm.engine import Engine
from minillm.sampling import SamplingParams
from minillm.reference import hf_causal_lm

PROMPTS = ["The capital of France is", "def fibonacci(n):\n    ", "Once upon a time, in a small village"]


def prepare(assets: Path) -> None:
    """Copy the default model's config.json and tokenizer.json (2 MB) into ``assets``."""
    from minillm.assets import default_gguf_path
    from minillm.model.loading import convert_gguf

    folder = convert_gguf(default_gguf_path())
    assets.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "tokenizer.json"):
        shutil.copy(folder / name, assets / name)


def random_checkpoint(assets: Path, folder: Path, seed: int = 0) -> Path:
    """An HF checkpoint folder: ``assets``' config.json and tokenizer.json, random weights."""
    from transformers import AutoConfig, AutoModelForCausalLM

    folder.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "tokenizer.json"):
        shutil.copy(assets / name, folder / name)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(folder)), dtype=torch.float32)
    model.save_pretrained(str(folder))
    return folder


def greedy_parity(folder: Path, device: str, new_tokens: int) -> dict[str, object]:
    """Greedy tokens of transformers, the eager Engine and the compiled one (float32)."""
    model, tok = load_model(folder, device=device, dtype=torch.float32)
    reference = hf_causal_lm(folder).to(device)
    compiled, eager = Engine(model, tok), Engine(model, tok, backend="eager")
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    rows, expected_all = [], []
    for prompt in PROMPTS:
        ids = tok.encode(prompt)
        x = torch.tensor([ids], device=device)
        with torch.inference_mode():
            hf = reference.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=new_tokens,
                                    min_new_tokens=new_tokens, do_sample=False, pad_token_id=tok.pad_id)
        expected = hf[0, len(ids):].tolist()
        expected_all.append(expected)
        start = time.perf_counter()
        first = compiled.generate([prompt], params)[0].token_ids
        rows.append({"prompt": prompt, "compiled_equals_hf": first == expected,
                     "eager_equals_hf": eager.generate([prompt], params)[0].token_ids == expected,
                     "replay_equals_first": compiled.generate([prompt], params)[0].token_ids == first,
                     "first_call_s": time.perf_counter() - start})
    batched = [c.token_ids for c in compiled.generate(PROMPTS, params)]
    return {"compiled": compiled.runner.compiled, "prompts": rows, "batched_equals_hf": batched == expected_all,
            "compile_s": compiled.runner.compile_seconds}


def batch_decode(folder: Path, device: str, dtype: str, new_tokens: int, rows: int = 8) -> dict[str, float]:
    """Aggregate decode tokens/s of the compiled Engine with ``rows`` requests at once."""
    model, tok = load_model(folder, device=device, dtype=getattr(torch, dtype))
    engine = Engine(model, tok, max_batch_size=rows)
    prompts = [tok.encode(p) for p in (PROMPTS * rows)[:rows]]
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    def sync() -> None:
        if device.startswith("cuda"):
            torch.cuda.synchronize()

    engine.generate(prompts, params)  # compile, record the graphs
    sync()
    start = time.perf_counter()
    engine.generate(prompts, params)
    sync()
    return {"rows": rows, "tok_s": rows * new_tokens / (time.perf_counter() - start)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("step", choices=["prepare", "run"])
    parser.add_argument("assets", type=Path, help="the folder for config.json and tokenizer.json")
    parser.add_argument("--out", type=Path, default=Path("."))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--new-tokens", type=int, default=128)
    args = parser.parse_args()
    if args.step == "prepare":
        prepare(args.assets)
        return
    args.out.mkdir(parents=True, exist_ok=True)
    results: dict[str, object] = {"torch": torch.__version__, "device": args.device}
    if args.device.startswith("cuda"):
        results["device_name"] = torch.cuda.get_device_name()
    folder = random_checkpoint(args.assets, Path("/tmp/minillm-gpu-check/smollm2-135m-random"))

    def save() -> None:
        (args.out / "gpu_check.json").write_text(json.dumps(results, indent=2))

    results["parity_float32"] = greedy_parity(folder, args.device, 32)
    save()
    print(json.dumps(results["parity_float32"], indent=2), flush=True)
    for dtype in ("bfloat16", "float32"):
        torch._dynamo.reset()
        r = bench_model(args.device, dtype, new_tokens=args.new_tokens, source=folder)
        results[f"bench_{dtype}"] = r
        results[f"batch8_{dtype}"] = batch_decode(folder, args.device, dtype, args.new_tokens)
        save()
        print(f"{dtype}: decode {r['decode_tok_s_minillm']:.0f} tok/s (transformers {r['decode_tok_s_hf']:.0f}, "
              f"{r['decode_ratio']:.2f}x; eager {r['decode_tok_s_minillm_eager']:.0f}); "
              f"{100 * r['roofline_fraction']:.0f}% of the roofline at {r['bandwidth_gb_s']:.0f} GB/s; "
              f"compile {r['compile_s']:.0f} s", flush=True)


if __name__ == "__main__":
    main()
