"""The command line: ``python -m minillm {demo,bench}``."""

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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="minillm", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("demo", help="run the end-to-end demo")
    bench = commands.add_parser("bench", help="benchmarks against the reference libraries")
    bench.add_argument("target", choices=["tokenizer"])
    bench.add_argument("--json", action="store_true", help="print the results as one JSON object")
    args = parser.parse_args(argv)

    try:
        if args.command == "demo":
            demo()
        elif args.command == "bench":
            from minillm.bench import bench_tokenizer, print_tokenizer_report

            results = bench_tokenizer()
            if args.json:
                print(json.dumps(results))
            else:
                print_tokenizer_report(results)
    except (FileNotFoundError, ValueError, TypeError) as err:
        print(f"minillm: error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
