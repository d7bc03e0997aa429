"""Self-checking exercises for the notebooks.

Each exercise in a notebook is a function the learner writes, followed by a cell that calls
:func:`check`. The check runs the function on a few cases and prints specific feedback: which
input failed, what came back, what was expected, and a hint. It never raises, so a notebook
with an unfinished exercise still runs top to bottom (and under nbval).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

Case = tuple[tuple[Any, ...], Any]


def check(
    name: str,
    fn: Callable[..., Any],
    cases: Sequence[Case],
    hint: str = "",
    equal: Callable[[Any, Any], bool] | None = None,
) -> bool:
    """Run ``fn(*args)`` for each ``(args, expected)`` case and print what the learner needs.

    ``equal`` compares a result with the expected value (default ``==``; pass e.g.
    ``torch.allclose`` for tensors). Returns True when every case passes.
    """
    same = equal or (lambda got, want: bool(got == want))
    for args, expected in cases:
        call = f"{getattr(fn, '__name__', name)}({', '.join(_short(a) for a in args)})"
        try:
            got = fn(*args)
        except NotImplementedError:
            print(f"⏳ {name}: not attempted yet — replace the `raise NotImplementedError` with your code.")
            return False
        except Exception as err:  # the learner's code may fail in any way; report it, don't crash
            print(f"❌ {name}: {call} raised {type(err).__name__}: {err}")
            _print_hint(hint)
            return False
        try:
            ok = same(got, expected)
        except Exception as err:
            ok = False
            print(f"   (comparing the result failed: {type(err).__name__}: {err})")
        if not ok:
            print(f"❌ {name}: {call} returned {_short(got)}, expected {_short(expected)}.")
            where = _first_difference(got, expected)
            if where:
                print(f"   {where}")
            _print_hint(hint)
            return False
    print(f"✅ {name}: all {len(cases)} checks pass.")
    return True


def _print_hint(hint: str) -> None:
    if hint:
        print(f"   Hint: {hint}")


def _first_difference(got: Any, expected: Any) -> str:
    """For two sequences, where they first differ (long values are cut in the message above)."""
    if not isinstance(got, (list, tuple, str)) or not isinstance(expected, (list, tuple, str)):
        return ""
    for i, (a, b) in enumerate(zip(got, expected)):
        if a != b:
            return f"first difference at index {i}: {a!r} instead of {b!r}"
    if len(got) != len(expected):
        return f"lengths differ: {len(got)} instead of {len(expected)}"
    return ""


def _short(value: Any, limit: int = 120) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
