"""Hostile tokenizer files and the checks on refusing them, shared by the tokenizer tests.

A test breaks one field of a good ``tokenizer.json`` (``write_spec``), loads it, and checks the
refusal (``refuses``): a ``FileFormatError`` naming the file and every fragment asked for.
``cheaply`` and ``fails_cheaply`` check the cost of a refusal: the memory Python allocated on the way (traced by
``tracemalloc``, which sees the ``regex`` engine's allocations too) and the time, a generous bound
(the refusals take milliseconds; what they stop took seconds and gigabytes).
"""

from __future__ import annotations

import copy
import json
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from minillm import FileFormatError, Tokenizer

# What one hostile case may allocate before it is refused.
MAX_BYTES = 200 << 20


def write_spec(folder: Path, spec: dict, **changes: Any) -> Path:
    """``spec`` with ``a__b=value`` setting ``spec["a"]["b"]``, written to ``folder/tokenizer.json``."""
    spec = copy.deepcopy(spec)
    for key, value in changes.items():
        target = spec
        *parents, last = key.split("__")
        for parent in parents:
            target = target[parent]
        target[last] = value
    path = folder / "tokenizer.json"
    path.write_text(json.dumps(spec), encoding="utf-8")
    return path


def split_spec(spec: dict, pattern: str, **split_options: Any) -> dict:
    """``spec`` pre-tokenized by a ``Split`` on ``pattern`` (then byte-level, without its own regex)."""
    step = {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": False, **split_options}
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}
    return {**spec, "pre_tokenizer": {"type": "Sequence", "pretokenizers": [step, byte_level]}}


def added(content: str, token_id: int, **flags: Any) -> dict:
    """An ``added_tokens`` entry."""
    entry = {"id": token_id, "content": content, "single_word": False, "lstrip": False, "rstrip": False}
    return {**entry, "normalized": False, "special": True, **flags}


def refuses(path: Path, *fragments: str) -> str:
    """Loading ``path`` is a FileFormatError whose message names the file and every fragment."""
    with pytest.raises(FileFormatError) as err:
        Tokenizer.from_file(path)
    message = str(err.value)
    for fragment in [str(path), *fragments]:
        assert fragment in message, f"{fragment!r} not in {message!r}"
    return message


def cheaply(action: Callable[[], Any], max_bytes: int = MAX_BYTES) -> Any:
    """``action()`` (which checks its own outcome, e.g. ``refuses``), asserted to allocate at most
    ``max_bytes`` at the peak: a refusal comes before the work. Wall time is not asserted (it
    depends on the machine and its load); the measured times are in the closing notes and
    docs. Returns what ``action`` returns."""
    tracemalloc.start()
    try:
        result = action()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < max_bytes, f"allocated {peak >> 20} MB: {result}"
    return result


def fails_cheaply(action: Callable[[], Any], error: type[BaseException] = ValueError, *fragments: str,
                  max_bytes: int = MAX_BYTES) -> str:
    """``action()`` raises ``error`` with every fragment in its (short) message, ``cheaply``."""

    def check() -> str:
        with pytest.raises(error) as caught:
            action()
        message = str(caught.value)
        for fragment in fragments:
            assert fragment in message, f"{fragment!r} not in {message!r}"
        assert len(message) < 2000, f"a message of {len(message)} characters"
        return message

    return cheaply(check, max_bytes)
