"""``bench gpu``: the check for a lent CUDA machine, run in one go (a few minutes).

The real SmolLM2 weights are too big to carry to the device machine, so this builds a
checkpoint with SmolLM2-135M-Instruct's exact shapes, the real tokenizer and random weights,
with transformers itself. Decode speed depends on the shapes, not the values; exactness is
checked as everywhere else, minillm against transformers on the same weights.

    python -m minillm bench gpu prepare .gpu                        # here: config + tokenizer
    python -m minillm bench gpu run .gpu --out $OUT                 # there, carrying .gpu

It writes ``gpu_check.json`` to ``--out``: greedy parity of the compiled (CUDA-graph) Engine,
the eager Engine and transformers in float32 (batch 1 and the prompts batched), then
``bench model`` and batch 1 / 8 / 64 decode in bfloat16 and float32, each with what the
compiler did: CUDA graphs captured and replayed (or skipped, and why) and recompiles.
It runs on a CPU too (``--device cpu``), where no CUDA graph is expected.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import sys
from pathlib import Path
from typing import Any

PROMPTS = ["The capital of France is", "def fibonacci(n):\n    ", "Once upon a time, in a small village"]
BATCH_ROWS = (1, 8, 64)
CHECKPOINT = Path("/tmp/minillm-gpu-check/smollm2-135m-random")
# the loggers whose records say what the compiler did (torch's artifact loggers, named
# "<module>.__<artifact>"; set_logs turns the artifacts on)
RECOMPILE_LOGGER = "torch._dynamo.guards.__recompiles"
LIMIT_LOGGER = "torch._dynamo.convert_frame"  # "torch._dynamo hit config.recompile_limit (8)"
CUDAGRAPH_LOGGERS = ("torch._inductor.cudagraph_utils.__cudagraphs", "torch._inductor.cudagraph_trees.__cudagraphs")


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
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    folder.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "tokenizer.json"):
        shutil.copy(assets / name, folder / name)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(folder)), dtype=torch.float32)
    model.save_pretrained(str(folder))
    return folder


def _first_reason(message: str) -> str:
    """A recompile's function and its first failed guard, from dynamo's "Recompiling function" record."""
    lines = [line.strip() for line in message.splitlines()]
    reason = next((line for line in lines if line.startswith("- ")), "")
    return f"{lines[0].removeprefix('Recompiling function ').split(' in ')[0]}: {reason.removeprefix('- ')}"


class CompileWatch(logging.Handler):
    """What ``torch.compile`` did while the watch was on: CUDA graphs captured and replayed,
    cudagraph skips with inductor's reasons, recompiles with dynamo's, and the recompile limit hit.

    This is a check script: it reads torch's private counters (``torch._dynamo.utils.counters``)
    and artifact loggers, and counts calls of ``torch.cuda.CUDAGraph``'s capture and replay by
    wrapping them; any of these may move between torch releases, which the check would show.
    """

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: dict[str, list[str]] = {"recompiles": [], "cudagraphs": [], "limit": []}
        self.calls = {"capture_begin": 0, "replay": 0}

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if record.name == RECOMPILE_LOGGER:
            self.messages["recompiles"].append(message)
        elif record.name in CUDAGRAPH_LOGGERS:
            self.messages["cudagraphs"].append(message)
        elif "recompile_limit" in message or "cache_size_limit" in message:
            self.messages["limit"].append(message)

    def _counted(self, name: str, method: Any) -> Any:
        def wrapper(graph: Any, *args: Any, **kwargs: Any) -> Any:
            self.calls[name] += 1
            return method(graph, *args, **kwargs)
        return wrapper

    def __enter__(self) -> CompileWatch:
        import torch
        from torch._dynamo.utils import counters

        self._before = (counters["inductor"]["cudagraph_skips"], counters["stats"]["unique_graphs"])
        self._methods = {name: getattr(torch.cuda.CUDAGraph, name) for name in self.calls}
        for name, method in self._methods.items():
            setattr(torch.cuda.CUDAGraph, name, self._counted(name, method))
        torch._logging.set_logs(recompiles=True, cudagraphs=True)
        for name in (RECOMPILE_LOGGER, LIMIT_LOGGER, *CUDAGRAPH_LOGGERS):
            logging.getLogger(name).addHandler(self)
        return self

    def __exit__(self, *exc: object) -> None:
        import torch
        from torch._dynamo.utils import counters

        for name in (RECOMPILE_LOGGER, LIMIT_LOGGER, *CUDAGRAPH_LOGGERS):
            logging.getLogger(name).removeHandler(self)
        torch._logging.set_logs()
        for name, method in self._methods.items():
            setattr(torch.cuda.CUDAGraph, name, method)
        skips, graphs = counters["inductor"]["cudagraph_skips"], counters["stats"]["unique_graphs"]
        self.skips, self.graphs = skips - self._before[0], graphs - self._before[1]

    def result(self) -> dict[str, Any]:
        skipped = [m for m in self.messages["cudagraphs"] if "skipping cudagraphs" in m]
        return {"cuda_graphs_captured": self.calls["capture_begin"], "cuda_graphs_replayed": self.calls["replay"],
                "cudagraph_skips": self.skips, "cudagraph_skip_reasons": sorted(set(skipped))[:5],
                "graphs_compiled": self.graphs, "recompiles": len(self.messages["recompiles"]),
                "recompile_reasons": [_first_reason(m) for m in self.messages["recompiles"]][:5],
                "recompile_limit_hit": sorted({m.splitlines()[0] for m in self.messages["limit"]})}


def greedy_parity(folder: Path, device: str, new_tokens: int) -> dict[str, Any]:
    """Greedy tokens of transformers, the eager Engine and the compiled one (float32)."""
    import torch
    from torch.utils.benchmark import timer

    from minillm.engine import Engine
    from minillm.model import load_model
    from minillm.reference import hf_causal_lm
    from minillm.sampling import SamplingParams

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
        start = timer()
        first = compiled.generate([prompt], params)[0].token_ids
        rows.append({"prompt": prompt, "compiled_equals_hf": first == expected,
                     "eager_equals_hf": eager.generate([prompt], params)[0].token_ids == expected,
                     "replay_equals_first": compiled.generate([prompt], params)[0].token_ids == first,
                     "first_call_s": timer() - start})
    batched = [c.token_ids for c in compiled.generate(PROMPTS, params)]
    return {"backend": compiled.backend, "prompts": rows, "batched_equals_hf": batched == expected_all,
            "compile_s": compiled.runner.compile_seconds}


def batch_decode(model: Any, tok: Any, rows: int, new_tokens: int) -> dict[str, float]:
    """Aggregate decode tokens/s of the compiled Engine with ``rows`` requests at once (the
    first call compiles and records the graphs; the second is timed)."""
    from minillm.bench.timing import best_time
    from minillm.engine import Engine
    from minillm.sampling import SamplingParams

    engine = Engine(model, tok, max_batch_size=rows)
    prompts = [tok.encode(p) for p in (PROMPTS * rows)[:rows]]
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    engine.generate(prompts, params)
    return {"rows": rows, "tok_s": rows * new_tokens / best_time(lambda: engine.generate(prompts, params), 1)}


def check(assets: Path, out: Path, device: str = "cuda", new_tokens: int = 128, repeats: int = 5,
          prompt_tokens: int = 256, hf_compiled: bool = True, batches: tuple[int, ...] = BATCH_ROWS,
          dtypes: tuple[str, ...] = ("bfloat16", "float32"), parity_tokens: int = 32) -> dict[str, Any]:
    """The whole check, ``gpu_check.json`` rewritten in ``out`` after each part (so a run cut
    short still leaves what it measured); progress on stderr."""
    import torch

    from minillm.bench.model import bench_model
    from minillm.model import load_model

    out.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {"torch": torch.__version__, "device": device,
                               "recompile_limit": torch._dynamo.config.recompile_limit}
    if device.startswith("cuda"):
        results["device_name"] = torch.cuda.get_device_name()
    folder = random_checkpoint(assets, CHECKPOINT)

    def save() -> None:
        (out / "gpu_check.json").write_text(json.dumps(results, indent=2))

    with CompileWatch() as watch:
        results["parity_float32"] = greedy_parity(folder, device, parity_tokens)
    results["parity_float32"]["compiler"] = watch.result()
    save()
    print(json.dumps(results["parity_float32"], indent=2), file=sys.stderr, flush=True)
    for dtype in dtypes:
        torch._dynamo.reset()
        loaded = load_model(folder, device=device, dtype=getattr(torch, dtype))
        with CompileWatch() as watch:
            results[f"bench_{dtype}"] = bench_model(device, dtype, new_tokens=new_tokens, prompt_tokens=prompt_tokens,
                                                    repeats=repeats, source=folder, hf_compiled=hf_compiled,
                                                    loaded=loaded)
        results[f"bench_{dtype}"]["compiler"] = watch.result()
        with CompileWatch() as watch:
            rows = [batch_decode(*loaded, rows, new_tokens) for rows in batches]
        results[f"batch_decode_{dtype}"] = {"rows": rows, "compiler": watch.result()}
        save()
        print_dtype_line(results, dtype, file=sys.stderr)
    return results


def print_dtype_line(r: dict[str, Any], dtype: str, file: Any = None) -> None:
    b, batches = r[f"bench_{dtype}"], r[f"batch_decode_{dtype}"]
    rows = ", ".join(f"batch {row['rows']} {row['tok_s']:.0f}" for row in batches["rows"])
    print(f"{dtype}: decode {b['decode_tok_s_minillm']:.0f} tok/s (transformers {b['decode_tok_s_hf']:.0f}, "
          f"{b['decode_ratio']:.2f}x; eager {b['decode_tok_s_minillm_eager']:.0f}); "
          f"{100 * b['roofline_fraction']:.0f}% of the roofline at {b['bandwidth_gb_s']:.0f} GB/s; "
          f"compile {b['compile_s']:.0f} s; decode tok/s {rows}", file=file, flush=True)
    for part in (b, batches):
        c = part["compiler"]
        why = f" ({'; '.join(c['cudagraph_skip_reasons'])})" if c["cudagraph_skip_reasons"] else ""
        limit = f"; recompile limit hit: {'; '.join(c['recompile_limit_hit'])}" if c["recompile_limit_hit"] else ""
        print(f"  {'bench model' if part is b else 'batches'}: CUDA graphs captured {c['cuda_graphs_captured']}, "
              f"replayed {c['cuda_graphs_replayed']}, skipped {c['cudagraph_skips']}{why}; "
              f"{c['recompiles']} recompiles{limit}", file=file, flush=True)


def print_gpu_report(r: dict[str, Any]) -> None:
    if "prepared" in r:
        print(f"bench gpu: config.json and tokenizer.json in {r['prepared']}")
        return
    p = r["parity_float32"]
    same = all(row["compiled_equals_hf"] and row["eager_equals_hf"] and row["replay_equals_first"]
               for row in p["prompts"]) and p["batched_equals_hf"]
    print(f"bench gpu on {r.get('device_name', r['device'])} (torch {r['torch']}): greedy parity with transformers "
          f"(float32, compiled {p['compiled']}): {same}; CUDA graphs replayed "
          f"{p['compiler']['cuda_graphs_replayed']}, recompiles {p['compiler']['recompiles']}")
    for key in r:
        if key.startswith("bench_"):
            print_dtype_line(r, key.removeprefix("bench_"))


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.step == "prepare":
        prepare(args.assets)
        return {"prepared": str(args.assets)}
    return check(args.assets, args.out, args.device or "cuda", args.new_tokens)
