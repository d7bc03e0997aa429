"""The command line: ``python -m minillm {generate,demo,bench}``.

Only results go to stdout (completions, JSON rows, benchmark tables); progress and
diagnostics go to stderr, so the output can be piped.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from minillm.assets import corpus_path, default_gguf_path


def demo() -> None:
    """The most complete thing minillm does so far: train a tokenizer, then stream with SmolLM2's."""
    from minillm.tokenizer import Tokenizer, train_bpe

    corpus = corpus_path()
    text = corpus.read_text(encoding="utf-8")
    print(f"[1/2] Training a 1024-token byte-level BPE on {corpus.name} ({len(text) / 1e6:.2f} MB)")
    start = time.perf_counter()
    ours = train_bpe(text, 1024, special_tokens=["<|endoftext|>"])
    print(f"      {len(ours.merges)} merges in {time.perf_counter() - start:.1f} s; the first ten:")
    print("      " + "  ".join(repr(ours.id_to_token(256 + i)) for i in range(10)))
    line = "To be, or not to be, that is the question."
    ids = ours.encode(line)
    print(f"      {line!r} -> {len(ids)} tokens: {[ours.id_to_token(i) for i in ids]}")

    print("[2/2] SmolLM2-135M-Instruct's tokenizer, read from its GGUF file")
    smol = Tokenizer.from_file(default_gguf_path())
    sentence = "Streaming detokenization never splits a character: 苹果手机很好用 👋🏽"
    ids = smol.encode(sentence)
    print(f"      {len(ids)} ids: {ids}")
    print("      streamed back, one push per id ('|' between non-empty pieces):")
    stream = smol.streaming_decoder()
    pieces = [stream.push(i) for i in ids] + [stream.flush()]
    print("      " + "|".join(p for p in pieces if p))
    held = sum(1 for p in pieces[:-1] if not p)
    print(f"      {held} pushes completed no character yet and returned ''; joined == decode(ids): "
          f"{''.join(pieces) == smol.decode(ids)}")


def generate(args: argparse.Namespace) -> None:
    import torch

    from minillm.generate import generate_greedy
    from minillm.model import load_model

    start = time.perf_counter()
    model, tok = load_model(args.model, device=args.device)
    print(f"minillm: loaded {args.model or 'SmolLM2-135M-Instruct'} on {model.device} "
          f"in {time.perf_counter() - start:.1f} s", file=sys.stderr)
    prompts = [tok.encode(p) for p in args.prompt]
    start = time.perf_counter()
    with torch.inference_mode():
        outputs = generate_greedy(
            model, prompts, args.max_new_tokens, tok.eos_id, cache=args.cache, block_size=args.block_size,
            pad_id=tok.pad_id or 0,
        )
    elapsed = time.perf_counter() - start
    n_tokens = sum(len(o) for o in outputs)
    print(f"minillm: {n_tokens} tokens in {elapsed:.2f} s ({n_tokens / elapsed:.1f} tokens/s, cache={args.cache})",
          file=sys.stderr)
    for prompt, ids in zip(args.prompt, outputs):
        text = tok.decode(ids, skip_special_tokens=True)
        if args.json:
            print(json.dumps({"prompt": prompt, "text": text, "token_ids": ids}, ensure_ascii=False))
        else:
            print(text)


def _positive(value: str) -> int:
    number = int(value)
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {number}")
    return number


def _non_negative(value: str) -> int:
    number = int(value)
    if number < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {number}")
    return number


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="minillm", description="An LLM inference engine built from scratch.")
    commands = parser.add_subparsers(dest="command", required=True)

    gen = commands.add_parser("generate", help="complete prompts with a real model (greedy)")
    gen.add_argument("--prompt", action="append", required=True, help="a prompt; repeat for a batch")
    gen.add_argument("--model", default=None, help="a .gguf file or HF checkpoint folder (default: SmolLM2-135M-Instruct)")
    gen.add_argument("--max-new-tokens", type=_non_negative, default=64)
    gen.add_argument("--cache", choices=["none", "contiguous", "paged"], default="paged")
    gen.add_argument("--block-size", type=_positive, default=16, help="tokens per KV block (paged cache)")
    gen.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda if available)")
    gen.add_argument("--json", action="store_true", help="one JSON object per completion, in prompt order")

    commands.add_parser("demo", help="run the end-to-end demo")
    bench = commands.add_parser("bench", help="benchmarks against the reference libraries")
    bench.add_argument("target", choices=["tokenizer"])
    bench.add_argument("--json", action="store_true", help="print the results as one JSON object")
    args = parser.parse_args(argv)

    try:
        if args.command == "generate":
            generate(args)
        elif args.command == "demo":
            demo()
        elif args.command == "bench":
            from minillm.bench import bench_tokenizer, print_tokenizer_report

            results = bench_tokenizer()
            if args.json:
                print(json.dumps(results))
            else:
                print_tokenizer_report(results)
    except (FileNotFoundError, ValueError, TypeError, MemoryError, RuntimeError) as err:
        print(f"minillm: error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
