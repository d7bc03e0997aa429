"""``bench quant``: each weight format of the default model (float32, the GGUF's own blocks,
q8_0, q4_0), and llama.cpp on the same file when installed: bytes, speed, and quality."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch.utils.benchmark import timer

from minillm.assets import corpus_path, default_gguf_path
from minillm.bench.timing import BANDWIDTH_BYTES, bandwidth_reader, interleaved_best
from minillm.bench.workloads import DECODE_PROMPT_TOKENS, corpus_prompt
from minillm.tokenizer import Tokenizer

if TYPE_CHECKING:
    import torch

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


def _llama_cpp_timed(llm: Any, prompt: list[int], short: list[int],
                     new_tokens: int) -> tuple[Callable[[], list[int]], Callable[[], None]]:
    """llama.cpp's greedy decode from ``short`` and its prefill of ``prompt``, as functions to time."""
    import numpy as np

    n_vocab = llm.n_vocab()

    def decode() -> list[int]:
        llm.reset()
        llm.eval(short)
        out = []
        for _ in range(new_tokens):
            logits = np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(n_vocab,))
            out.append(int(logits.argmax()))
            llm.eval(out[-1:])
        return out

    def prefill() -> None:
        llm.reset()
        llm.eval(prompt)

    return decode, prefill


def _llama_cpp_logits(path: Path, threads: int, windows: list[list[int]]) -> torch.Tensor:
    """llama.cpp's logits at every position of each window but its last token."""
    import numpy as np
    import torch

    scorer = _llama_cpp(path, threads, logits_all=True)
    rows = []
    for w in windows:
        scorer.reset()
        scorer.eval(w[:-1])
        rows.append(torch.from_numpy(np.array(scorer.scores[: len(w) - 1], dtype=np.float32)))
    return torch.cat(rows)


def run(args: argparse.Namespace) -> dict[str, Any]:
    return bench_quant()


def bench_quant(new_tokens: int = 128, prompt_tokens: int = 256, quality_windows: int = 4, window: int = 256,
                repeats: int = 3, formats: tuple[str, ...] = QUANT_FORMATS) -> dict[str, Any]:
    """Each weight format of the default model, CPU, batch 1, in one run: bytes in memory and read
    per decode token, decode and prefill tok/s (interleaved rounds, best of each), the fraction of
    the bandwidth roofline, and quality on held-out text against float32 (KL, top-1, perplexity);
    with llama.cpp on the same GGUF and the same thread count when llama-cpp-python is installed.
    """
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
        start = timer()
        tokens[fmt] = engine.generate([short], params)[0].token_ids  # compiles this format's step
        r["formats"][fmt] = {"bytes": weight_bytes(engine.model), "first_call_s": timer() - start}

    decoders: dict[str, Callable[[], Any]] = {fmt: (lambda e=engine: e.generate([short], params))
                                              for fmt, engine in engines.items()}
    x = torch.tensor([prompt])
    prefills: dict[str, Callable[[], Any]] = {fmt: (lambda m=model: m(x, last_only=True))
                                              for fmt, (model, _) in models.items()}
    llm = _llama_cpp(path, threads, logits_all=False)
    if llm is not None:
        decoders["llama.cpp"], prefills["llama.cpp"] = _llama_cpp_timed(llm, prompt, short, new_tokens)
        tokens["llama.cpp"] = decoders["llama.cpp"]()
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
        del llm, decoders["llama.cpp"], prefills["llama.cpp"]  # one llama.cpp context at a time
        logits["llama.cpp"] = _llama_cpp_logits(path, threads, windows)
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
