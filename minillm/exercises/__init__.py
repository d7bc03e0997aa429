"""Self-checking exercises for the notebooks.

Each exercise in a notebook is a function the learner writes, followed by a cell that calls a
check. The check runs the function on a few cases and prints specific feedback: which input
failed, what came back, what was expected and *how* they differ (type, shape, dtype, the largest
difference and where), and — when the wrong answer is a classic mistake — which one. It never
raises, so a notebook with an unfinished exercise still runs top to bottom (and under nbval).

Hints come in tiers: a failing check says how many there are, and calling it again with
``hint=1``, ``hint=2``, ... reveals that many, from a nudge to nearly the answer.

The exercises of notebook NN live in ``minillm.exercises.nbNN`` (their cases are computed from
the package, their classic mistakes are written out, and ``tests/NN_*/test_exercises.py`` feeds each
classic mistake in and checks the message); :func:`check` is the engine they share.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

Case = tuple[tuple[Any, ...], Any]
# A rule looks at how the learner's function computed its answer (it gets the function and one
# case's arguments) and returns what is wrong with it, or None. Rules run after the values pass:
# a right answer computed the forbidden way (copying K for GQA, say) still fails.
Rule = Callable[[Callable[..., Any], tuple[Any, ...]], "str | None"]


@dataclass(frozen=True)
class Mistake:
    """A classic wrong answer: when the learner's result equals ``wrong(*args)``, say ``message``."""

    wrong: Callable[..., Any]
    message: str


def check(
    name: str,
    fn: Callable[..., Any],
    cases: Sequence[Case],
    hint: int | str = 0,
    hints: Sequence[str] = (),
    equal: Callable[[Any, Any], bool] | None = None,
    mistakes: Sequence[Mistake] = (),
    rules: Sequence[Rule] = (),
    atol: float = 1e-5,
) -> bool:
    """Run ``fn(*args)`` for each ``(args, expected)`` case and print what the learner needs.

    ``hint`` is either how many of the tiered ``hints`` to show on failure, or (in the short
    exercises) one hint's text. ``equal`` compares a result with the expected value; the default
    is :func:`same_value` (exact for ints and bools, ``atol`` for floats, type and shape
    first). Returns True when every case passes.
    """
    same = equal or (lambda got, want: same_value(got, want, atol))
    for args, expected in cases:
        call = f"{getattr(fn, '__name__', name)}({', '.join(_short(a) for a in args)})"
        try:
            got = fn(*args)
        except NotImplementedError:
            print(f"⏳ {name}: not attempted yet — replace the `raise NotImplementedError` with your code.")
            return False
        except Exception as err:  # the learner's code may fail in any way; report it, don't crash
            print(f"❌ {name}: {call} raised {type(err).__name__}: {err}")
            _print_hints(name, hint, hints)
            return False
        try:
            ok = same(got, expected)
        except Exception as err:
            ok = False
            print(f"   (comparing the result failed: {type(err).__name__}: {err})")
        if not ok:
            print(f"❌ {name}: {call} returned {_short(got)}, expected {_short(expected)}.")
            try:
                where = describe_difference(got, expected, atol)
            except Exception:  # a learner's object may not even compare; the line above says enough
                where = ""
            if where:
                print(f"   {where}")
            diagnosis = _diagnose(got, args, mistakes, same)
            if diagnosis:
                print(f"   🔎 {diagnosis}")
            _print_hints(name, hint, hints)
            return False
    for rule in rules:
        for args, _ in cases:
            broken = rule(fn, args)
            if broken:
                print(f"❌ {name}: the values are right, but {broken}")
                _print_hints(name, hint, hints)
                return False
    print(f"✅ {name}: all {len(cases)} checks pass.")
    return True


def same_value(got: Any, want: Any, atol: float = 1e-5) -> bool:
    """Equal in type and shape, then in value: exact for ints/bools/strings, ``atol`` for floats."""
    if isinstance(want, torch.Tensor):
        if not isinstance(got, torch.Tensor) or got.shape != want.shape or got.dtype != want.dtype:
            return False
        if want.is_floating_point() or want.is_complex():
            return bool(torch.allclose(got, want, rtol=0.0, atol=atol, equal_nan=True))
        return bool(torch.equal(got, want))
    if isinstance(want, float) and isinstance(got, (int, float)) and not isinstance(got, bool):
        return math.isclose(got, want, rel_tol=0.0, abs_tol=atol) or (math.isnan(got) and math.isnan(want))
    if type(got) is not type(want):
        return False
    if isinstance(want, (list, tuple)):
        return len(got) == len(want) and all(same_value(g, w, atol) for g, w in zip(got, want))
    if isinstance(want, dict):
        return got.keys() == want.keys() and all(same_value(got[k], want[k], atol) for k in want)
    return bool(got == want)


def describe_difference(got: Any, want: Any, atol: float = 1e-5) -> str:
    """One line on how ``got`` differs from ``want``: type, length, shape, dtype or the values."""
    if isinstance(want, torch.Tensor):
        if not isinstance(got, torch.Tensor):
            return f"expected a torch.Tensor, got {_a(type(got).__name__)}"
        if got.shape != want.shape:
            return f"shape {tuple(got.shape)} instead of {tuple(want.shape)}"
        if got.dtype != want.dtype:
            return f"dtype {got.dtype} instead of {want.dtype}"
        return _tensor_values(got, want)
    if type(got) is not type(want) and not (isinstance(want, float) and isinstance(got, int)):
        return f"expected {_a(type(want).__name__)}, got {_a(type(got).__name__)}"
    if isinstance(want, (list, tuple, str)):
        for i, (g, w) in enumerate(zip(got, want)):
            if not same_value(g, w, atol):
                inner = describe_difference(g, w, atol) if isinstance(w, (torch.Tensor, list, tuple)) else ""
                where = f"first difference at index {i}: {_short(g, 60)} instead of {_short(w, 60)}"
                return f"{where} ({inner})" if inner else where
        if len(got) != len(want):
            return f"length {len(got)} instead of {len(want)}"
    if isinstance(want, float):
        return f"off by {abs(got - want):.3g}"
    return ""


def _tensor_values(got: torch.Tensor, want: torch.Tensor) -> str:
    if want.numel() == 0:
        return ""
    if want.is_floating_point():
        diff = (got.double() - want.double()).abs().nan_to_num(nan=math.inf, posinf=math.inf)
        diff = diff.masked_fill(got == want, 0.0)  # equal infinities (two -inf) are no difference
        worst = int(diff.argmax())
        index = tuple(int(i) for i in torch.unravel_index(torch.tensor(worst), want.shape))
        return (
            f"max |difference| {diff.max().item():.3g} at index {index} "
            f"(got {got.flatten()[worst].item():.6g}, expected {want.flatten()[worst].item():.6g}); "
            f"{int((diff > 0).sum())} of {want.numel()} entries differ"
        )
    wrong = (got != want).nonzero()
    first = tuple(int(i) for i in wrong[0])
    return (
        f"{len(wrong)} of {want.numel()} entries differ; the first at index {first}: "
        f"{got[first].item()} instead of {want[first].item()}"
    )


def _diagnose(got: Any, args: tuple[Any, ...], mistakes: Sequence[Mistake], same: Callable[[Any, Any], bool]) -> str:
    """The message of the first classic mistake whose answer the learner's function gave."""
    for mistake in mistakes:
        try:
            if same(got, mistake.wrong(*args)):
                return mistake.message
        except Exception:  # a wrong variant that cannot run on this case says nothing
            continue
    return ""


def _print_hints(name: str, hint: int | str, hints: Sequence[str]) -> None:
    if isinstance(hint, str):
        if hint:
            print(f"   Hint: {hint}")
        return
    shown = min(max(hint, 0), len(hints))
    for tier, text in enumerate(hints[:shown], start=1):
        print(f"   Hint {tier}/{len(hints)}: {text}")
    if shown < len(hints):
        print(f"   Stuck? Run the check again with hint={shown + 1} ({len(hints)} hints in all).")


def _a(noun: str) -> str:
    return f"an {noun}" if noun[0] in "aeiouAEIOU" else f"a {noun}"


def _short(value: Any, limit: int = 120) -> str:
    if isinstance(value, torch.Tensor) and value.numel() > 16:
        return f"tensor(shape={tuple(value.shape)}, dtype={value.dtype})"
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _storages(tree: Any) -> set[int]:
    """The addresses of the storages behind every tensor in ``tree`` (a view shares its base's)."""
    found = set()
    for leaf in tree_flatten(tree)[0]:
        if isinstance(leaf, torch.Tensor):
            try:
                found.add(leaf.untyped_storage().data_ptr())
            except (RuntimeError, NotImplementedError):  # a tensor without storage (sparse, meta...)
                continue
    return found


class _CallRecorder(torch.overrides.TorchFunctionMode):
    """Records every torch function and tensor method called inside it, with the storages of its
    tensor arguments, and names the call in progress (for :class:`_CopyRecorder`)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, set[int]]] = []
        self.current = ""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        name = getattr(func, "__name__", str(func))
        self.calls.append((name, _storages((args, kwargs))))
        outer, self.current = self.current, name
        try:
            return func(*args, **(kwargs or {}))
        finally:
            self.current = outer


# aten ops whose result combines its inputs by a sum of products: scores from q and k are not a copy
# of k, however large. Every other op that reads a watched tensor and writes a new one makes a copy.
_CONTRACTIONS = frozenset({"mm", "bmm", "addmm", "baddbmm", "addbmm", "mv", "addmv", "dot", "vdot"})


@dataclass(frozen=True)
class Copy:
    """The data of a watched argument written out again, ``times`` over: by the aten op ``op``,
    inside the torch call ``call`` the learner made (``matmul`` runs ``expand`` then ``clone``)."""

    what: str
    op: str
    call: str
    times: float


class _CopyRecorder(TorchDispatchMode):
    """Sees the aten ops that actually run — those inside ``matmul`` or ``reshape`` included — and
    records each one that writes a watched tensor's data into a new tensor larger than it. A copy
    of a watched tensor of the same size (``k.float()``, ``k.mT.contiguous()``) is watched in turn."""

    def __init__(self, watched: dict[int, tuple[str, int]], calls: _CallRecorder) -> None:
        super().__init__()
        self.watched = dict(watched)  # storage address -> (name, number of elements)
        self.calls = calls
        self.copies: list[Copy] = []
        self._alive: list[torch.Tensor] = []  # the watched copies, kept so no address is reused

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        op = func.__name__.split(".")[0]
        read = [self.watched[address] for address in _storages((args, kwargs)) if address in self.watched]
        if not read or op in _CONTRACTIONS:
            return out
        outputs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        written = _storages(outputs)
        if written & self.watched.keys():  # a view (expand, transpose, view) or an in-place op
            return out
        what, numel = read[0]
        self.watched.update({address: (what, numel) for address in written})
        self._alive.extend(outputs)
        size = sum(t.numel() for t in outputs)
        if numel and size > numel:
            self.copies.append(Copy(what, op, self.calls.current, size / numel))
        return out


def copies_made(fn: Callable[..., Any], args: tuple[Any, ...], of: dict[int, str]) -> list[Copy]:
    """Run ``fn(*args)`` and return every copy it made of the arguments ``of`` (position -> name).

    A copy is any aten op that writes a watched argument's data (or a same-size copy of it) into a
    new tensor with more elements than the argument: ``repeat_interleave``, ``cat``, an ``expand()``
    made contiguous — including the one ``torch.matmul`` makes when it broadcasts an operand over a
    batch dimension the operand does not have. Views, and products like ``q @ k.mT``, are not copies.
    """
    watched = {}
    for position, name in of.items():
        tensor = args[position]
        watched.update({address: (name, tensor.numel()) for address in _storages(tensor)})
    calls = _CallRecorder()
    with calls, _CopyRecorder(watched, calls) as recorder:
        fn(*args)
    return recorder.copies


def forbid_calls(forbidden: dict[str, str], on: dict[int, str] | None = None) -> Rule:
    """A rule: the learner's function calls none of ``forbidden`` (name -> why not).

    With ``on`` (position of an argument -> its name, ``{1: "K", 2: "V"}``), a call counts only when
    one of its tensor arguments is such an argument or a view of it (the same storage):
    ``k.repeat(...)`` breaks the rule, ``mask.repeat(...)`` does not.
    """

    def rule(fn: Callable[..., Any], args: tuple[Any, ...]) -> str | None:
        watched = {address: name for position, name in (on or {}).items() for address in _storages(args[position])}
        with _CallRecorder() as recorder:
            try:
                fn(*args)
            except Exception:  # the values already passed; a rule only reports what it saw
                return None
        for name, storages in recorder.calls:
            if name not in forbidden:
                continue
            if on is None:
                return f"it calls `{name}`: {forbidden[name]}"
            hit = [watched[address] for address in storages if address in watched]
            if hit:
                return f"it calls `{name}` on {hit[0]}: {forbidden[name]}"
        return None

    return rule


def forbid_copies(of: dict[int, str], why: str) -> Rule:
    """A rule: the learner's function makes no copy (see :func:`copies_made`) of the arguments
    ``of`` (position -> name); ``why`` says what to do instead."""

    def rule(fn: Callable[..., Any], args: tuple[Any, ...]) -> str | None:
        try:
            copies = copies_made(fn, args, of)
        except Exception:  # the values already passed; a rule only reports what it saw
            return None
        if not copies:
            return None
        first = copies[0]
        inside = f"`{first.call}`" if first.call else "an operation"  # `a @ b` is recorded as matmul
        return f"{inside} copied {first.what} into a tensor {first.times:g}× its size (aten.{first.op}): {why}"

    return rule
