"""Logits processors: small, composable rewrites of the next-token scores.

The model hands the sampler one row of logits per sequence, ``scores`` [batch, vocab]. Before
a token is picked, a chain of processors reshapes that row. Each one fixes a specific failure
of sampling straight from the model's softmax:

==================  ==========================================================================
processor           the failure it fixes
==================  ==========================================================================
RepetitionPenalty   loops: a small model that said "the the the" finds "the" likelier still
Temperature         too random (or too timid): one knob that sharpens or flattens everything
TopK                the long tail: thousands of individually unlikely tokens that together
                    get drawn surprisingly often, each one a chance to derail the text
TopP                top-k's fixed k: a confident step needs 2 candidates, an open one 200;
                    the nucleus adapts k to the shape of the distribution
MinP                top-p at high temperature: a flattened tail needs hundreds of junk tokens
                    to reach p; min-p cuts relative to the top token's probability instead
==================  ==========================================================================

Filtering never renormalizes by hand: a removed token's logit becomes ``-inf``, and the
softmax that follows gives it probability exactly 0 and spreads the rest over the survivors.

Every processor has the signature and semantics of transformers' ``LogitsProcessor``:
``processor(input_ids [batch, seq], scores [batch, vocab]) -> new scores``, never modifying its
input in place (the caller may still need the raw logits, e.g. for log-probabilities). The
tests compare each one with its transformers counterpart bit for bit, ties included.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from minillm.sampling.params import SamplingParams

_NEG_INF = -math.inf


class LogitsProcessor(Protocol):
    """Anything that maps ``(input_ids [batch, seq], scores [batch, vocab])`` to new scores."""

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor: ...


def _check_min_tokens_to_keep(value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"min_tokens_to_keep must be an int >= 1, got {value!r}")


@dataclass(frozen=True)
class RepetitionPenalty:
    """Make every token already in the sequence (prompt *and* output) less likely.

    Small models fall into loops: once a phrase is repeated, attention to the repetition makes
    the next repeat even likelier. The CTRL paper divides the logit of every token already
    *generated* by ``penalty``; plain division *raises* a negative logit (towards 0), so
    transformers (and llama.cpp, and this class) divide positive logits and multiply negative
    ones: both moves push the logit *down* for penalty > 1. As in transformers for decoder-only
    models, every token of ``input_ids`` counts, the prompt included, and a token counts once
    however often it occurred. (OpenAI's presence and frequency penalties are different rules:
    they *subtract* a constant, or a constant times the count, over the generated tokens.)

    Ids >= vocab size are ignored, which also makes them usable as padding when rows have
    histories of different lengths (a real pad token id *would* be penalized).
    """

    penalty: float

    def __post_init__(self) -> None:
        if not self.penalty > 0:  # also catches NaN
            raise ValueError(f"repetition penalty must be > 0, got {self.penalty}")

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if input_ids.shape[0] != scores.shape[0]:
            raise ValueError(f"input_ids has {input_ids.shape[0]} rows but scores has {scores.shape[0]}")
        return self.apply_seen(seen_tokens(input_ids, scores.shape[-1], scores.device), scores)

    def apply_seen(self, seen: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        """The same penalty given the "seen" flags [batch, vocab] directly: an engine keeps them
        up to date one token at a time instead of rebuilding them from the history each step."""
        penalized = torch.where(scores < 0, scores * self.penalty, scores / self.penalty)
        return torch.where(seen, penalized, scores)


def seen_tokens(input_ids: torch.Tensor, vocab_size: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """One "seen" flag per (row, vocab id) [batch, vocab], set by a single scatter: no Python
    loop over the history. Out-of-range ids are clamped into an extra column that is cut off."""
    seen = torch.zeros(input_ids.shape[0], vocab_size + 1, dtype=torch.bool, device=device)
    seen.scatter_(1, input_ids.to(device=device, dtype=torch.long).clamp(max=vocab_size), True)
    return seen[:, :vocab_size]


@dataclass(frozen=True)
class Temperature:
    """Divide the logits by ``temperature``: below 1 sharpens, above 1 flattens.

    softmax(z / t) keeps the *order* of the tokens but changes how far apart their
    probabilities are: as t -> 0 all mass goes to the top token (greedy), as t -> infinity
    the distribution becomes uniform. t = 0 itself would divide by zero, so greedy decoding is
    a separate rule (argmax) rather than a temperature.
    """

    temperature: float

    def __post_init__(self) -> None:
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0 (use greedy decoding for 0), got {self.temperature}")

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        return scores / self.temperature


@dataclass(frozen=True)
class TopK:
    """Keep the ``k`` highest logits (plus any tied with the k-th), set the rest to -inf.

    The cheapest cure for the long tail. The cut is a *threshold* (the k-th largest value),
    not a count, so tokens tied with the k-th one all survive and more than k tokens may be
    kept: which of several equal tokens to drop would otherwise be an arbitrary choice.
    ``min_tokens_to_keep`` raises k when needed (beam search wants spare candidates).
    """

    k: int
    min_tokens_to_keep: int = 1

    def __post_init__(self) -> None:
        if isinstance(self.k, bool) or not isinstance(self.k, int) or self.k < 1:
            raise ValueError(f"top_k must be an int >= 1, got {self.k!r}")
        _check_min_tokens_to_keep(self.min_tokens_to_keep)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        k = min(max(self.k, self.min_tokens_to_keep), scores.shape[-1])
        kth_largest = torch.topk(scores, k).values[..., -1:]
        return scores.masked_fill(scores < kth_largest, _NEG_INF)


@dataclass(frozen=True)
class TopP:
    """Nucleus sampling: keep the smallest set of top tokens whose probability reaches ``p``.

    Sort the tokens from most to least likely and walk down the list adding probabilities;
    the token whose probability makes the running total reach ``p`` is the last one *kept*.
    Dropping that boundary token (a classic bug) can leave a set with less than ``p`` of the
    mass, or nothing at all when a single token holds more than ``p``.

    The computation runs the other way round, as transformers does: sort *ascending* and
    remove the tail whose cumulative mass is <= 1 - p. Whatever is left then has mass >= p,
    and the boundary token stays because removing it would make the tail heavier than 1 - p.

    Ties: tokens with equal logits are ordered by the sort, so at the boundary one of two
    equal tokens may be kept and the other dropped. We use exactly transformers' sort call so
    the choice is the same.
    """

    p: float
    min_tokens_to_keep: int = 1

    def __post_init__(self) -> None:
        if not 0 < self.p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.p}")
        _check_min_tokens_to_keep(self.min_tokens_to_keep)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        ascending, order = torch.sort(scores, descending=False)
        tail_mass = ascending.softmax(dim=-1).cumsum(dim=-1)
        remove_sorted = tail_mass <= 1 - self.p
        remove_sorted[..., -self.min_tokens_to_keep :] = False  # the most likely ones always stay
        # Back from sorted positions to vocabulary ids: position j of row r is token order[r, j].
        remove = remove_sorted.scatter(1, order, remove_sorted)
        return scores.masked_fill(remove, _NEG_INF)


@dataclass(frozen=True)
class MinP:
    """Keep tokens whose probability is at least ``p`` times the most likely token's.

    A cut that scales with the model's confidence. With p = 0.1: when the top token has
    probability 0.6, anything under 0.06 goes; when the distribution is flat (top at 0.02),
    tokens down to 0.002 survive, so open-ended steps keep their options. Top-p struggles at
    high temperature: the flattened tail holds so much mass that reaching p takes hundreds of
    junk tokens. Min-p asks only how each token compares with the best one, however much mass
    the tail holds. Applied after temperature, so the threshold is measured on the
    distribution that is actually sampled.
    """

    p: float
    min_tokens_to_keep: int = 1

    def __post_init__(self) -> None:
        if not 0 <= self.p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.p}")
        _check_min_tokens_to_keep(self.min_tokens_to_keep)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        probs = scores.softmax(dim=-1)
        threshold = self.p * probs.amax(dim=-1, keepdim=True)
        remove = probs < threshold
        keep = torch.topk(probs, min(self.min_tokens_to_keep, probs.shape[-1]), dim=-1).indices
        remove = remove.scatter(-1, keep, False)
        return scores.masked_fill(remove, _NEG_INF)


def build_processors(params: SamplingParams) -> list[LogitsProcessor]:
    """The processors ``params`` asks for, in transformers' order (inactive ones left out).

    The repetition penalty comes first: it edits raw logits and applies to every decoding rule.
    The rest only shape a distribution to *draw* from, so they apply only when sampling; for
    greedy or beam search they could not change the argmax anyway (temperature keeps the
    order, the filters never drop the top token). Temperature precedes the filters, so top-p
    and min-p measure mass on the sharpened/flattened distribution that is actually sampled.
    """
    processors: list[LogitsProcessor] = []
    if params.repetition_penalty != 1.0:
        processors.append(RepetitionPenalty(params.repetition_penalty))
    if params.do_sample:
        if params.temperature != 1.0:
            processors.append(Temperature(params.temperature))
        if params.top_k > 0:
            processors.append(TopK(params.top_k))
        if params.top_p < 1.0:
            processors.append(TopP(params.top_p))
        if params.min_p > 0.0:
            processors.append(MinP(params.min_p))
    return processors


def apply_processors(
    processors: list[LogitsProcessor], input_ids: torch.Tensor, scores: torch.Tensor
) -> torch.Tensor:
    """Run ``scores`` through each processor in turn."""
    for processor in processors:
        scores = processor(input_ids, scores)
    return scores
