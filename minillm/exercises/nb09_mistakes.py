"""The classic wrong answers to notebook 09's exercises, written out as a learner would write them.

``minillm.exercises.nb09`` pairs each one with the message that names it: when a learner's
function returns what one of these returns, the check says which mistake it is. Every function
here is wrong on purpose; the right answers are the ``*_solution`` functions of ``nb09``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from minillm.sampling import SamplingParams

_NEG_INF = -math.inf

# --- temperature ---------------------------------------------------------------------------------


def temperature_multiplies(scores: torch.Tensor, t: float) -> torch.Tensor:
    return scores * t


def temperature_after_softmax(scores: torch.Tensor, t: float) -> torch.Tensor:
    return (scores.softmax(dim=-1) / t).log()


def temperature_probabilities(scores: torch.Tensor, t: float) -> torch.Tensor:
    return (scores / t).softmax(dim=-1)


def temperature_subtracts(scores: torch.Tensor, t: float) -> torch.Tensor:
    return scores - t


# --- top-k ---------------------------------------------------------------------------------------


def top_k_exactly_k(scores: torch.Tensor, k: int) -> torch.Tensor:
    index = scores.topk(min(k, scores.shape[-1]), dim=-1).indices
    keep = torch.zeros_like(scores, dtype=torch.bool).scatter(-1, index, True)
    return scores.masked_fill(~keep, _NEG_INF)


def top_k_drops_kth(scores: torch.Tensor, k: int) -> torch.Tensor:
    kth = scores.topk(min(k, scores.shape[-1]), dim=-1).values[..., -1:]
    return scores.masked_fill(scores <= kth, _NEG_INF)


def top_k_one_threshold(scores: torch.Tensor, k: int) -> torch.Tensor:
    kth = scores.topk(min(k, scores.shape[-1]), dim=-1).values.min()
    return scores.masked_fill(scores < kth, _NEG_INF)


def top_k_smallest(scores: torch.Tensor, k: int) -> torch.Tensor:
    kth = scores.sort(dim=-1).values[..., min(k, scores.shape[-1]) - 1 :][..., :1]
    return scores.masked_fill(scores > kth, _NEG_INF)


def top_k_zero_filled(scores: torch.Tensor, k: int) -> torch.Tensor:
    kth = scores.topk(min(k, scores.shape[-1]), dim=-1).values[..., -1:]
    return scores.masked_fill(scores < kth, 0.0)


# --- top-p ---------------------------------------------------------------------------------------


def _sorted_probs(scores: torch.Tensor, descending: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    return scores.softmax(dim=-1).sort(dim=-1, descending=descending)


def _remove_sorted(scores: torch.Tensor, remove_sorted: torch.Tensor, order: torch.Tensor,
                   fill: float = _NEG_INF) -> torch.Tensor:
    return scores.masked_fill(remove_sorted.scatter(-1, order, remove_sorted), fill)


def top_p_drops_boundary(scores: torch.Tensor, p: float) -> torch.Tensor:
    sorted_p, order = _sorted_probs(scores)
    return _remove_sorted(scores, sorted_p.cumsum(-1) >= p, order)


def top_p_ascending_walk(scores: torch.Tensor, p: float) -> torch.Tensor:
    sorted_p, order = _sorted_probs(scores, descending=False)
    return _remove_sorted(scores, sorted_p.cumsum(-1) - sorted_p >= p, order)


def top_p_on_logits(scores: torch.Tensor, p: float) -> torch.Tensor:
    ranked, order = scores.sort(dim=-1, descending=True)
    return _remove_sorted(scores, ranked.cumsum(-1) - ranked >= p, order)


def top_p_unsorted(scores: torch.Tensor, p: float) -> torch.Tensor:
    probs = scores.softmax(dim=-1)
    return scores.masked_fill(probs.cumsum(-1) - probs >= p, _NEG_INF)


def top_p_all_ties_kept(scores: torch.Tensor, p: float) -> torch.Tensor:
    sorted_p, _ = _sorted_probs(scores)
    n_kept = ((sorted_p.cumsum(-1) - sorted_p) < p).sum(-1, keepdim=True)
    boundary = sorted_p.gather(-1, n_kept - 1)  # the probability of the last token the nucleus needs
    return scores.masked_fill(scores.softmax(dim=-1) < boundary, _NEG_INF)


def top_p_zero_filled(scores: torch.Tensor, p: float) -> torch.Tensor:
    sorted_p, order = _sorted_probs(scores)
    return _remove_sorted(scores, sorted_p.cumsum(-1) - sorted_p >= p, order, fill=0.0)


def top_p_probabilities(scores: torch.Tensor, p: float) -> torch.Tensor:
    sorted_p, order = _sorted_probs(scores)
    return _remove_sorted(scores, sorted_p.cumsum(-1) - sorted_p >= p, order).softmax(dim=-1)


# --- min-p ---------------------------------------------------------------------------------------


def min_p_global_max(scores: torch.Tensor, p: float) -> torch.Tensor:
    probs = scores.softmax(dim=-1)
    return scores.masked_fill(probs < p * probs.max(), _NEG_INF)


def min_p_absolute(scores: torch.Tensor, p: float) -> torch.Tensor:
    probs = scores.softmax(dim=-1)
    return scores.masked_fill(probs < p, _NEG_INF)


def min_p_on_logits(scores: torch.Tensor, p: float) -> torch.Tensor:
    return scores.masked_fill(scores < p * scores.amax(dim=-1, keepdim=True), _NEG_INF)


def min_p_at_threshold_removed(scores: torch.Tensor, p: float) -> torch.Tensor:
    probs = scores.softmax(dim=-1)
    return scores.masked_fill(probs <= p * probs.amax(dim=-1, keepdim=True), _NEG_INF)


def min_p_zero_filled(scores: torch.Tensor, p: float) -> torch.Tensor:
    probs = scores.softmax(dim=-1)
    return scores.masked_fill(probs < p * probs.amax(dim=-1, keepdim=True), 0.0)


# --- the repetition penalty ----------------------------------------------------------------------


def _sign_rule(scores: torch.Tensor, seen: list[int], penalty: float) -> torch.Tensor:
    index = torch.tensor(sorted(set(seen)), dtype=torch.long)
    old = scores[index]
    return scores.index_put((index,), torch.where(old < 0, old * penalty, old / penalty))


def _divide(scores: torch.Tensor, seen: list[int], penalty: float) -> torch.Tensor:
    index = torch.tensor(sorted(set(seen)), dtype=torch.long)
    return scores.index_put((index,), scores[index] / penalty)


def penalty_ctrl_paper(scores: torch.Tensor, prompt_ids: list[int], output_ids: list[int], penalty: float) -> torch.Tensor:
    return _divide(scores, output_ids, penalty)


def penalty_divides_negatives(scores: torch.Tensor, prompt_ids: list[int], output_ids: list[int],
                              penalty: float) -> torch.Tensor:
    return _divide(scores, prompt_ids + output_ids, penalty)


def penalty_generated_only(scores: torch.Tensor, prompt_ids: list[int], output_ids: list[int],
                           penalty: float) -> torch.Tensor:
    return _sign_rule(scores, output_ids, penalty)


def penalty_per_occurrence(scores: torch.Tensor, prompt_ids: list[int], output_ids: list[int],
                           penalty: float) -> torch.Tensor:
    counts = torch.bincount(torch.tensor(prompt_ids + output_ids, dtype=torch.long), minlength=len(scores))
    factor = penalty ** counts.to(scores.dtype)
    return torch.where(scores < 0, scores * factor, scores / factor)


def penalty_signs_swapped(scores: torch.Tensor, prompt_ids: list[int], output_ids: list[int],
                          penalty: float) -> torch.Tensor:
    return _sign_rule(scores, prompt_ids + output_ids, 1 / penalty)


# --- the batched sampler -------------------------------------------------------------------------


def _filters(scores: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Top-k, top-p and min-p in the package's order, on scores [1, vocab]."""
    from minillm.sampling import MinP, TopK, TopP

    if params.top_k > 0:
        scores = TopK(params.top_k)(None, scores)  # type: ignore[arg-type]
    if params.top_p < 1.0:
        scores = TopP(params.top_p)(None, scores)  # type: ignore[arg-type]
    if params.min_p > 0.0:
        scores = MinP(params.min_p)(None, scores)  # type: ignore[arg-type]
    return scores


def _probs(row: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The right distribution of one row [vocab]: temperature, then the filters, then softmax."""
    return _filters(row[None] / params.temperature, params).softmax(dim=-1)[0]


def _each_row(logits: torch.Tensor, params: Sequence[SamplingParams], pick) -> torch.Tensor:  # type: ignore[no-untyped-def]
    return torch.tensor([pick(row, logits[row], params[row]) for row in range(len(params))], dtype=torch.long)


def _draw(probs: torch.Tensor, generator: torch.Generator) -> int:
    return int(torch.multinomial(probs, 1, generator=generator))


def batch_shared_generator(logits: torch.Tensor, params: Sequence[SamplingParams],
                           generators: Sequence[torch.Generator]) -> torch.Tensor:
    return _each_row(logits, params, lambda r, row, p: int(row.argmax()) if p.temperature == 0
                     else _draw(_probs(row, p), generators[0]))


def batch_one_multinomial(logits: torch.Tensor, params: Sequence[SamplingParams],
                          generators: Sequence[torch.Generator]) -> torch.Tensor:
    probs = torch.stack([torch.nn.functional.one_hot(row.argmax(), row.shape[-1]).float() if p.temperature == 0
                         else _probs(row, p) for row, p in zip(logits, params)])
    return torch.multinomial(probs, 1, generator=generators[0])[:, 0]


def batch_greedy_sampled(logits: torch.Tensor, params: Sequence[SamplingParams],
                         generators: Sequence[torch.Generator]) -> torch.Tensor:
    return _each_row(logits, params, lambda r, row, p: _draw(_probs(row, p) if p.temperature > 0
                                                             else row.softmax(-1), generators[r]))


def batch_first_row_params(logits: torch.Tensor, params: Sequence[SamplingParams],
                           generators: Sequence[torch.Generator]) -> torch.Tensor:
    return batch_right(logits, [params[0]] * len(params), generators)


def batch_groups_concatenated(logits: torch.Tensor, params: Sequence[SamplingParams],
                              generators: Sequence[torch.Generator]) -> torch.Tensor:
    groups: dict[SamplingParams, list[int]] = {}
    for row, p in enumerate(params):
        groups.setdefault(p, []).append(row)
    picked = [batch_right(logits[rows], [params[r] for r in rows], [generators[r] for r in rows])
              for rows in groups.values()]
    return torch.cat(picked)


def batch_temperature_after_softmax(logits: torch.Tensor, params: Sequence[SamplingParams],
                                    generators: Sequence[torch.Generator]) -> torch.Tensor:
    def pick(r: int, row: torch.Tensor, p: SamplingParams) -> int:
        if p.temperature == 0:
            return int(row.argmax())
        probs = _filters(row[None], p).softmax(dim=-1)[0] / p.temperature
        return _draw(probs / probs.sum(), generators[r])

    return _each_row(logits, params, pick)


def batch_filters_before_temperature(logits: torch.Tensor, params: Sequence[SamplingParams],
                                     generators: Sequence[torch.Generator]) -> torch.Tensor:
    return _each_row(logits, params, lambda r, row, p: int(row.argmax()) if p.temperature == 0
                     else _draw((_filters(row[None], p) / p.temperature).softmax(-1)[0], generators[r]))


def batch_softmax_twice(logits: torch.Tensor, params: Sequence[SamplingParams],
                        generators: Sequence[torch.Generator]) -> torch.Tensor:
    return _each_row(logits, params, lambda r, row, p: int(row.argmax()) if p.temperature == 0
                     else _draw(_filters((row[None] / p.temperature).softmax(-1), p).softmax(-1)[0], generators[r]))


def batch_right(logits: torch.Tensor, params: Sequence[SamplingParams],
                generators: Sequence[torch.Generator]) -> torch.Tensor:
    """Right (the helper the wrong-row mistakes are built on): each row its params and generator."""
    return _each_row(logits, params, lambda r, row, p: int(row.argmax()) if p.temperature == 0
                     else _draw(_probs(row, p), generators[r]))


# --- stop strings --------------------------------------------------------------------------------


def stop_kept(text: str, stops: list[str]) -> tuple[str, bool]:
    hits = [(i, s) for s in stops if (i := text.find(s)) >= 0]
    if not hits:
        return text, False
    i, s = min(hits)
    return text[: i + len(s)], True


def stop_last_occurrence(text: str, stops: list[str]) -> tuple[str, bool]:
    hits = [i for i in (text.rfind(s) for s in stops) if i >= 0]
    return (text[: min(hits)], True) if hits else (text, False)


def stop_first_listed(text: str, stops: list[str]) -> tuple[str, bool]:
    for s in stops:
        if s in text:
            return text[: text.find(s)], True
    return text, False


# --- one step of beam search ---------------------------------------------------------------------


def _topk_candidates(scores: torch.Tensor, k: int) -> list[tuple[int, int, float]]:
    top, index = scores.flatten().topk(k)
    return [(*divmod(i, scores.shape[-1]), s) for s, i in zip(top.tolist(), index.tolist())]


def beam_without_beam_scores(beam_scores: torch.Tensor, log_probs: torch.Tensor,
                             num_beams: int) -> list[tuple[int, int, float]]:
    return _topk_candidates(log_probs, 2 * num_beams)


def beam_num_beams_only(beam_scores: torch.Tensor, log_probs: torch.Tensor,
                        num_beams: int) -> list[tuple[int, int, float]]:
    return _topk_candidates(log_probs + beam_scores[:, None], num_beams)


def beam_divmod_swapped(beam_scores: torch.Tensor, log_probs: torch.Tensor,
                        num_beams: int) -> list[tuple[int, int, float]]:
    return [(t, b, s) for b, t, s in _topk_candidates(log_probs + beam_scores[:, None], 2 * num_beams)]


def beam_fixed_share(beam_scores: torch.Tensor, log_probs: torch.Tensor,
                     num_beams: int) -> list[tuple[int, int, float]]:
    scores = log_probs + beam_scores[:, None]
    per_beam = [(s, b, t) for b in range(scores.shape[0]) for s, t in zip(*(x.tolist() for x in scores[b].topk(2)))]
    return [(b, t, s) for s, b, t in sorted(per_beam, reverse=True)[: 2 * num_beams]]
