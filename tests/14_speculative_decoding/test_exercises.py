"""Notebook 14's exercises: the solutions pass, every classic mistake fails with the message naming it,
and an unfinished stub reports ⏳ without raising."""

from __future__ import annotations

import pytest
import torch

from minillm.exercises import nb14, nb14_mistakes as wrong
from minillm.sampling.speculative import verify_greedy

CHECKS = {
    "residual": (nb14.check_residual, nb14.residual_solution, nb14.RESIDUAL_MISTAKES),
    "greedy": (nb14.check_verify_greedy, nb14.verify_greedy_solution, nb14.GREEDY_MISTAKES),
    "expected": (nb14.check_expected_tokens, nb14.expected_tokens_solution, nb14.EXPECTED_MISTAKES),
}

NAMED = [
    ("residual", wrong.residual_not_clamped, "clamp p - q at 0"),
    ("residual", wrong.residual_not_renormalised, "not renormalised"),
    ("residual", wrong.residual_q_minus_p, "you kept q - p"),
    ("residual", wrong.residual_is_p, "you returned p itself"),
    ("greedy", wrong.no_bonus_token, "the bonus token"),
    ("greedy", wrong.no_correction, "append the target's own token"),
    ("greedy", wrong.continues_after_mismatch, "went on checking after the first mismatch"),
    ("greedy", wrong.row_off_by_one, "off by one"),
    ("expected", wrong.expected_linear, "1 + k * alpha"),
    ("expected", wrong.expected_drafts_only, "accepted drafts only"),
    ("expected", wrong.expected_k_terms, "one term short"),
]


@pytest.mark.parametrize("name", CHECKS)
def test_the_solution_passes(name, capsys):
    check, solution, _ = CHECKS[name]
    assert check(solution)
    assert "✅" in capsys.readouterr().out


def test_every_mistake_is_fed():
    fed = {fn.__name__ for _, fn, _ in NAMED}
    for name, (_, _, mistakes) in CHECKS.items():
        for m in mistakes:
            assert m.wrong.__name__ in fed or m.wrong is nb14._negative_or_not_finite, (name, m.wrong.__name__)


@pytest.mark.parametrize("name, fn, words", NAMED, ids=[fn.__name__ for _, fn, _ in NAMED])
def test_a_classic_mistake_is_named(name, fn, words, capsys):
    check = CHECKS[name][0]
    assert not check(fn)
    out = capsys.readouterr().out
    assert "❌" in out and "🔎" in out and words in out, out


def test_an_unclamped_residual_is_named_however_it_is_written(capsys):
    """Written independently of nb14_mistakes: dividing by the sum of p and of q taken apart."""
    def residual(p, q):
        return (p - q) / (p.sum() - q.sum() + 1e-3)
    assert not nb14.check_residual(residual)
    assert "clamp p - q at 0" in capsys.readouterr().out


def test_the_residual_law_is_the_clamped_difference():
    """The expected answers (solved from the law) are max(0, p - q) renormalised, as the package draws."""
    for (p, q), want in nb14.residual_cases()[:-1]:
        r = (p - q).clamp(min=0)
        assert torch.allclose(want, r / r.sum(), atol=1e-12)


def test_the_greedy_cases_cover_every_branch():
    lengths = {len(want) for (_, draft), want in nb14.greedy_cases() if len(want) == len(draft) + 1}
    assert lengths, "no case where every draft agrees"
    assert any(len(want) < len(draft) + 1 for (_, draft), want in nb14.greedy_cases())
    for (logits, draft), want in nb14.greedy_cases():
        assert want == verify_greedy(logits, draft)


def test_the_expected_tokens_formula_matches_counting():
    for alpha in (0.0, 0.3, 0.7, 0.99):
        for k in (1, 2, 5):
            assert nb14.expected_tokens_solution(alpha, k) == pytest.approx(nb14.expected_by_counting(alpha, k), abs=1e-12)


@pytest.mark.parametrize("name", CHECKS)
def test_an_unfinished_stub_waits(name, capsys):
    def stub(*args):
        raise NotImplementedError
    assert not CHECKS[name][0](stub)
    assert "⏳" in capsys.readouterr().out


@pytest.mark.parametrize("name", CHECKS)
def test_hints_are_tiered(name, capsys):
    def broken(*args):
        raise ValueError("oops")
    CHECKS[name][0](broken, hint=3)
    assert "Hint 3/3" in capsys.readouterr().out
