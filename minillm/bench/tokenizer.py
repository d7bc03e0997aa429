"""``bench tokenizer``: BPE training and encoding, minillm against HF ``tokenizers``."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from minillm.assets import corpus_path, default_gguf_path, gpt2_vocab_dir
from minillm.bench.timing import best_time
from minillm.tokenizer import Tokenizer, train_bpe


def run(args: argparse.Namespace) -> dict[str, Any]:
    return bench_tokenizer()


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
