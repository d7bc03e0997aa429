"""minillm.exercises.check: specific feedback for the learner, and it never raises (the engine
every notebook's exercises use; each notebook's own checks are tested in its folder)."""

from __future__ import annotations

import functools

import pytest

from minillm.exercises import check

CASES = [((1, 1), 2), ((2, 3), 5), ((10, -4), 6)]


def add(a, b):
    return a + b


def test_correct_function_gets_a_tick(capsys):
    assert check("add", add, CASES) is True
    out = capsys.readouterr().out
    assert out.startswith("✅ add")
    assert "3" in out  # how many checks passed
    assert "❌" not in out and "⏳" not in out


def test_not_implemented_stub_is_waiting_not_failed(capsys):
    def add(a, b):
        raise NotImplementedError

    assert check("add", add, CASES, hint="use +") is False
    out = capsys.readouterr().out
    assert "⏳ add" in out
    assert "❌" not in out and "✅" not in out


def test_wrong_function_shows_the_failing_call_got_expected_and_hint(capsys):
    def add(a, b):
        return a * b  # right for (2, 2) only by luck; wrong for (1, 1) -> 1

    assert check("add", add, [((2, 2), 4), ((1, 1), 2)], hint="add, don't multiply") is False
    out = capsys.readouterr().out
    assert "❌ add" in out
    assert "add(1, 1)" in out  # the failing call, not the first case
    assert "returned 1" in out and "expected 2" in out
    assert "Hint: add, don't multiply" in out
    assert "✅" not in out


def test_exception_in_the_function_is_reported_with_the_call(capsys):
    def divide(a, b):
        return a / b

    assert check("divide", divide, [((1, 0), None)], hint="b may be 0") is False
    out = capsys.readouterr().out
    assert "❌ divide" in out
    assert "divide(1, 0)" in out
    assert "ZeroDivisionError" in out
    assert "Hint: b may be 0" in out


class LearnerBug(Exception):
    pass


def _raise_learner_bug(a, b):
    raise LearnerBug("my own error")


@pytest.mark.parametrize(
    "fn, error_name",
    [
        (lambda a, b: {}[a], "KeyError"),
        (lambda a: a, "TypeError"),  # wrong number of arguments
        (lambda a, b: [][b], "IndexError"),
        (_raise_learner_bug, "LearnerBug"),
        (lambda a, b: int("x"), "ValueError"),
    ],
    ids=["KeyError", "wrong-arity", "IndexError", "custom", "ValueError"],
)
def test_any_exception_is_reported_never_raised(capsys, fn, error_name):
    assert check("ex", fn, [((1, 2), 3)]) is False
    out = capsys.readouterr().out
    assert out.startswith("❌ ex")
    assert error_name in out


def test_long_values_are_shortened(capsys):
    check("big", lambda: "x" * 500, [((), "y")])
    out = capsys.readouterr().out
    assert "❌ big" in out
    assert "x" * 500 not in out and "..." in out


class _Unequal:
    def __eq__(self, other):
        raise RuntimeError("cannot compare")

    def __repr__(self):
        return "_Unequal()"


@pytest.mark.parametrize(
    "fn, equal",
    [
        (lambda: _Unequal(), None),  # == raises (against another _Unequal, so the types agree)
        (lambda: 1, lambda got, want: 1 / 0),  # the custom comparison raises
        (lambda: [1, 2], lambda got, want: got.shape == want.shape),  # AttributeError in equal
    ],
    ids=["eq-raises", "equal-raises", "equal-attribute-error"],
)
def test_failing_comparison_is_reported_not_raised(capsys, fn, equal):
    expected = _Unequal() if equal is None else 1
    assert check("cmp", fn, [((), expected)], equal=equal) is False
    out = capsys.readouterr().out
    assert "❌ cmp" in out
    assert "comparing the result failed" in out


def test_custom_equal_is_used(capsys):
    close = lambda got, want: abs(got - want) < 1e-6  # noqa: E731
    assert check("third", lambda: 1 / 3, [((), 0.3333333333)], equal=close) is True
    assert "✅ third" in capsys.readouterr().out


def test_callable_without_a_name_uses_the_exercise_name(capsys):
    wrong = functools.partial(lambda a, b: a - b)
    assert check("add", wrong, [((1, 1), 2)]) is False
    out = capsys.readouterr().out
    assert "add(1, 1)" in out


def test_stops_at_the_first_failure(capsys):
    calls = []

    def add(a, b):
        calls.append((a, b))
        return 0

    check("add", add, CASES)
    assert calls == [(1, 1)]
    assert capsys.readouterr().out.count("❌") == 1


# --- the shared engine: tiers, tensors, classic mistakes, rules ---------------------------------

import torch  # noqa: E402

from minillm.exercises import Mistake, copies_made, forbid_calls, forbid_copies  # noqa: E402


def test_hints_reveal_in_tiers(capsys):
    hints = ["first nudge", "second nudge", "nearly the answer"]
    check("add", lambda a, b: 0, CASES, hints=hints)
    out = capsys.readouterr().out
    assert "nudge" not in out and "hint=1 (3 hints in all)" in out
    check("add", lambda a, b: 0, CASES, hint=2, hints=hints)
    out = capsys.readouterr().out
    assert "Hint 1/3: first nudge" in out and "Hint 2/3: second nudge" in out
    assert "nearly" not in out and "hint=3" in out
    check("add", lambda a, b: 0, CASES, hint=9, hints=hints)
    out = capsys.readouterr().out
    assert "Hint 3/3: nearly the answer" in out and "Stuck?" not in out


@pytest.mark.parametrize(
    "got, want, says",
    [
        ([1, 2], (1, 2), "expected a tuple, got a list"),
        (torch.zeros(2, 3), torch.zeros(3, 2), "shape (2, 3) instead of (3, 2)"),
        (torch.zeros(2, dtype=torch.float64), torch.zeros(2), "dtype torch.float64 instead of torch.float32"),
        (torch.tensor([1.0, 2.5, 3.0]), torch.tensor([1.0, 2.0, 3.0]), "max |difference| 0.5 at index (1,)"),
        (torch.tensor([[True, False], [True, True]]), torch.ones(2, 2, dtype=torch.bool), "1 of 4 entries differ; the first at index (0, 1)"),
        (2, 2.5, "off by 0.5"),
        ([1, 2, 4], [1, 2, 3], "first difference at index 2: 4 instead of 3"),
    ],
    ids=["tuple-vs-list", "shape", "dtype", "float-values", "bool-values", "float", "list"],
)
def test_the_difference_is_described(capsys, got, want, says):
    assert check("f", lambda: got, [((), want)]) is False
    assert says in capsys.readouterr().out


def test_floats_compare_within_atol_and_ints_exactly(capsys):
    assert check("f", lambda: torch.tensor([1.0 + 1e-7]), [((), torch.tensor([1.0]))]) is True
    assert check("f", lambda: torch.tensor([2]), [((), torch.tensor([1]))]) is False


def test_a_classic_mistake_is_named(capsys):
    mistakes = [Mistake(lambda a, b: a - b, "you subtracted"), Mistake(lambda a, b: a * b, "you multiplied")]
    check("add", lambda a, b: a * b, [((2, 3), 5)], mistakes=mistakes)
    out = capsys.readouterr().out
    assert "🔎 you multiplied" in out and "subtracted" not in out


def test_a_rule_fails_a_right_answer_computed_the_forbidden_way(capsys):
    rule = forbid_calls({"repeat_interleave": "no copies"})
    x = torch.arange(3)
    assert check("r", lambda t: t.repeat_interleave(2), [((x,), torch.tensor([0, 0, 1, 1, 2, 2]))], rules=[rule]) is False
    assert "values are right, but it calls `repeat_interleave`: no copies" in capsys.readouterr().out


def test_a_call_rule_on_one_argument_ignores_the_others(capsys):
    rule = forbid_calls({"repeat": "no copies of t"}, on={0: "t"})
    t, u = torch.arange(3), torch.ones(2)
    cases = [((t, u), torch.tensor([0.0, 2.0, 4.0, 0.0, 2.0, 4.0]))]
    assert check("r", lambda t, u: (t * 2).repeat(2) * u.repeat(3), cases, rules=[rule]) is True  # t * 2 is new
    assert check("r", lambda t, u: t.repeat(2) * 2 * u.repeat(3), cases, rules=[rule]) is False
    assert "it calls `repeat` on t: no copies of t" in capsys.readouterr().out


@pytest.mark.parametrize(
    "fn, copies",
    [
        (lambda t: t[:, None].expand(3, 2).flatten(), True),  # materialising an expand() copies
        (lambda t: t.double()[:, None].expand(3, 2).reshape(6), True),  # a copy of a copy is followed
        (lambda t: torch.cat([t, t]), True),
        (lambda t: t[:, None].expand(3, 2).transpose(0, 1), False),  # views only
        (lambda t: t.double() * 2, False),  # a same-size result is not a copy of t over and over
    ],
    ids=["expand-flatten", "through-a-cast", "cat", "views", "same-size"],
)
def test_a_copy_rule_sees_the_aten_ops(capsys, fn, copies):
    rule = forbid_copies({0: "t"}, "keep it a view")
    assert (rule(fn, (torch.arange(3.0),)) is not None) is copies


def test_a_broadcast_matmul_copies_its_operand_and_a_batched_one_does_not():
    q, k = torch.randn(2, 3, 4, 5, 8), torch.randn(2, 3, 7, 8)
    broadcast = copies_made(lambda q, k: q @ k[:, :, None].transpose(-2, -1), (q, k), {1: "K"})
    # `@` is recorded as torch.matmul; inside it aten.clone copies k, expanded over the group of 4
    assert [(c.what, c.op, c.call, c.times) for c in broadcast] == [("K", "clone", "matmul", 4.0)]
    assert copies_made(lambda q, k: q.reshape(2, 3, 20, 8) @ k.transpose(-2, -1), (q, k), {1: "K"}) == []


def test_every_copy_is_counted_even_where_freed_memory_is_reused():
    k, v = torch.randn(1, 3, 64, 8), torch.randn(1, 3, 64, 8)

    def two_copies(k, v):
        torch.cat([k, k]).sum()  # freed at once: the next copy may land at the same address
        return torch.cat([v, v])

    assert [(c.what, c.times) for c in copies_made(two_copies, (k, v), {0: "K", 1: "V"})] == [("K", 2.0), ("V", 2.0)]
