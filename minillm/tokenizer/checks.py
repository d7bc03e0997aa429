"""The checks a tokenizer makes on what it is given: its own tables, ids to decode, text to encode.

A hostile file or request reaches these first, so each refusal names the problem and stays short
(a token in a hostile file can be a megabyte long).
"""

from __future__ import annotations

import operator
import reprlib
from collections.abc import Iterable
from typing import Any

from minillm.tokenizer.bytes_unicode import bytes_to_token


def check_ids(vocab: dict[int, bytes], special_tokens: dict[str, int]) -> None:
    """Refuse ids that are out of bounds or that two tokens claim (see ``Tokenizer``)."""
    limit = len(vocab) + len(special_tokens)
    if limit == 0:
        raise ValueError("a tokenizer needs at least one token")
    for i, data in vocab.items():
        if i >= limit:
            raise ValueError(
                f"vocabulary id {i} ({short(bytes_to_token(data))}) is not below {limit}, the number of tokens "
                f"({len(vocab)} in the vocabulary + {len(special_tokens)} special)"
            )
    seen_bytes: dict[bytes, int] = {}
    for i, data in vocab.items():
        if data in seen_bytes:
            raise ValueError(f"vocabulary ids {seen_bytes[data]} and {i} both stand for {short(bytes_to_token(data))}")
        seen_bytes[data] = i
    owner: dict[int, str] = {}
    for content, i in special_tokens.items():
        if not isinstance(content, str) or not content:
            raise ValueError(f"special token {content!r} (id {i}) must be a non-empty str (empty matches anywhere)")
        if i >= limit:
            raise ValueError(
                f"special token {short(content)} has id {i}, which is not below {limit}, the number of tokens "
                f"({len(vocab)} in the vocabulary + {len(special_tokens)} special)"
            )
        if i in owner:
            raise ValueError(f"special tokens {short(owner[i])} and {short(content)} share id {i}")
        owner[i] = content
        if i in vocab and content.encode("utf-8") != vocab[i] and bytes_to_token(vocab[i]) != content:
            taken_by = short(bytes_to_token(vocab[i]))
            raise ValueError(f"special token {short(content)} has id {i}, which the vocabulary gives to {taken_by}")


def short(text: str, limit: int = 60) -> str:
    """``repr(text)``, cut to about ``limit`` characters: a hostile file's token can be a megabyte."""
    return repr(text) if len(text) <= limit else f"{text[:limit]!r}... ({len(text)} characters)"


# reprlib stops at each limit instead of building the whole repr and cutting it: a JSON value from
# a hostile file can be a 10 MB string or a list nested a thousand deep.
_SHORT = reprlib.Repr()
_SHORT.maxstring = _SHORT.maxother = _SHORT.maxlong = 80
_SHORT.maxlevel, _SHORT.maxlist, _SHORT.maxdict, _SHORT.maxtuple = 3, 6, 6, 6


def short_repr(value: Any) -> str:
    """A repr of any value, bounded in length and in the work it takes (for error messages)."""
    if isinstance(value, str):
        return short(value)
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 200:
        return f"<an integer of about {int(value.bit_length() * 0.30103) + 1} digits>"
    return _SHORT.repr(value)


def as_id_list(ids: Any, caller: str = "decode()") -> list[int]:
    """``ids`` as a list of Python ints: a list or tuple of ints, numpy integers or 0-d integer
    tensors, or a numpy array / torch tensor of integers (what a sampler hands back)."""
    if hasattr(ids, "tolist"):  # a torch tensor or numpy array
        ids = ids.tolist()
    if isinstance(ids, (str, bytes)) or not isinstance(ids, Iterable):
        raise TypeError(f"{caller} expects a sequence of int ids, got {type(ids).__name__}")
    out = []
    for i in ids:
        try:  # operator.index accepts exactly the integer types (numpy.int64, an int tensor), not 1.0
            if isinstance(i, bool):
                raise TypeError
            out.append(operator.index(i))
        except TypeError:
            raise TypeError(f"{caller} expects int ids, got {i!r} ({type(i).__name__})") from None
    return out


def lone_surrogate_error(text: str) -> ValueError:
    """The error for text holding a lone surrogate (U+D800..U+DFFF), which has no UTF-8 bytes.

    Python strings can hold one (from ``errors="surrogateescape"``, or a JSON ``"\\ud800"``
    escape without its pair); HF ``tokenizers`` refuses such a str with a TypeError.
    """
    pos = next(i for i, char in enumerate(text) if "\ud800" <= char <= "\udfff")
    return ValueError(
        f"encode(): text[{pos}] is a lone surrogate U+{ord(text[pos]):04X}, which has no UTF-8 encoding "
        f"(the text has {len(text)} characters)"
    )
