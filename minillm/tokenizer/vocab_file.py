"""What every tokenizer file format holds, and the checks all of them share.

A file (``tokenizer.json``, GGUF metadata, GPT-2's ``encoder.json`` + ``vocab.bpe``) becomes a
``TokenizerFile``: the keyword arguments of ``Tokenizer(...)`` and the path named in errors. Each
format writes its vocabulary as token string -> id and its merges as pairs of token strings;
turning those into ids is the same everywhere, and so is refusing a hostile one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from minillm.errors import FileFormatError
from minillm.tokenizer.bytes_unicode import token_to_bytes
from minillm.tokenizer.checks import short, short_repr

T = TypeVar("T")


@dataclass(frozen=True)
class TokenizerFile:
    """What a tokenizer file holds: the keyword arguments of ``Tokenizer(...)``, and the file they
    came from (named in errors)."""

    path: Path
    arguments: dict[str, Any]

    def build(self, cls: Callable[..., T]) -> T:
        """``cls(**arguments)``; a consistency problem (a ValueError) becomes an error naming the file."""
        try:
            return cls(**self.arguments)
        except ValueError as err:
            raise FileFormatError(f"{self.path}: {err}") from None


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)



def vocab_from_strings(path: Path, token_to_id: Any, special: dict[str, int], field: str) -> dict[int, bytes]:
    """id -> bytes of a vocabulary written as token string -> id (``field`` names it in errors).

    The ids must be 0 .. len - 1: HF tokenizers numbers added tokens from ``len(vocab)``, so a
    vocabulary with holes would collide with them, and minillm's id table is a list.
    """
    if not isinstance(token_to_id, dict):
        raise FileFormatError(f"{path}: {field} must map token strings to ids, got a {type(token_to_id).__name__}")
    check_vocab_ids(path, token_to_id, field)
    vocab: dict[int, bytes] = {}
    for token, i in token_to_id.items():
        if i >= len(token_to_id):
            raise FileFormatError(
                f"{path}: {field}: token {short(token)} has id {i}, but the vocabulary has {len(token_to_id)} entries "
                f"(ids must be 0..{len(token_to_id) - 1})"
            )
        if i in vocab:
            raise FileFormatError(f"{path}: {field}: id {i} is given to two tokens (one is {short(token)})")
        try:
            vocab[i] = token_to_bytes(token)
        except ValueError as err:
            if token in special:  # e.g. a special token written with non-byte-level characters
                continue
            raise FileFormatError(f"{path}: {field}: {err}") from None
    return vocab


def check_vocab_ids(path: Path, token_to_id: dict[str, Any], field: str) -> None:
    """Refuse an id that is not a non-negative int (a float, a string, ``<an integer of 100000 digits>``)."""
    for token, i in token_to_id.items():
        if not is_int(i) or i < 0:
            raise FileFormatError(f"{path}: {field}: the id of token {short(token)} is {short_repr(i)}, not a non-negative int")


def merges_from_strings(
    path: Path, lines: Any, token_to_id: dict[str, int], field: str | None = None
) -> list[tuple[int, int]]:
    """id pairs of merges written as ``"a b"`` strings or ``["a", "b"]`` pairs; ``field`` (a JSON
    path or GGUF key) names the list in errors, which always give the merge's number too."""
    if not isinstance(lines, list):
        raise FileFormatError(f"{path}: {field or 'merges'} must be a list, got a {type(lines).__name__}")
    merges: list[tuple[int, int]] = []
    for n, line in enumerate(lines):
        where = f"{field}[{n}] (merge #{n})" if field else f"merge #{n}"
        parts = line.split(" ") if isinstance(line, str) else line
        if not isinstance(parts, list) or len(parts) != 2 or not all(isinstance(part, str) for part in parts):
            raise FileFormatError(f"{path}: {where} {short_repr(line)} is not a pair of tokens")
        a, b = parts
        if a not in token_to_id or b not in token_to_id:
            raise FileFormatError(f"{path}: {where} {short_repr(line)} uses a token that is not in the vocabulary")
        merges.append((token_to_id[a], token_to_id[b]))
    return merges
