"""The reference implementations minillm is checked against (HF ``tokenizers``/``transformers``).

These are test and benchmark dependencies (``pip install -e .[dev]``), imported only when a
function here is called. Each reference is built *independently* of minillm's own loaders, so
a parity check compares two separate readings of the same files.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache, partial
from pathlib import Path
from typing import Any

from minillm.assets import default_gguf_path, gpt2_vocab_dir


def hf_gpt2_tokenizer(folder: Path | None = None) -> Any:
    """GPT-2 as HF ``tokenizers`` builds it from ``encoder.json`` + ``vocab.bpe``."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    folder = folder or gpt2_vocab_dir()
    tok = Tokenizer(models.BPE.from_file(str(folder / "encoder.json"), str(folder / "vocab.bpe")))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken("<|endoftext|>", special=True)])
    return tok


@cache
def hf_gguf_tokenizer(gguf_path: Path | None = None) -> Any:
    """The transformers tokenizer read from a GGUF file (offline), e.g. SmolLM2's."""
    from transformers import AutoTokenizer

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    path = gguf_path or default_gguf_path()
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


@contextmanager
def _no_progress_bars() -> Iterator[None]:
    """Loading without transformers' progress bars. In a notebook each bar is a widget, and its
    state stays in the saved notebook's metadata long after the bar is gone."""
    import transformers.modeling_gguf_pytorch_utils as gguf_loader
    from tqdm import tqdm
    from transformers.utils import logging

    was_on = logging.is_progress_bar_enabled()
    logging.disable_progress_bar()  # transformers' own switch, for the bars drawn through it
    converter_bar = gguf_loader.tqdm
    # the GGUF converter calls tqdm.auto directly, past that switch: a silent bar for the load
    gguf_loader.tqdm = partial(tqdm, disable=True)
    try:
        yield
    finally:
        gguf_loader.tqdm = converter_bar
        if was_on:
            logging.enable_progress_bar()


@cache
def hf_gguf_model(gguf_path: Path | None = None) -> Any:
    """transformers' own model read from the same GGUF file (float32, CPU, eval mode)."""
    import torch
    from transformers import AutoModelForCausalLM

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    path = gguf_path or default_gguf_path()
    with _no_progress_bars():
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    return model.eval()


def hf_causal_lm(source: Path | None = None) -> Any:
    """A fresh (uncached) transformers model for a GGUF file or an HF checkpoint folder
    (float32, CPU, eval mode); None means the default GGUF. Benchmarks cast their own copy."""
    import torch
    from transformers import AutoModelForCausalLM

    if source is None or source.suffix == ".gguf":
        return hf_gguf_model.__wrapped__(source)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    with _no_progress_bars():
        return AutoModelForCausalLM.from_pretrained(str(source), dtype=torch.float32).eval()
