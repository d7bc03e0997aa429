"""Exercises of notebook 09 about decoding (re-exported by ``nb09``): a batched sampler with a
seeded generator per row, cutting at a stop string, and one step of beam search.

The batched sampler is checked against ``minillm.sampling.sample_batch`` drawing from the same
seeds; the stop strings against what the engine's ``StopStringFilter`` shows. Beam search keeps
its candidate step inside ``BeamSearch.advance``, so its cases are small enough to check by hand,
plus one ranked by brute force over every (beam, token) pair. The classic mistakes are written
out in ``nb09_mistakes``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from minillm.engine import StopStringFilter
from minillm.exercises import Mistake, check
from minillm.exercises import nb09_mistakes as wrong
from minillm.sampling import (MinP, SamplingParams, SamplingState, Temperature, TopK, TopP, make_generator,
                              sample_batch)

BatchFn = Callable[[torch.Tensor, Sequence[SamplingParams], Sequence[torch.Generator]], torch.Tensor]
StopFn = Callable[[str, list[str]], tuple[str, bool]]
BeamFn = Callable[[torch.Tensor, torch.Tensor, int], list[tuple[int, int, float]]]

_NEG_INF = -math.inf


# --- the batched sampler -------------------------------------------------------------------------


class SeededGenerators(list):
    """One ``torch.Generator`` per row, each seeded with its own seed. ``fresh()`` builds the same
    list anew, so the learner's function and each classic mistake start from the same random state."""

    def __init__(self, seeds: Sequence[int]) -> None:
        super().__init__(make_generator(seed) for seed in seeds)
        self.seeds = list(seeds)

    def fresh(self) -> SeededGenerators:
        return SeededGenerators(self.seeds)

    def __repr__(self) -> str:
        return f"[{len(self.seeds)} generators, seeds {self.seeds}]"


def _package_batch(logits: torch.Tensor, params: Sequence[SamplingParams], seeds: Sequence[int]) -> torch.Tensor:
    """What the engine draws: ``minillm.sampling.sample_batch``, each row with its own seeded state."""
    states = [SamplingState(p, [], logits.shape[-1], make_generator(seed)) for p, seed in zip(params, seeds)]
    return sample_batch(logits, states)


def _batch_cases() -> list[tuple[tuple[torch.Tensor, list[SamplingParams], SeededGenerators], torch.Tensor]]:
    g = torch.Generator().manual_seed(9)
    a = SamplingParams(temperature=0.5, top_p=0.9)
    b = SamplingParams(temperature=1.5, top_k=50)
    c = SamplingParams(temperature=1.0, min_p=0.02)
    d = SamplingParams(temperature=1.6, top_p=0.5)  # hot and narrow: the order of temperature and top-p matters
    greedy = SamplingParams()
    masked = torch.randn(3, 300, generator=g) * 1.5
    masked[:, ::3] = _NEG_INF  # tokens an earlier mask (a grammar, say) removed
    inputs = [
        ((torch.randn(1, 300, generator=g) * 1.5).expand(8, -1).clone(), [a] * 8, list(range(11, 19))),  # one row 8 times
        (torch.randn(5, 300, generator=g) * 1.5, [a, greedy, b, c, greedy], [21, 22, 23, 24, 25]),  # mixed
        (torch.randn(6, 300, generator=g) * 1.5, [a, b, a, b, greedy, d], [31, 32, 33, 34, 35, 36]),  # interleaved
        (masked, [c, d, b], [41, 42, 43]),
        (torch.randn(6, 300, generator=g) * 2, [d, d, d, a, a, a], [51, 52, 53, 54, 55, 56]),
    ]
    return [((logits, params, SeededGenerators(seeds)), _package_batch(logits, params, seeds))
            for logits, params, seeds in inputs]


def _fresh(wrong_batch: BatchFn) -> Callable[..., torch.Tensor]:
    """A classic mistake run from the same random state as the learner's function."""
    return lambda logits, params, generators: wrong_batch(logits, params, generators.fresh())


_SHARED = ("one generator shared by all rows: every row must draw from its *own* generator (generators[row]), so "
           "a request with a seed gets the same tokens whoever else is in the batch.")

BATCH_MISTAKES = [
    Mistake(_fresh(wrong.batch_shared_generator), _SHARED),
    Mistake(_fresh(wrong.batch_one_multinomial), _SHARED + " One torch.multinomial over the whole batch draws "
            "every row from generators[0]."),
    Mistake(_fresh(wrong.batch_greedy_sampled), "greedy rows were sampled: a row with temperature 0 takes the argmax "
            "of its logits and draws nothing."),
    Mistake(_fresh(wrong.batch_first_row_params), "per-row params applied to the wrong row: every row used "
            "params[0]; row r is shaped by params[r]."),
    Mistake(_fresh(wrong.batch_groups_concatenated), "per-row params applied to the wrong row: you sampled the rows "
            "grouped by their params and concatenated the groups, so tokens came back in group order. Put each "
            "token back at its own row."),
    Mistake(_fresh(wrong.batch_temperature_after_softmax), "the temperature did nothing: you divided probabilities by "
            "t after the softmax, which the renormalisation cancels. Divide the logits, before the filters and the "
            "softmax."),
    Mistake(_fresh(wrong.batch_filters_before_temperature), "wrong order: your filters ran before the temperature "
            "(llama.cpp's order). The package divides by t first, so top-p and min-p measure the distribution that "
            "is actually sampled."),
    Mistake(_fresh(wrong.batch_softmax_twice), "you softmaxed twice: the filters take logits (the softmax comes "
            "once, at the end); filtering probabilities and renormalising them with a second softmax flattens the "
            "distribution."),
]

BATCH_HINTS = [
    "Row r uses params[r] and generators[r], nothing else. Temperature 0 means argmax; otherwise divide by the "
    "temperature, then top-k, top-p, min-p (those that are on), softmax, and draw.",
    "For a sampled row: scores = logits[r:r+1] / p.temperature; then your filters when p.top_k > 0, p.top_p < 1, "
    "p.min_p > 0, in that order; token = torch.multinomial(scores.softmax(-1)[0], 1, generator=generators[r]).",
    "tokens = torch.empty(len(params), dtype=torch.long); for r, (p, g) in enumerate(zip(params, generators)): "
    "tokens[r] = logits[r].argmax() if p.temperature == 0 else torch.multinomial(<filtered scores>.softmax(-1)[0], "
    "1, generator=g)[0]; return tokens",
]


def check_sample_batch(fn: BatchFn, hint: int = 0) -> bool:
    """``fn(logits [rows, vocab], params [rows], generators [rows])`` -> one token per row (a LongTensor [rows]),
    the tokens ``minillm.sampling.sample_batch`` draws from the same seeds: greedy and sampled rows mixed, each
    sampled row with its own params and its own generator."""
    return check("sample_batch", fn, _batch_cases(), hint=hint, hints=BATCH_HINTS, mistakes=BATCH_MISTAKES)


def sample_batch_solution(logits: torch.Tensor, params: Sequence[SamplingParams],
                          generators: Sequence[torch.Generator]) -> torch.Tensor:
    tokens = torch.empty(len(params), dtype=torch.long)
    for row, (p, generator) in enumerate(zip(params, generators)):
        if p.temperature == 0:  # greedy: nothing is drawn, the generator is not touched
            tokens[row] = logits[row].argmax()
            continue
        # The package's processors here; the notebook's exercises are the same four functions.
        scores = Temperature(p.temperature)(None, logits[row : row + 1])  # first: the filters see this distribution
        if p.top_k > 0:
            scores = TopK(p.top_k)(None, scores)
        if p.top_p < 1.0:
            scores = TopP(p.top_p)(None, scores)
        if p.min_p > 0.0:
            scores = MinP(p.min_p)(None, scores)
        tokens[row] = torch.multinomial(scores.softmax(dim=-1)[0], 1, generator=generator)[0]  # this row's stream
    return tokens


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


STOP_MISTAKES = [
    Mistake(wrong.stop_kept, "cut *before* the stop string: it never reaches the user (OpenAI and vLLM semantics)."),
    Mistake(wrong.stop_last_occurrence, "cut at the *first* occurrence (`find`, not `rfind`): nothing after a stop "
            "string may be shown."),
    Mistake(wrong.stop_first_listed, "the earliest occurrence in the text wins, whichever stop string it is, not the "
            "first one listed."),
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


def cut_at_stop_solution(text: str, stops: list[str]) -> tuple[str, bool]:
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return (text[: min(hits)], True) if hits else (text, False)


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


BEAM_MISTAKES = [
    Mistake(wrong.beam_num_beams_only, "return 2 × num_beams candidates, not num_beams: the spares replace "
            "candidates that end (EOS)."),
    Mistake(
        wrong.beam_divmod_swapped,
        "parent and token are swapped: in the flattened [beams × vocab] scores, index // vocab is the beam and "
        "index % vocab the token (`divmod(index, vocab)`).",
    ),
    Mistake(
        wrong.beam_without_beam_scores,
        "add each beam's cumulative score (beam_scores[:, None] + log_probs): candidates are ranked by the log-prob "
        "of the whole sequence, not of the last token.",
    ),
    Mistake(
        wrong.beam_fixed_share,
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


def beam_candidates_solution(beam_scores: torch.Tensor, log_probs: torch.Tensor,
                             num_beams: int) -> list[tuple[int, int, float]]:
    scores = log_probs + beam_scores[:, None]  # [beams, vocab]: the whole sequence's log-prob
    top, index = scores.flatten().topk(2 * num_beams)
    return [(*divmod(i, scores.shape[-1]), s) for s, i in zip(top.tolist(), index.tolist())]
