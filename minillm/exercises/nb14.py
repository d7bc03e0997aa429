"""Exercises of notebook 14 (speculative decoding): the residual distribution a rejection draws
from, greedy verification of the proposed tokens, and the expected tokens per step.

The expected answers come from the package or from the law they must satisfy: greedy
verification from ``minillm.sampling.speculative.verify_greedy``; the residual from the identity
that makes speculative sampling exact (accepted mass ``min(p, q)`` plus the rejected mass times
the residual is ``p``); the expected tokens per step from the distribution of the accepted length,
summed term by term. The classic mistakes live in ``nb14_mistakes``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from minillm.exercises import Mistake, check, same_value
from minillm.exercises import nb14_mistakes as wrong
from minillm.sampling.speculative import verify_greedy


# ------------------------------------------------------------------ exercise 1: the residual
# ``fn(p, q)`` -> ``max(0, p - q)`` renormalised to sum 1 (float64 [vocab]); ``p`` when p == q
# (the residual is empty: a rejection then never happens, and drawing from p is the safe answer).

class Symptom:
    """A property of a wrong answer rather than its exact value (the mistake's arithmetic may be
    written in many ways): ``holds(got)`` says whether the learner's result shows it."""

    def __init__(self, holds: Callable[[Any], bool]) -> None:
        self.holds = holds

    def __repr__(self) -> str:
        return "a symptom"


def _negative_or_not_finite(p: torch.Tensor, q: torch.Tensor) -> Symptom:
    return Symptom(lambda got: isinstance(got, torch.Tensor) and got.is_floating_point()
                   and bool((~got.isfinite()).any() or (got < -1e-12).any()))


def _equal(got: Any, want: Any) -> bool:
    if isinstance(want, Symptom):
        return want.holds(got)
    return same_value(got, want, atol=1e-9)


def residual_solution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    r = (p - q).clamp(min=0)  # where the draft under-proposed: the mass p still needs
    total = r.sum()
    return r / total if total > 0 else p.clone()


def residual_by_the_law(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """The residual solved from ``min(p, q) + (1 - sum min(p, q)) * residual = p``."""
    accepted = torch.minimum(p, q)
    rejected = 1 - accepted.sum()
    return (p - accepted) / rejected if rejected > 1e-12 else p.clone()


def _dirichlet(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = -torch.rand(n, generator=g, dtype=torch.float64).log()
    return x / x.sum()


def residual_cases() -> list[tuple[tuple[torch.Tensor, torch.Tensor], Any]]:
    p = torch.tensor([0.5, 0.2, 0.1, 0.1, 0.1, 0.0], dtype=torch.float64)
    q = torch.tensor([0.1, 0.4, 0.1, 0.3, 0.0, 0.1], dtype=torch.float64)
    one_hot = torch.zeros(8, dtype=torch.float64)
    one_hot[2] = 1.0  # a deterministic proposer (prompt lookup) drew token 2
    pairs = [(p, q), (_dirichlet(8, 1), _dirichlet(8, 2)), (_dirichlet(8, 3), one_hot), (_dirichlet(8, 4), _dirichlet(8, 4))]
    return [((p, q), residual_by_the_law(p, q)) for p, q in pairs]


RESIDUAL_MISTAKES = [
    Mistake(wrong.residual_q_minus_p, "you kept q - p: the residual is where the *target* wants more than the draft "
            "proposed, max(0, p - q); tokens the draft over-proposed are the ones a rejection must avoid."),
    Mistake(wrong.residual_is_p, "you returned p itself: after a rejection, drawing from p counts the tokens the "
            "accepted drafts already supplied twice (the output is then no longer distributed as p)."),
    Mistake(wrong.residual_not_renormalised, "max(0, p - q) is right but not renormalised: it sums to "
            "1 - sum(min(p, q)), the rejection probability, not to 1; divide by its sum."),
    Mistake(_negative_or_not_finite, "negative (or inf/nan) entries: clamp p - q at 0 before normalising. p - q "
            "itself sums to 0 (both sum to 1), so dividing it by its sum blows up."),
]

RESIDUAL_HINTS = [
    "The residual is the part of p that accepting drafts did not already cover: p - min(p, q), which is max(0, p - q).",
    "(p - q).clamp(min=0), then divide by its sum. When p == q that sum is 0: return p.",
    "r = (p - q).clamp(min=0); return r / r.sum() if r.sum() > 0 else p",
]


def check_residual(fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], hint: int = 0) -> bool:
    """``fn(p, q)`` -> the distribution a rejection draws from, [vocab] float64."""
    return check("residual", fn, residual_cases(), hint=hint, hints=RESIDUAL_HINTS, equal=_equal,
                 mistakes=RESIDUAL_MISTAKES)


# ------------------------------------------------------------------ exercise 2: greedy verification
# ``fn(target_logits [k + 1, vocab], draft [k ints])`` -> the tokens to append, a list of ints:
# the drafts up to the first one that is not the target's argmax, then the target's own token
# there; all k drafts and the last row's argmax when every draft agrees.

VOCAB = 12
# (the target's argmax at each row, the draft): every draft agrees; a mismatch at 2; at 0; at the
# last draft; a single draft; drafts that agree again after the mismatch.
GREEDY_CASES = [([3, 7, 7, 2, 9], [3, 7, 7, 2]), ([5, 1, 4, 4, 8], [5, 1, 6, 4]), ([2, 0, 11, 6, 6], [6, 0, 11, 6]),
                ([1, 2, 3, 4, 5], [1, 2, 3, 0]), ([4, 11], [4]), ([8, 3, 0, 5, 10, 10, 1], [8, 9, 0, 5, 10, 10])]


def target_logits(best: Sequence[int], seed: int = 0) -> torch.Tensor:
    """Random logits [len(best), VOCAB] whose row i has its largest value at ``best[i]``."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(len(best), VOCAB, generator=g)
    logits[torch.arange(len(best)), torch.tensor(best)] = logits.max() + 1.0 + torch.rand(len(best), generator=g)
    return logits


def greedy_cases() -> list[tuple[tuple[torch.Tensor, list[int]], list[int]]]:
    cases = []
    for seed, (best, draft) in enumerate(GREEDY_CASES):
        logits = target_logits(best, seed)
        cases.append(((logits, list(draft)), verify_greedy(logits, draft)))
    return cases


def verify_greedy_solution(target_logits: torch.Tensor, draft: Sequence[int]) -> list[int]:
    best = target_logits.argmax(dim=-1).tolist()  # row i: the target's token after the text + draft[:i]
    out = []
    for i, token in enumerate(draft):
        if best[i] != token:
            return out + [best[i]]  # the target's correction, then stop: later drafts followed a wrong token
        out.append(token)
    return out + [best[len(draft)]]  # every draft agreed: the last row gives one more token for free


GREEDY_MISTAKES = [
    Mistake(wrong.row_off_by_one, "off by one: row i of the logits is the target's prediction *for* draft i (it was "
            "computed at the token before it), so compare draft[i] with argmax(row i), not row i + 1."),
    Mistake(wrong.no_bonus_token, "when all k drafts agree, the last row (k) still holds the target's next token: "
            "append it, the bonus token that makes a step yield up to k + 1 tokens."),
    Mistake(wrong.no_correction, "at the first mismatch, append the target's own token (argmax of that row) before "
            "stopping: that forward pass already computed it, and a step always yields at least one token."),
    Mistake(wrong.continues_after_mismatch, "you went on checking after the first mismatch: every later draft (and "
            "row) was computed after the rejected token, so none of them counts; stop at the first mismatch."),
]

GREEDY_HINTS = [
    "best = target_logits.argmax(-1).tolist(): best[i] is what greedy decoding would pick at draft i's place.",
    "Walk the drafts: keep draft[i] while it equals best[i]; at the first difference, append best[i] and return.",
    "If the loop finishes, every draft agreed: return the drafts + [best[k]] (k + 1 tokens).",
]


def check_verify_greedy(fn: Callable[[torch.Tensor, Sequence[int]], list[int]], hint: int = 0) -> bool:
    """``fn(target_logits, draft)`` -> the list of token ids to append."""
    def equal(got: object, want: list[int]) -> bool:
        return isinstance(got, list) and len(got) == len(want) and all(int(g) == w for g, w in zip(got, want))
    return check("verify_greedy", fn, greedy_cases(), hint=hint, hints=GREEDY_HINTS, equal=equal,
                 mistakes=GREEDY_MISTAKES)


# ------------------------------------------------------------------ exercise 3: expected tokens per step
# ``fn(alpha, k)`` -> the expected number of tokens one step appends when each draft is accepted
# with probability alpha, independently, and the step stops at the first rejection.

EXPECTED_CASES = [(0.0, 4), (0.5, 1), (0.8, 4), (0.6, 8), (0.9, 2), (1.0, 3)]


def expected_by_counting(alpha: float, k: int) -> float:
    """Sum over n accepted drafts (n < k: then a rejection; n = k: all) of P(n) * (n + 1 tokens)."""
    return sum(alpha**n * (1 - alpha) * (n + 1) for n in range(k)) + alpha**k * (k + 1)


def expected_tokens_solution(alpha: float, k: int) -> float:
    if alpha == 1.0:
        return float(k + 1)  # every draft accepted, plus the bonus token
    return (1 - alpha ** (k + 1)) / (1 - alpha)  # 1 + alpha + ... + alpha^k


EXPECTED_MISTAKES = [
    Mistake(wrong.expected_linear, "1 + k * alpha counts every draft as if it were checked on its own; draft i counts "
            "only when drafts 1..i were all accepted, probability alpha^i."),
    Mistake(wrong.expected_drafts_only, "you counted the accepted drafts only: every step also yields one token from "
            "the target itself (its correction at a rejection, or the bonus token): add 1."),
    Mistake(wrong.expected_k_terms, "one term short: the sum is 1 + alpha + ... + alpha^k, k + 1 terms, i.e. "
            "(1 - alpha^(k + 1)) / (1 - alpha)."),
]

EXPECTED_HINTS = [
    "The step yields 1 + (number of accepted drafts) tokens; draft i is accepted only if drafts 1..i all were.",
    "E[accepted drafts] = sum over i = 1..k of P(draft i counts) = alpha + alpha^2 + ... + alpha^k.",
    "(1 - alpha ** (k + 1)) / (1 - alpha), and k + 1 when alpha == 1.",
]


def check_expected_tokens(fn: Callable[[float, int], float], hint: int = 0) -> bool:
    """``fn(alpha, k)`` -> the expected tokens per step, a float."""
    cases = [((alpha, k), expected_by_counting(alpha, k)) for alpha, k in EXPECTED_CASES]
    return check("expected_tokens", fn, cases, hint=hint, hints=EXPECTED_HINTS, mistakes=EXPECTED_MISTAKES, atol=1e-9)
