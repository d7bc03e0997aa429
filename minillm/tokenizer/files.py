"""Tokenizer files as functions: ``load_tokenizer``, ``save_tokenizer``, ``tokenizer_from_gguf_fields``.

The formats themselves (HF ``tokenizer.json``, GGUF metadata, GPT-2's ``encoder.json`` +
``vocab.bpe``) are read in ``formats`` (and written in ``writer``), which turns a file into the arguments of
``Tokenizer(...)`` and knows nothing of the class. ``Tokenizer.from_file`` and ``Tokenizer.save``
use it; this module, above both, offers the same as plain functions.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from minillm.tokenizer.bpe import Tokenizer
from minillm.tokenizer.gguf_vocab import gguf_tokenizer_file


def load_tokenizer(path: str | Path) -> Tokenizer:
    """Load a tokenizer from a ``tokenizer.json``, a ``.gguf`` file, or a folder holding either
    ``tokenizer.json``, GPT-2's ``encoder.json`` + ``vocab.bpe``, or ``vocab.json`` + ``merges.txt``."""
    return Tokenizer.from_file(path)


def save_tokenizer(tokenizer: Tokenizer, path: str | Path) -> None:
    """Write ``tokenizer.json`` (loadable by HF ``tokenizers``) and ``tokenizer_config.json`` beside it."""
    tokenizer.save(path)


def tokenizer_from_gguf_fields(path: Path, fields: dict[str, Any]) -> Tokenizer:
    """Build the tokenizer stored in GGUF metadata (keys ``tokenizer.ggml.*``) already read from ``path``."""
    return gguf_tokenizer_file(path, fields).build(Tokenizer)
