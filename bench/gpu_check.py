"""The GPU check: one script for a lent CUDA machine, run in one go (a few minutes).

The real SmolLM2 weights (a 98 MB GGUF, 540 MB once converted) are too big to carry to the
device machine, so this builds a checkpoint with SmolLM2-135M-Instruct's exact shapes, the real
tokenizer and random weights, with transformers itself. Decode speed depends on the shapes,
not the values; exactness is checked as everywhere else, minillm against transformers on the
same weights.

    python bench/gpu_check.py prepare .gpu                              # here: config + tokenizer
    PYTHONPATH=. python3 bench/gpu_check.py run .gpu --out $OUT        # there, carrying .gpu

It writes ``gpu_check.json`` to ``--out``: greedy parity of the compiled (CUDA-graph) decoder,
the eager decoder and transformers in float32, then ``bench_model`` in bfloat16 and float32.
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
from minillm.engine.fast import FastDecoder
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
    """Greedy tokens of transformers, the eager decoder and the compiled one (float32)."""
    model, tok = load_model(folder, device=device, dtype=torch.float32)
    reference = hf_causal_lm(folder).to(device)
    fast, eager = FastDecoder(model, max_len=256), FastDecoder(model, max_len=256, compile=False)
    rows = []
    for prompt in PROMPTS:
        ids = tok.encode(prompt)
        x = torch.tensor([ids], device=device)
        with torch.inference_mode():
            hf = reference.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=new_tokens,
                                    min_new_tokens=new_tokens, do_sample=False, pad_token_id=tok.pad_id)
        expected = hf[0, len(ids):].tolist()
        start = time.perf_counter()
        compiled = fast.greedy(ids, new_tokens)
        rows.append({"prompt": prompt, "compiled_equals_hf": compiled == expected,
                     "eager_equals_hf": eager.greedy(ids, new_tokens) == expected,
                     "replay_equals_first": fast.greedy(ids, new_tokens) == compiled,
                     "first_call_s": time.perf_counter() - start})
    return {"compiled": fast.compiled, "prompts": rows}


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
        save()
        print(f"{dtype}: decode {r['decode_tok_s_minillm']:.0f} tok/s (transformers {r['decode_tok_s_hf']:.0f}, "
              f"{r['decode_ratio']:.2f}x; eager {r['decode_tok_s_minillm_eager']:.0f}); "
              f"{100 * r['roofline_fraction']:.0f}% of the roofline at {r['bandwidth_gb_s']:.0f} GB/s; "
              f"compile {r['compile_s']:.0f} s", flush=True)


if __name__ == "__main__":
    main()
