"""Exercises of notebook 09 (sampling): top-p with its boundary token, the repetition penalty,
cutting at a stop string, and one step of beam search.

The expected answers come from the package where it has the function (``minillm.sampling.TopP``,
``minillm.sampling.RepetitionPenalty``, ``minillm.engine.StopStringFilter``); each classic
mistake is written out as the function a learner would write, so a wrong answer of that kind
is named. Beam search keeps its candidate step inside ``BeamSearch.advance``, so its cases are
small enough to check by hand, plus one ranked by brute force over every (beam, token) pair.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from minillm.engine import StopStringFilter
from minillm.exercises import Mistake, check
from minillm.sampling import RepetitionPenalty, TopP

TopPFn = Callable[[torch.Tensor, float], torch.Tensor]
PenaltyFn = Callable[[torch.Tensor, list[int], list[int], float], torch.Tensor]
StopFn = Callable[[str, list[str]], tuple[str, bool]]
BeamFn = Callable[[torch.Tensor, torch.Tensor, int], list[tuple[int, int, float]]]

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


# --- top-p ---------------------------------------------------------------------------------------


def _logits(*rows: list[float]) -> torch.Tensor:
    """Logits [rows, vocab] whose softmax is the given probabilities (0 -> -inf). The +2 is a
    reminder that logits are only defined up to a constant: softmax(z + c) = softmax(z)."""
    return torch.tensor(rows).log() + 2.0


def _top_p_cases() -> list[tuple[tuple[torch.Tensor, float], torch.Tensor]]:
    g = torch.Generator().manual_seed(9)
    inputs = [
        (_logits([0.15, 0.45, 0.25, 0.10, 0.05]), 0.9),  # 0.45 + 0.25 + 0.15 = 0.85 < 0.9: the 0.10 crosses, kept
        (_logits([0.15, 0.45, 0.25, 0.10, 0.05]), 0.65),  # 0.45 < 0.65, 0.45 + 0.25 crosses: two tokens
        (_logits([0.02, 0.95, 0.03]), 0.9),  # one token already holds more than p: keep it alone, never nothing
        (_logits([0.1, 0.2, 0.3, 0.4], [0.6, 0.25, 0.1, 0.05]), 0.5),  # a batch: each row its own nucleus
        (_logits([0.2, 0.4, 0.2, 0.2]), 0.5),  # ties at the boundary: only one of the three 0.2s is needed
        (_logits([0.0, 0.5, 0.3, 0.0, 0.2]), 0.7),  # -inf from an earlier filter stays -inf
        (torch.randn(2, 1000, generator=g) * 2, 0.8),  # vocabulary-sized rows
    ]
    return [((scores, p), TopP(p)(None, scores)) for scores, p in inputs]  # type: ignore[arg-type]


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


def _sorted_probs(scores: torch.Tensor, descending: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    return scores.softmax(dim=-1).sort(dim=-1, descending=descending)


def _remove_sorted(scores: torch.Tensor, remove_sorted: torch.Tensor, order: torch.Tensor, fill: float = _NEG_INF) -> torch.Tensor:
    return scores.masked_fill(remove_sorted.scatter(-1, order, remove_sorted), fill)


def _drop_boundary(scores: torch.Tensor, p: float) -> torch.Tensor:
    sorted_p, order = _sorted_probs(scores)
    return _remove_sorted(scores, sorted_p.cumsum(-1) >= p, order)


def _ascending_walk(scores: torch.Tensor, p: float) -> torch.Tensor:
    sorted_p, order = _sorted_probs(scores, descending=False)
    return _remove_sorted(scores, sorted_p.cumsum(-1) - sorted_p >= p, order)


def _p_on_logits(scores: torch.Tensor, p: float) -> torch.Tensor:
    ranked, order = scores.sort(dim=-1, descending=True)
    return _remove_sorted(scores, ranked.cumsum(-1) - ranked >= p, order)


def _unsorted(scores: torch.Tensor, p: float) -> torch.Tensor:
    probs = scores.softmax(dim=-1)
    return scores.masked_fill(probs.cumsum(-1) - probs >= p, _NEG_INF)


def _all_ties_kept(scores: torch.Tensor, p: float) -> torch.Tensor:
    sorted_p, _ = _sorted_probs(scores)
    n_kept = ((sorted_p.cumsum(-1) - sorted_p) < p).sum(-1, keepdim=True)
    boundary = sorted_p.gather(-1, n_kept - 1)  # the probability of the last token the nucleus needs
    return scores.masked_fill(scores.softmax(dim=-1) < boundary, _NEG_INF)


def _zero_filled(scores: torch.Tensor, p: float) -> torch.Tensor:
    sorted_p, order = _sorted_probs(scores)
    return _remove_sorted(scores, sorted_p.cumsum(-1) - sorted_p >= p, order, fill=0.0)


def _probabilities(scores: torch.Tensor, p: float) -> torch.Tensor:
    sorted_p, order = _sorted_probs(scores)
    return _remove_sorted(scores, sorted_p.cumsum(-1) - sorted_p >= p, order).softmax(dim=-1)


TOP_P_MISTAKES = [
    Mistake(
        _drop_boundary,
        "the boundary token is missing: you kept only the tokens whose running total stays *below* p, so the "
        "nucleus holds less than p (and nothing at all when one token alone has more than p). The token whose "
        "probability makes the total reach p is the last one KEPT.",
    ),
    Mistake(
        _ascending_walk,
        "you walked up from the *least* likely token: sort descending (most likely first), or, sorting ascending "
        "as transformers does, remove the tail whose cumulative mass is <= 1 - p.",
    ),
    Mistake(
        _p_on_logits,
        "p is a probability mass: softmax the scores first. Running sums of logits mean nothing (logits are only "
        "defined up to a constant: these ones are log-probabilities + 2).",
    ),
    Mistake(_unsorted, "you summed the probabilities in vocabulary order: sort them from most to least likely first."),
    Mistake(
        _all_ties_kept,
        "you kept every token tied with the boundary token: top-p keeps the *smallest* set that reaches p, so "
        "of several equal tokens at the boundary only as many as needed stay (which ones is up to the sort). "
        "Top-k is the one that keeps all ties, because its cut is a value, not a mass.",
    ),
    Mistake(
        _zero_filled,
        "removed tokens must become -inf, not 0: a logit of 0 is an ordinary, likely token (softmax(-inf) = 0).",
    ),
    Mistake(
        _probabilities,
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


def check_top_p(fn: TopPFn, hint: int = 0) -> bool:
    """``fn(scores [batch, vocab], p)`` -> the scores with every token outside the nucleus set to -inf,
    as ``minillm.sampling.TopP(p)`` computes them (boundary token kept, ties broken either way)."""
    return check("top_p_filter", fn, _top_p_cases(), hint=hint, hints=TOP_P_HINTS, equal=same_filter,
                 mistakes=TOP_P_MISTAKES, rules=[_unchanged_inputs])


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


def _sign_rule(scores: torch.Tensor, seen: list[int], penalty: float) -> torch.Tensor:
    index = torch.tensor(sorted(set(seen)), dtype=torch.long)
    old = scores[index]
    return scores.index_put((index,), torch.where(old < 0, old * penalty, old / penalty))


def _divide(scores: torch.Tensor, seen: list[int], penalty: float) -> torch.Tensor:
    index = torch.tensor(sorted(set(seen)), dtype=torch.long)
    return scores.index_put((index,), scores[index] / penalty)


def _ctrl_paper(scores: torch.Tensor, prompt_ids: list[int], output_ids: list[int], penalty: float) -> torch.Tensor:
    return _divide(scores, output_ids, penalty)


def _divides_negatives(scores: torch.Tensor, prompt_ids: list[int], output_ids: list[int], penalty: float) -> torch.Tensor:
    return _divide(scores, prompt_ids + output_ids, penalty)


def _generated_only(scores: torch.Tensor, prompt_ids: list[int], output_ids: list[int], penalty: float) -> torch.Tensor:
    return _sign_rule(scores, output_ids, penalty)


def _per_occurrence(scores: torch.Tensor, prompt_ids: list[int], output_ids: list[int], penalty: float) -> torch.Tensor:
    counts = torch.bincount(torch.tensor(prompt_ids + output_ids, dtype=torch.long), minlength=len(scores))
    factor = penalty ** counts.to(scores.dtype)
    return torch.where(scores < 0, scores * factor, scores / factor)


def _signs_swapped(scores: torch.Tensor, prompt_ids: list[int], output_ids: list[int], penalty: float) -> torch.Tensor:
    return _sign_rule(scores, prompt_ids + output_ids, 1 / penalty)


PENALTY_MISTAKES = [
    Mistake(
        _ctrl_paper,
        "that is the CTRL paper's original rule (divide, generated tokens only). The package follows transformers: "
        "negative logits are multiplied, and the prompt's tokens count too.",
    ),
    Mistake(
        _divides_negatives,
        "you divided every seen logit: a negative logit divided by a penalty > 1 moves towards 0, i.e. UP, and the "
        "token gets likelier. Divide positive logits, multiply negative ones (both move down).",
    ),
    Mistake(
        _generated_only,
        "the prompt's tokens are not penalized: the package (like transformers for decoder-only models, and vLLM) "
        "counts every token of prompt + output; generated tokens only is the CTRL paper's rule.",
    ),
    Mistake(
        _per_occurrence,
        "you penalized once per occurrence (penalty ** count): each distinct token is penalized once, however often "
        "it occurred. Counting occurrences is what OpenAI's additive frequency_penalty does.",
    ),
    Mistake(
        _signs_swapped,
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
    return check("repetition_penalty", fn, _penalty_cases(), hint=hint, hints=PENALTY_HINTS,
                 mistakes=PENALTY_MISTAKES, rules=[_unchanged_inputs])


# --- stop strings --------------------------------------------------------------------------------


def _package_cut(text: str, stops: list[str]) -> tuple[str, bool]:
    """What the engine shows: the stream filter fed the whole text at once, then flushed."""
    stream = StopStringFilter(tuple(stops))
    shown = stream.push(text) + stream.flush()
    return shown, stream.stopped


def _stop_cases() -> list[tuple[tuple[str, list[str]], tuple[str, bool]]]:
    inputs = [
        ("Paris.\nThe answer is", ["\n"]),
        ("a.b.c", ["."]),  # the first occurrence, not the last
        ("one. two! three", ["!", "."]),  # '.' comes first in the text, though it is listed second
        ("User: hi\nUser: bye", ["\nUser:"]),
        ("abcd", ["cd", "bc"]),
        ("a b c", ["x"]),
        ("", ["a"]),
    ]
    return [((text, stops), _package_cut(text, stops)) for text, stops in inputs]


def _keeps_stop(text: str, stops: list[str]) -> tuple[str, bool]:
    hits = [(i, s) for s in stops if (i := text.find(s)) >= 0]
    if not hits:
        return text, False
    i, s = min(hits)
    return text[: i + len(s)], True


def _last_occurrence(text: str, stops: list[str]) -> tuple[str, bool]:
    hits = [i for i in (text.rfind(s) for s in stops) if i >= 0]
    return (text[: min(hits)], True) if hits else (text, False)


def _first_listed(text: str, stops: list[str]) -> tuple[str, bool]:
    for s in stops:
        if s in text:
            return text[: text.find(s)], True
    return text, False


STOP_MISTAKES = [
    Mistake(_keeps_stop, "cut *before* the stop string: it never reaches the user (OpenAI and vLLM semantics)."),
    Mistake(_last_occurrence, "cut at the *first* occurrence (`find`, not `rfind`): nothing after a stop string may be shown."),
    Mistake(_first_listed, "the earliest occurrence in the text wins, whichever stop string it is, not the first one listed."),
]

STOP_HINTS = [
    "Find where each stop string first occurs in the text; the earliest one ends the text.",
    "text.find(s) is the first index of s, or -1; keep the smallest index >= 0 over all stop strings.",
    "hits = [i for i in (text.find(s) for s in stops) if i >= 0]; "
    "return (text[:min(hits)], True) if hits else (text, False)",
]


def check_cut_at_stop(fn: StopFn, hint: int = 0) -> bool:
    """``fn(text, stops)`` -> ``(text before the earliest stop string, whether one occurred)``, what
    the engine's ``StopStringFilter`` shows."""
    return check("cut_at_stop", fn, _stop_cases(), hint=hint, hints=STOP_HINTS, mistakes=STOP_MISTAKES)


# --- one step of beam search ---------------------------------------------------------------------


def _brute_force_candidates(beam_scores: torch.Tensor, log_probs: torch.Tensor, num_beams: int) -> list[tuple[int, int, float]]:
    """Every (beam, token) continuation scored and ranked in plain Python: slow, obviously right."""
    pairs = [(float(beam_scores[b] + log_probs[b, t]), b, t)
             for b in range(log_probs.shape[0]) for t in range(log_probs.shape[1])]
    return [(b, t, s) for s, b, t in sorted(pairs, reverse=True)[: 2 * num_beams]]


def _beam_cases() -> list[tuple[tuple[torch.Tensor, torch.Tensor, int], list[tuple[int, int, float]]]]:
    g = torch.Generator().manual_seed(9)
    dominant = (torch.tensor([0.0, -5.0, -6.0]), (torch.randn(3, 50, generator=g) * 2).log_softmax(-1), 3)
    return [
        ((torch.tensor([0.0]), torch.tensor([[-0.5, -1.0, -2.0, -3.0]]), 1), [(0, 0, -0.5), (0, 1, -1.0)]),
        ((torch.tensor([-1.0, -2.0]), torch.tensor([[-0.25, -2.0, -3.0], [-0.5, -0.75, -5.0]]), 2),
         [(0, 0, -1.25), (1, 0, -2.5), (1, 1, -2.75), (0, 1, -3.0)]),
        (dominant, _brute_force_candidates(*dominant)),  # the best beam is far ahead: all 6 candidates extend it
    ]


def same_candidates(got: Any, want: list[tuple[int, int, float]]) -> bool:
    """Same (parent, token) pairs in the same order, scores within float rounding."""
    try:
        return len(got) == len(want) and all(
            int(a[0]) == b[0] and int(a[1]) == b[1] and math.isclose(float(a[2]), b[2], rel_tol=1e-5, abs_tol=1e-5)
            for a, b in zip(got, want))
    except (TypeError, ValueError, IndexError):
        return False


def _topk_candidates(scores: torch.Tensor, k: int) -> list[tuple[int, int, float]]:
    top, index = scores.flatten().topk(k)
    return [(*divmod(i, scores.shape[-1]), s) for s, i in zip(top.tolist(), index.tolist())]


def _without_beam_scores(beam_scores: torch.Tensor, log_probs: torch.Tensor, num_beams: int) -> list[tuple[int, int, float]]:
    return _topk_candidates(log_probs, 2 * num_beams)


def _num_beams_only(beam_scores: torch.Tensor, log_probs: torch.Tensor, num_beams: int) -> list[tuple[int, int, float]]:
    return _topk_candidates(log_probs + beam_scores[:, None], num_beams)


def _divmod_swapped(beam_scores: torch.Tensor, log_probs: torch.Tensor, num_beams: int) -> list[tuple[int, int, float]]:
    return [(t, b, s) for b, t, s in _topk_candidates(log_probs + beam_scores[:, None], 2 * num_beams)]


def _fixed_share_per_beam(beam_scores: torch.Tensor, log_probs: torch.Tensor, num_beams: int) -> list[tuple[int, int, float]]:
    scores = log_probs + beam_scores[:, None]
    per_beam = [(s, b, t) for b in range(scores.shape[0])
                for s, t in zip(*(x.tolist() for x in scores[b].topk(2)))]
    return [(b, t, s) for s, b, t in sorted(per_beam, reverse=True)[: 2 * num_beams]]


BEAM_MISTAKES = [
    Mistake(_num_beams_only, "return 2 × num_beams candidates, not num_beams: the spares replace candidates that end (EOS)."),
    Mistake(
        _divmod_swapped,
        "parent and token are swapped: in the flattened [beams × vocab] scores, index // vocab is the beam and "
        "index % vocab the token (`divmod(index, vocab)`).",
    ),
    Mistake(
        _without_beam_scores,
        "add each beam's cumulative score (beam_scores[:, None] + log_probs): candidates are ranked by the log-prob "
        "of the whole sequence, not of the last token.",
    ),
    Mistake(
        _fixed_share_per_beam,
        "rank all beams' continuations together: when one beam is far ahead, every candidate may extend it. A fixed "
        "share per beam is several greedy searches side by side, not beam search.",
    ),
]

BEAM_HINTS = [
    "A candidate's score is its beam's score plus the new token's log-prob; rank every (beam, token) pair at once.",
    "scores = log_probs + beam_scores[:, None] is [beams, vocab]; flatten it and take topk(2 * num_beams).",
    "top, index = scores.flatten().topk(2 * num_beams); "
    "return [(*divmod(i, vocab), s) for s, i in zip(top.tolist(), index.tolist())]",
]


def check_beam_candidates(fn: BeamFn, hint: int = 0) -> bool:
    """``fn(beam_scores [beams], log_probs [beams, vocab], num_beams)`` -> the best ``2 * num_beams``
    ``(parent beam, token, total score)`` tuples, best first."""
    return check("beam_candidates", fn, _beam_cases(), hint=hint, hints=BEAM_HINTS, equal=same_candidates,
                 mistakes=BEAM_MISTAKES)
