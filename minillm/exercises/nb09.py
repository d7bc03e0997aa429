"""Exercises of notebook 09 (sampling): the four logits processors (temperature, top-k, top-p,
min-p) and the repetition penalty here; the batched sampler, stop strings and a beam-search step
in ``nb09_decoding`` (imported below, so the notebook finds every check as ``nb09.check_...``).

The expected answers come from the package's processors (``minillm.sampling``), on cases that
hold the edges: ties at the cut, k larger than the vocabulary, top_p = 1, min_p = 0 and 1, -inf
entries left by an earlier filter, batched rows that each need their own cut. Each classic
mistake is written out in ``nb09_mistakes`` as the function a learner would write, so a wrong
answer of that kind is named. The right answers are the ``*_solution`` functions.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from minillm.exercises import Mistake, check
from minillm.exercises import nb09_mistakes as wrong
from minillm.exercises.nb09_decoding import (BATCH_HINTS, BATCH_MISTAKES, BEAM_HINTS, BEAM_MISTAKES, STOP_HINTS,
                                             STOP_MISTAKES, SeededGenerators, beam_candidates_solution,
                                             check_beam_candidates, check_cut_at_stop, check_sample_batch,
                                             cut_at_stop_solution, sample_batch_solution, same_candidates)
from minillm.sampling import MinP, RepetitionPenalty, Temperature, TopK, TopP

FilterFn = Callable[[torch.Tensor, Any], torch.Tensor]
PenaltyFn = Callable[[torch.Tensor, list[int], list[int], float], torch.Tensor]

__all__ = [
    "BATCH_HINTS", "BATCH_MISTAKES", "BEAM_HINTS", "BEAM_MISTAKES", "MIN_P_HINTS", "MIN_P_MISTAKES", "PENALTY_HINTS",
    "PENALTY_MISTAKES", "STOP_HINTS", "STOP_MISTAKES", "TEMPERATURE_HINTS", "TEMPERATURE_MISTAKES", "TOP_K_HINTS",
    "TOP_K_MISTAKES", "TOP_P_HINTS", "TOP_P_MISTAKES", "SeededGenerators", "beam_candidates_solution",
    "check_beam_candidates", "check_cut_at_stop", "check_min_p", "check_repetition_penalty", "check_sample_batch",
    "check_temperature", "check_top_k", "check_top_p", "cut_at_stop_solution", "min_p_filter_solution",
    "repetition_penalty_solution", "same_candidates", "same_filter", "sample_batch_solution", "temperature_solution",
    "top_k_filter_solution", "top_p_filter_solution",
]

_NEG_INF = -math.inf


def _unchanged_inputs(fn: Callable[..., Any], args: tuple[Any, ...]) -> str | None:
    """A rule: a logits processor returns new scores and leaves the ones it was given alone
    (the caller may still need the raw logits, e.g. for log-probabilities)."""
    copies = tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args)
    try:
        fn(*copies)
    except Exception:  # the values already passed; a rule only reports what it saw
        return None
    for before, after in zip(args, copies):
        if isinstance(before, torch.Tensor) and not torch.equal(before, after):
            return ("it writes into the `scores` it was given: return a new tensor (`masked_fill`, not "
                    "`masked_fill_`; no `scores[...] = ...`), the caller may still need the raw logits.")
    return None


def _logits(*rows: list[float]) -> torch.Tensor:
    """Logits [rows, vocab] whose softmax is the given probabilities (0 -> -inf). The +2 is a
    reminder that logits are only defined up to a constant: softmax(z + c) = softmax(z)."""
    return torch.tensor(rows).log() + 2.0


def _cases(package: Callable[[Any], Any], inputs: list[tuple[torch.Tensor, Any]]) -> list[tuple[tuple[Any, ...], Any]]:
    """(scores, value) -> the package's processor built with ``value``, applied to ``scores``."""
    return [((scores, value), package(value)(None, scores)) for scores, value in inputs]


def _processor_check(name: str, fn: FilterFn, cases: list, hint: int, hints: list[str], mistakes: list[Mistake],
                     equal: Callable[[Any, Any], bool] | None = None) -> bool:
    """``check`` for a processor: the values are computed on copies of the cases' scores (a processor
    that writes into its input must not spoil the case for the rule that then catches it)."""

    def on_copies(*args: Any) -> Any:
        return fn(*(a.clone() if isinstance(a, torch.Tensor) else a for a in args))

    on_copies.__name__ = getattr(fn, "__name__", name)
    return check(name, on_copies, cases, hint=hint, hints=hints, equal=equal, mistakes=mistakes,
                 rules=[lambda _, args: _unchanged_inputs(fn, args)])


# --- temperature ---------------------------------------------------------------------------------


def _temperature_cases() -> list[tuple[tuple[torch.Tensor, float], torch.Tensor]]:
    g = torch.Generator().manual_seed(9)
    return _cases(Temperature, [
        (_logits([0.5, 0.3, 0.2]), 0.5),  # sharper
        (torch.randn(3, 100, generator=g) * 3, 0.7),  # a batch: every row divided by the same t
        (torch.tensor([[1.0, -math.inf, 0.5, 2.0]]), 2.0),  # flatter; -inf (a removed token) stays -inf
        (_logits([0.6, 0.4]), 1.0),  # t = 1 changes nothing
        (torch.randn(1, 1000, generator=g) * 4, 1.5),
    ])


TEMPERATURE_MISTAKES = [
    Mistake(wrong.temperature_multiplies, "you multiplied by t: temperature *divides* the logits (t < 1 sharpens, "
            "so the gaps between logits must grow)."),
    Mistake(wrong.temperature_after_softmax, "temperature applied after softmax: dividing probabilities by t "
            "changes nothing once they are renormalised (log(p / t) is log p shifted by a constant). Divide the "
            "logits, before any softmax."),
    Mistake(wrong.temperature_probabilities, "return the new *scores* (logits), not probabilities: the filters "
            "after it and the final softmax expect logits."),
]

TEMPERATURE_HINTS = [
    "Temperature acts on the logits, before the softmax that turns them into probabilities.",
    "softmax(z / t): t < 1 makes the gaps between logits larger (sharper), t > 1 smaller (flatter).",
    "return scores / t",
]


def check_temperature(fn: FilterFn, hint: int = 0) -> bool:
    """``fn(scores [batch, vocab], t)`` -> the scores divided by ``t``, as ``minillm.sampling.Temperature(t)``."""
    return _processor_check("temperature", fn, _temperature_cases(), hint, TEMPERATURE_HINTS, TEMPERATURE_MISTAKES)


def temperature_solution(scores: torch.Tensor, t: float) -> torch.Tensor:
    return scores / t  # a new tensor; -inf / t stays -inf


# --- top-k ---------------------------------------------------------------------------------------


def _top_k_cases() -> list[tuple[tuple[torch.Tensor, int], torch.Tensor]]:
    g = torch.Generator().manual_seed(9)
    tied = torch.tensor([[3.0, 1.0, 2.0, 2.0, 0.0]])
    return _cases(TopK, [
        (tied, 1),
        (tied, 2),  # the two 2.0s tie with the 2nd largest: both stay, 3 tokens
        (torch.randn(3, 50, generator=g) * 2, 5),  # a batch: each row its own k-th largest
        (torch.tensor([[1.0, -2.0, 0.5]]), 10),  # k larger than the vocabulary: keep everything
        (torch.tensor([[-math.inf, 2.0, 1.0, -math.inf, 0.0]]), 4),  # -inf from an earlier filter stays -inf
        (torch.randint(-3, 4, (2, 64), generator=g).float(), 10),  # many ties
        (torch.randn(2, 1000, generator=g) * 2, 40),
    ])


TOP_K_MISTAKES = [
    Mistake(wrong.top_k_exactly_k, "you kept exactly k tokens (topk's indices): tokens tied with the k-th are then "
            "kept or dropped by the sort's whim. The package's cut is a *value*: keep every token whose score is "
            ">= the k-th largest, so all ties survive and more than k tokens may stay."),
    Mistake(wrong.top_k_drops_kth, "the k-th token itself is gone: keep scores >= the k-th largest "
            "(remove only those strictly below it)."),
    Mistake(wrong.top_k_one_threshold, "one threshold for the whole batch: each row needs its own k-th largest "
            "(`scores.topk(k, dim=-1).values[..., -1:]`, shape [batch, 1])."),
    Mistake(wrong.top_k_smallest, "you kept the k *smallest* scores: top-k keeps the largest."),
    Mistake(wrong.top_k_zero_filled, "removed tokens must become -inf, not 0: a logit of 0 is an ordinary token "
            "(softmax(-inf) = 0)."),
]

TOP_K_HINTS = [
    "Find each row's k-th largest score; everything strictly below it goes to -inf. k may exceed the vocabulary.",
    "kth = scores.topk(min(k, scores.shape[-1]), dim=-1).values[..., -1:] is [batch, 1]; compare every score with it.",
    "kth = scores.topk(min(k, scores.shape[-1]), dim=-1).values[..., -1:]; "
    "return scores.masked_fill(scores < kth, -math.inf)",
]


def _top_k_with_a_named_crash(fn: FilterFn) -> FilterFn:
    """``fn``, with the error of ``topk(k)`` for k > vocab explained (the classic crash)."""
    def top_k_filter(scores: torch.Tensor, k: int) -> torch.Tensor:
        try:
            return fn(scores, k)
        except NotImplementedError:
            raise
        except RuntimeError as err:
            if k > scores.shape[-1]:
                raise RuntimeError(f"{err} -- k = {k} is larger than the vocabulary ({scores.shape[-1]}): "
                                   "clamp it with min(k, vocab); top-k then keeps every token") from None
            raise

    top_k_filter.__name__ = getattr(fn, "__name__", "top_k_filter")
    return top_k_filter


def check_top_k(fn: FilterFn, hint: int = 0) -> bool:
    """``fn(scores [batch, vocab], k)`` -> every score below the row's k-th largest set to -inf, as
    ``minillm.sampling.TopK(k)`` (ties with the k-th all kept; k > vocab keeps everything)."""
    return _processor_check("top_k_filter", _top_k_with_a_named_crash(fn), _top_k_cases(), hint, TOP_K_HINTS,
                            TOP_K_MISTAKES)


def top_k_filter_solution(scores: torch.Tensor, k: int) -> torch.Tensor:
    kth_largest = scores.topk(min(k, scores.shape[-1]), dim=-1).values[..., -1:]  # [batch, 1]: a value, not a count
    return scores.masked_fill(scores < kth_largest, _NEG_INF)  # ties with the k-th stay


# --- top-p ---------------------------------------------------------------------------------------


def _top_p_cases() -> list[tuple[tuple[torch.Tensor, float], torch.Tensor]]:
    g = torch.Generator().manual_seed(9)
    return _cases(TopP, [
        (_logits([0.15, 0.45, 0.25, 0.10, 0.05]), 0.9),  # 0.45 + 0.25 + 0.15 = 0.85 < 0.9: the 0.10 crosses, kept
        (_logits([0.15, 0.45, 0.25, 0.10, 0.05]), 0.65),  # 0.45 < 0.65, 0.45 + 0.25 crosses: two tokens
        (_logits([0.02, 0.95, 0.03]), 0.9),  # one token already holds more than p: keep it alone, never nothing
        (_logits([0.1, 0.2, 0.3, 0.4], [0.6, 0.25, 0.1, 0.05]), 0.5),  # a batch: each row its own nucleus
        (_logits([0.2, 0.4, 0.2, 0.2]), 0.5),  # ties at the boundary: only one of the three 0.2s is needed
        (_logits([0.0, 0.5, 0.3, 0.0, 0.2]), 0.7),  # -inf from an earlier filter stays -inf
        (_logits([0.0, 0.5, 0.3, 0.0, 0.2]), 1.0),  # p = 1: everything that can be drawn stays
        (torch.randn(2, 1000, generator=g) * 2, 0.8),  # vocabulary-sized rows
    ])


def same_filter(got: Any, want: torch.Tensor) -> bool:
    """Equal, except that tokens tied at the boundary may be swapped: which of two equal tokens
    completes the nucleus is up to the sort. Each row must keep as many tokens as ``want``, with
    the same values, and every other entry must be -inf."""
    if not isinstance(got, torch.Tensor) or got.shape != want.shape or got.dtype != want.dtype:
        return False
    if torch.equal(got, want):
        return True
    kept_got, kept_want = got.isfinite(), want.isfinite()
    both = kept_got & kept_want
    if not torch.equal(got[both], want[both]) or not bool((got[~kept_got] == _NEG_INF).all()):
        return False
    return all(
        torch.equal(got[row][kept_got[row]].sort().values, want[row][kept_want[row]].sort().values)
        for row in range(want.shape[0])
    )


TOP_P_MISTAKES = [
    Mistake(
        wrong.top_p_drops_boundary,
        "the boundary token is missing: you kept only the tokens whose running total stays *below* p, so the "
        "nucleus holds less than p (and nothing at all when one token alone has more than p). The token whose "
        "probability makes the total reach p is the last one KEPT.",
    ),
    Mistake(
        wrong.top_p_ascending_walk,
        "you walked up from the *least* likely token: sort descending (most likely first), or, sorting ascending "
        "as transformers does, remove the tail whose cumulative mass is <= 1 - p.",
    ),
    Mistake(
        wrong.top_p_on_logits,
        "p is a probability mass: softmax the scores first. Running sums of logits mean nothing (logits are only "
        "defined up to a constant: these ones are log-probabilities + 2).",
    ),
    Mistake(wrong.top_p_unsorted, "you summed the probabilities in vocabulary order: sort them from most to least "
            "likely first."),
    Mistake(
        wrong.top_p_all_ties_kept,
        "you kept every token tied with the boundary token: top-p keeps the *smallest* set that reaches p, so "
        "of several equal tokens at the boundary only as many as needed stay (which ones is up to the sort). "
        "Top-k is the one that keeps all ties, because its cut is a value, not a mass.",
    ),
    Mistake(wrong.top_p_zero_filled, "removed tokens must become -inf, not 0: a logit of 0 is an ordinary, likely "
            "token (softmax(-inf) = 0)."),
    Mistake(
        wrong.top_p_probabilities,
        "return the filtered *scores* (logits, removed ones -inf), not probabilities: the next processor in the "
        "chain and the final softmax expect logits.",
    ),
]

TOP_P_HINTS = [
    "Work on probabilities (softmax each row), sorted from most to least likely. Walk down adding them up: the "
    "token whose probability makes the running total reach p is the last one kept.",
    "With sorted_p, order = scores.softmax(-1).sort(dim=-1, descending=True), the mass of the tokens *before* "
    "each one is sorted_p.cumsum(-1) - sorted_p: keep a token while that is < p (so the top one always stays). "
    "`remove_sorted.scatter(-1, order, remove_sorted)` puts the decisions back in vocabulary order.",
    "remove_sorted = sorted_p.cumsum(-1) - sorted_p >= p; remove = remove_sorted.scatter(-1, order, "
    "remove_sorted); return scores.masked_fill(remove, -math.inf)",
]


def check_top_p(fn: FilterFn, hint: int = 0) -> bool:
    """``fn(scores [batch, vocab], p)`` -> the scores with every token outside the nucleus set to -inf,
    as ``minillm.sampling.TopP(p)`` computes them (boundary token kept, ties broken either way)."""
    return _processor_check("top_p_filter", fn, _top_p_cases(), hint, TOP_P_HINTS, TOP_P_MISTAKES, same_filter)


def top_p_filter_solution(scores: torch.Tensor, p: float) -> torch.Tensor:
    sorted_p, order = scores.softmax(dim=-1).sort(dim=-1, descending=True)
    before = sorted_p.cumsum(dim=-1) - sorted_p  # the mass of the more likely tokens
    remove_sorted = before >= p  # p is already reached without this token; the boundary token has before < p
    return scores.masked_fill(remove_sorted.scatter(-1, order, remove_sorted), _NEG_INF)


# --- min-p ---------------------------------------------------------------------------------------


def _min_p_cases() -> list[tuple[tuple[torch.Tensor, float], torch.Tensor]]:
    g = torch.Generator().manual_seed(9)
    confident, flat = [0.55, 0.25, 0.12, 0.05, 0.03], [0.24, 0.2, 0.2, 0.19, 0.17]
    return _cases(MinP, [
        (_logits(confident), 0.1),  # the cut is 0.1 x 0.55 = 0.055: the 0.05 and 0.03 go
        (_logits(confident, flat), 0.3),  # a batch: each row measured against its own top token
        (_logits([0.4, 0.4, 0.15, 0.05]), 1.0),  # min_p = 1: only the top token, and every token tied with it
        (torch.randn(2, 50, generator=g), 0.0),  # min_p = 0: nothing removed
        (_logits([0.0, 0.5, 0.3, 0.0, 0.2]), 0.5),  # -inf from an earlier filter stays -inf
        (torch.randn(2, 1000, generator=g) * 1.5, 0.05),  # vocabulary-sized, flattened rows
    ])


MIN_P_MISTAKES = [
    Mistake(wrong.min_p_global_max, "min-p relative to the wrong max: you took the largest probability of the whole "
            "batch; each row is measured against its own top token (`probs.amax(dim=-1, keepdim=True)`)."),
    Mistake(wrong.min_p_at_threshold_removed, "a token exactly at the cut stays (remove only probs *below* it): with "
            "min_p = 1 your filter removes the top token too and nothing can be drawn."),
    Mistake(wrong.min_p_on_logits, "compare probabilities, not logits: softmax the scores first (logits are only "
            "defined up to a constant, so `p × the largest logit` means nothing)."),
    Mistake(wrong.min_p_absolute, "min_p is relative: the cut is min_p × the row's top probability, not min_p "
            "itself."),
    Mistake(wrong.min_p_zero_filled, "removed tokens must become -inf, not 0: a logit of 0 is an ordinary token "
            "(softmax(-inf) = 0)."),
]

MIN_P_HINTS = [
    "Softmax each row; a token stays when its probability is at least min_p times the row's largest probability.",
    "probs = scores.softmax(-1); threshold = p * probs.amax(dim=-1, keepdim=True) is [batch, 1].",
    "probs = scores.softmax(-1); return scores.masked_fill(probs < p * probs.amax(dim=-1, keepdim=True), -math.inf)",
]


def check_min_p(fn: FilterFn, hint: int = 0) -> bool:
    """``fn(scores [batch, vocab], p)`` -> the scores of tokens with probability below ``p`` times their row's
    top probability set to -inf, as ``minillm.sampling.MinP(p)``."""
    return _processor_check("min_p_filter", fn, _min_p_cases(), hint, MIN_P_HINTS, MIN_P_MISTAKES)


def min_p_filter_solution(scores: torch.Tensor, p: float) -> torch.Tensor:
    probs = scores.softmax(dim=-1)
    threshold = p * probs.amax(dim=-1, keepdim=True)  # [batch, 1]: each row against its own top token
    return scores.masked_fill(probs < threshold, _NEG_INF)  # the top token always passes (p <= 1)


# --- the repetition penalty ----------------------------------------------------------------------


def _package_penalty(scores: torch.Tensor, prompt_ids: list[int], output_ids: list[int], penalty: float) -> torch.Tensor:
    history = torch.tensor([prompt_ids + output_ids], dtype=torch.long)
    return RepetitionPenalty(penalty)(history, scores[None])[0]


def _penalty_cases() -> list[tuple[tuple[torch.Tensor, list[int], list[int], float], torch.Tensor]]:
    g = torch.Generator().manual_seed(9)
    inputs = [
        # 0, 1 only in the prompt (1 negative); 2 generated twice; 3 generated and negative
        (torch.tensor([2.0, -1.0, 0.5, -3.0, 1.5, 0.0]), [0, 1], [2, 2, 3, 4], 1.5),
        (torch.tensor([1.0, -2.0, 3.0, -0.5]), [3, 1, 3], [], 1.3),  # before the first generated token
        (torch.tensor([1.0, -2.0, 3.0, -0.5]), [0], [1, 1, 1], 0.8),  # penalty < 1 *rewards* repetition
        (torch.tensor([-math.inf, 2.0, -1.0]), [], [0, 1, 2], 2.0),  # -inf stays -inf
        (torch.randn(1000, generator=g) * 4, torch.randint(0, 1000, (30,), generator=g).tolist(),
         torch.randint(0, 1000, (20,), generator=g).tolist() * 2, 1.2),
    ]
    return [(args, _package_penalty(*args)) for args in inputs]


PENALTY_MISTAKES = [
    Mistake(
        wrong.penalty_ctrl_paper,
        "that is the CTRL paper's original rule (divide, generated tokens only). The package follows transformers: "
        "negative logits are multiplied, and the prompt's tokens count too.",
    ),
    Mistake(
        wrong.penalty_divides_negatives,
        "you divided every seen logit: a negative logit divided by a penalty > 1 moves towards 0, i.e. UP, and the "
        "token gets likelier. Divide positive logits, multiply negative ones (both move down).",
    ),
    Mistake(
        wrong.penalty_generated_only,
        "the prompt's tokens are not penalized: the package (like transformers for decoder-only models, and vLLM) "
        "counts every token of prompt + output; generated tokens only is the CTRL paper's rule.",
    ),
    Mistake(
        wrong.penalty_per_occurrence,
        "you penalized once per occurrence (penalty ** count): each distinct token is penalized once, however often "
        "it occurred. Counting occurrences is what OpenAI's additive frequency_penalty does.",
    ),
    Mistake(
        wrong.penalty_signs_swapped,
        "the signs are swapped: you multiplied positive logits and divided negative ones, which pushes both UP. "
        "Divide positive logits, multiply negative ones.",
    ),
]

PENALTY_HINTS = [
    "Collect the distinct ids of prompt + output (each counts once), then change only their logits.",
    "index = torch.tensor(sorted(set(prompt_ids + output_ids)), dtype=torch.long); seen = scores[index]; a "
    "positive logit is divided by the penalty, a negative one multiplied (torch.where).",
    "new = scores.clone(); new[index] = torch.where(seen < 0, seen * penalty, seen / penalty); return new",
]


def check_repetition_penalty(fn: PenaltyFn, hint: int = 0) -> bool:
    """``fn(scores [vocab], prompt_ids, output_ids, penalty)`` -> the penalized scores, as
    ``minillm.sampling.RepetitionPenalty(penalty)`` computes them on the history prompt + output."""
    return _processor_check("repetition_penalty", fn, _penalty_cases(), hint, PENALTY_HINTS, PENALTY_MISTAKES)


def repetition_penalty_solution(scores: torch.Tensor, prompt_ids: list[int], output_ids: list[int],
                                penalty: float) -> torch.Tensor:
    index = torch.tensor(sorted(set(prompt_ids + output_ids)), dtype=torch.long)  # each distinct token once
    seen = scores[index]
    new = scores.clone()  # never write into the caller's logits
    new[index] = torch.where(seen < 0, seen * penalty, seen / penalty)  # both move the logit down (penalty > 1)
    return new
