"""minillm.exercises.check: specific feedback for the learner, and it never raises."""

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
        (lambda: _Unequal(), None),  # == raises
        (lambda: 1, lambda got, want: 1 / 0),  # the custom comparison raises
        (lambda: [1, 2], lambda got, want: got.shape == want.shape),  # AttributeError in equal
    ],
    ids=["eq-raises", "equal-raises", "equal-attribute-error"],
)
def test_failing_comparison_is_reported_not_raised(capsys, fn, equal):
    assert check("cmp", fn, [((), 1)], equal=equal) is False
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
