"""GPT-2's byte <-> unicode map.

Byte-level BPE works on raw UTF-8 bytes, so any string can be encoded and nothing is ever
"unknown". But vocabulary files (``encoder.json``, ``tokenizer.json``, GGUF) store tokens as
*printable strings*. GPT-2 therefore maps each of the 256 bytes to a visible unicode character:
printable ASCII and Latin-1 bytes map to themselves, the remaining 68 (control bytes, space,
...) are shifted to code points 256 and up. That is why a space shows up as ``Ġ`` (U+0120) and
a newline as ``Ċ`` (U+010A) in every GPT-2-style vocabulary.
"""

from __future__ import annotations

import re
from functools import cache


@cache
def bytes_to_unicode() -> dict[int, str]:
    """The map from each byte value (0..255) to the printable character that stands for it."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    byte_to_char = {b: chr(b) for b in printable}
    shift = 0
    for b in range(256):
        if b not in byte_to_char:
            byte_to_char[b] = chr(256 + shift)
            shift += 1
    return byte_to_char


@cache
def unicode_to_bytes() -> dict[str, int]:
    """The inverse map: printable character -> byte value."""
    return {char: b for b, char in bytes_to_unicode().items()}


def token_to_bytes(token: str) -> bytes:
    """Turn a vocabulary string such as ``'Ġthe'`` back into the bytes it stands for (``b' the'``)."""
    outside = _outside_the_map().search(token)
    if outside is not None:
        shown = repr(token) if len(token) <= 60 else f"{token[:60]!r}... ({len(token)} characters)"
        raise ValueError(f"token {shown} contains {outside.group()!r}, which is not in GPT-2's byte<->unicode map")
    # Each character becomes the character of its byte's value, and latin-1 maps those to the bytes.
    return token.translate(_char_to_byte_table()).encode("latin-1")


@cache
def _char_to_byte_table() -> dict[int, int]:
    return {ord(char): b for char, b in unicode_to_bytes().items()}


@cache
def _outside_the_map() -> re.Pattern[str]:
    return re.compile("[^" + "".join(map(re.escape, unicode_to_bytes())) + "]")


def bytes_to_token(data: bytes) -> str:
    """Turn raw bytes into their printable vocabulary string (``b' the'`` -> ``'Ġthe'``)."""
    byte_to_char = bytes_to_unicode()
    return "".join(byte_to_char[b] for b in data)
