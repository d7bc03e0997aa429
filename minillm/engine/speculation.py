"""Speculative decoding in the engine: who proposes drafts, and how many are worth verifying.

Before each decode step the engine asks its *proposer* for a few tokens that may follow each
speculating request's text (``Drafts``), and the scheduler plans a *verify* step: each such
request is fed its last token and its drafts, a row per token, in the same forward as every
other running row (``Scheduler.schedule_decode``). The engine then keeps, position by position,
the drafts the target agrees with (``sampling.speculative``'s rule, inside the one sampler) and
rolls the cache back past the rejected ones (``Scheduler.rollback``). Proposers:

* ``PromptLookup``: the tokens that followed the text's last n-gram earlier in the prompt or
  the answer (``proposers.prompt_lookup``). Free, and deterministic: its ``q`` is one-hot, so
  a sampled row simply draws its token as usual and keeps the draft when they agree — the same
  draws, from the same random stream, as without speculation.
* ``DraftModel`` (``draft.py``): a smaller or more quantized model with the same tokenizer.

Whether a draft pays depends on the backend: a decode step with ``n`` rows costs ``t(n)``,
nearly ``t(1)`` where the step streams float weights once, about ``n`` times it where packed
4-bit kernels pay per row. ``StepCosts`` measures ``t`` as the engine runs (the whole decode
phase: proposing, the forward, the sampler); the ``j``-th draft of a request is kept with
probability ``a**j`` (``a``: that request's measured acceptance rate,
``sampling.speculative.Acceptance``); ``plan_drafts`` takes the number of drafts, most likely
first, that gives the step the most expected tokens per second, ``E(n) / t(rows + n)``.
Speculation that does not pay therefore switches itself
off (an open-ended answer rarely repeats its prompt), and a request that stopped speculating
drifts back to the prior rate and tries again later.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from minillm.engine.proposers import prompt_lookup
from minillm.engine.request import Request
from minillm.engine.sequence import SequenceGroup

MAX_SPECULATIVE_TOKENS = 32  # drafts per request per step; past ~8 the chance of keeping them all is slim


@dataclass
class Drafts:
    """Tokens proposed after a request's last one, and the distribution each was drawn from
    (``probs`` [len(tokens), vocab]; None for a deterministic proposer: one-hot)."""

    tokens: list[int]
    probs: torch.Tensor | None = None


class Proposer(Protocol):
    name: str
    free: bool  # proposing costs nothing worth planning for: propose first, plan after

    def propose(self, requests: Sequence[Request], counts: Sequence[int]) -> list[Drafts]:
        """Up to ``counts[i]`` tokens that may follow ``requests[i]``'s text so far."""
        ...

    def seconds_per_draft(self) -> float:
        """What one more drafted token costs the proposer (0 for a free one)."""
        ...


class PromptLookup:
    """Drafts copied from the text itself: what followed the last ``n``-gram where it occurred
    before (``n`` from ``max_ngram`` down to ``min_ngram``). One-token matches are mostly chance,
    so the default looks for two."""

    name = "prompt-lookup"
    free = True

    def __init__(self, max_ngram: int = 3, min_ngram: int = 2) -> None:
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def propose(self, requests: Sequence[Request], counts: Sequence[int]) -> list[Drafts]:
        return [Drafts(prompt_lookup(r.all_ids, n, self.max_ngram, self.min_ngram) if n > 0 else [])
                for r, n in zip(requests, counts)]

    def seconds_per_draft(self) -> float:
        return 0.0


class StepCosts:
    """Seconds a decode step takes by its number of rows, as measured: the median of the last
    few steps of each row count (the first of each is skipped: it may have compiled code).
    Between measured counts the cost is interpolated, past them extrapolated along the last
    slope; with a single count measured, every count is assumed to cost the same (optimism
    that makes the engine try a verify step and so measure one)."""

    def __init__(self, keep: int = 16) -> None:
        self._seconds: dict[int, deque[float]] = {}
        self._seen: set[int] = set()
        self._keep = keep

    def record(self, rows: int, seconds: float) -> None:
        if rows not in self._seen:
            self._seen.add(rows)
            return
        self._seconds.setdefault(rows, deque(maxlen=self._keep)).append(seconds)

    def __call__(self, rows: int) -> float | None:
        known = sorted(self._seconds)
        if not known:
            return None
        if rows in self._seconds:
            return statistics.median(self._seconds[rows])
        below, above = [n for n in known if n < rows], [n for n in known if n > rows]
        if below and above:
            (n0, t0), (n1, t1) = (below[-1], self(below[-1])), (above[0], self(above[0]))
        elif len(known) == 1:
            return self(known[0])
        else:
            n0, n1 = (known[-2], known[-1]) if below else (known[0], known[1])
            t0, t1 = self(n0), self(n1)
        assert t0 is not None and t1 is not None
        slope = max(0.0, (t1 - t0) / (n1 - n0))
        return max(1e-9, t0 + slope * (rows - n0))


def plan_drafts(rates: Sequence[float], caps: Sequence[int], rows: int, cost: Callable[[int], float | None],
                seconds_per_draft: float = 0.0) -> list[int]:
    """How many drafts each request verifies this step: the drafts most likely to be kept
    first, as many of them as give the step the most expected tokens per second. ``rows`` is the
    step without drafts (one token each, for sure); ``caps[i]`` the most request ``i`` may take.

    Every prefix of that order is weighed, not only the next draft: a step's cost can jump (a
    kernel that takes rows four at a time), so a draft that does not pay alone may pay with the
    two after it."""
    candidates = sorted(((rate ** j, -j, i) for i, (rate, cap) in enumerate(zip(rates, caps))
                         for j in range(1, cap + 1)), reverse=True)
    base = cost(rows)
    expected, best, best_rate = float(rows), 0, None
    for n, (value, _, _) in enumerate(candidates, start=1):
        if value <= 0:
            break
        expected += value
        seconds = cost(rows + n)
        if base is None or seconds is None:  # nothing measured yet: optimism, which measures it
            best = n
            continue
        rate = expected / (seconds + n * seconds_per_draft)
        if best_rate is None:
            best_rate = rows / base
        if rate > best_rate:
            best, best_rate = n, rate
    counts = [0] * len(rates)
    for _, _, i in candidates[:best]:
        counts[i] += 1
    return counts


@dataclass
class SpeculationStats:
    """What speculation did in an engine: ``verifications`` (a request verifying its drafts in
    a step), drafts ``proposed`` and ``accepted``."""

    verifications: int = 0
    proposed: int = 0
    accepted: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Drafts kept per verification (each verification also yields one token of its own)."""
        return self.accepted / self.verifications if self.verifications else 0.0


class Speculator:
    """The engine's speculative decoding: its proposer, at most ``k`` drafts per request and
    step, the measured step costs and acceptance rates that decide how many (``adaptive``), and
    the counts."""

    def __init__(self, proposer: Proposer, k: int, adaptive: bool = True) -> None:
        self.proposer = proposer
        self.k = k
        self.adaptive = adaptive  # False: always verify up to k drafts (benchmarks of a fixed k, tests)
        self.costs = StepCosts()
        self.stats = SpeculationStats()

    def drafts(self, running: Sequence[SequenceGroup], max_position: int) -> dict[int, Drafts]:
        """Drafts for the speculating requests among the ``running`` units (sequence id ->
        drafts), as many as pay: never past a request's ``max_new_tokens`` (its last token comes
        from the target) nor past ``max_position``."""
        requests = [u for u in running if isinstance(u, Request) and u.acceptance is not None and not u.done]
        if not requests:
            return {}
        caps = [max(0, min(self.k, r.params.max_new_tokens - len(r.output_ids) - 1,
                           max_position - len(r.all_ids))) for r in requests]
        proposer = self.proposer
        found = proposer.propose(requests, caps) if proposer.free else None
        if found is not None:
            caps = [len(d.tokens) for d in found]
        rows = sum(len(u.seq_ids) for u in running)
        counts = caps if not self.adaptive else plan_drafts(
            [r.acceptance.rate for r in requests], caps, rows, self.costs,  # type: ignore[union-attr]
            proposer.seconds_per_draft())
        if found is None:
            found = proposer.propose(requests, counts)
        out = {}
        for request, drafts, n in zip(requests, found, counts):
            if n == 0 or not drafts.tokens:
                request.acceptance.idle()  # type: ignore[union-attr]
                continue
            out[request.seq_id] = Drafts(drafts.tokens[:n], None if drafts.probs is None else drafts.probs[:n])
        return out

    def settle(self, request: Request, proposed: int, kept: int) -> None:
        """Count a verification: ``kept`` of the request's ``proposed`` drafts were accepted."""
        assert request.acceptance is not None
        request.acceptance.update(proposed, kept)
        self.stats.verifications += 1
        self.stats.proposed += proposed
        self.stats.accepted += kept
