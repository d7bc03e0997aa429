"""Fixtures of the serving tests: the tiny random model in float64 that the prefix cache's and
chunked prefill's tests share (a reused block and a freshly computed one agree to ~1e-12 there)."""

from __future__ import annotations

import pytest

from helpers.checkpoints import tiny_hf_checkpoint


@pytest.fixture(scope="module")
def tiny64(tmp_path_factory, tiny_tokenizer):
    """A tiny random Llama (its vocabulary the tokenizer's, so every sampled id decodes), in float64."""
    import minillm

    folder = tiny_hf_checkpoint(tmp_path_factory.mktemp("tiny") / "ckpt", tiny_tokenizer, "llama",
                                vocab_size=tiny_tokenizer.vocab_size)
    return minillm.load_model(folder, device="cpu", dtype="float64")
