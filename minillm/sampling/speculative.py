"""Speculative decoding's verification: several proposed tokens checked by one target forward.

A proposer (a small draft model, or prompt lookup: the n-gram that followed the last tokens
earlier in the text) guesses ``k`` tokens ``d_1..d_k``; one forward of the target model over
them gives its distributions ``p_1..p_{k+1}`` at once (position ``i`` predicts the token after
``d_{i-1}``). Which guesses to keep:

* **greedy**: keep ``d_i`` while it is the target's argmax; at the first mismatch, take the
  target's argmax instead and stop; if all ``k`` agree, the last position gives one more token
  for free. The output is exactly what greedy decoding of the target alone would give.
* **sampling** (Leviathan et al. 2023, Chen et al. 2023): keep ``d_i`` with probability
  ``min(1, p_i(d_i) / q_i(d_i))``, where ``q_i`` is the distribution the proposer drew it from;
  at the first rejection, draw from the *residual* ``max(0, p_i - q_i)`` renormalised, and stop.
  Every output token is then distributed exactly as the target's own ``p_i``: a token ``x`` comes
  out either accepted (``q(x) min(1, p(x)/q(x)) = min(q(x), p(x))``) or from the residual after a
  rejection (``(1 - sum_y min(p(y), q(y))) * (p(x) - min(p(x), q(x))) / that same mass``), and the
  two add up to ``p(x)``. A deterministic proposer (prompt lookup) has a one-hot ``q``.

Each function returns the tokens to append: between 1 and ``k + 1`` of them. ``Acceptance``
keeps a request's running estimate of how often its drafts are kept (the engine sizes ``k`` by it).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def verify_greedy(target_logits: torch.Tensor, draft_tokens: Sequence[int]) -> list[int]:
    """Tokens to append given the target's logits ``[k + 1, vocab]`` over ``k`` draft tokens."""
    _check(target_logits, draft_tokens)
    best = target_logits.argmax(dim=-1).tolist()
    out = []
    for i, token in enumerate(draft_tokens):
        if best[i] != token:
            return out + [best[i]]
        out.append(token)
    return out + [best[len(draft_tokens)]]


def verify_sampled(target_probs: torch.Tensor, draft_probs: torch.Tensor, draft_tokens: Sequence[int],
                   generator: torch.Generator | None = None) -> list[int]:
    """Tokens to append given the target's probabilities ``[k + 1, vocab]`` and the proposer's
    ``[k, vocab]`` (one-hot rows for a deterministic proposer), by the acceptance rule above."""
    _check(target_probs, draft_tokens)
    if draft_probs.shape != (len(draft_tokens), target_probs.shape[1]):
        raise ValueError(f"draft_probs must be [{len(draft_tokens)}, {target_probs.shape[1]}], "
                         f"got {tuple(draft_probs.shape)}")
    out = []
    for i, token in enumerate(draft_tokens):
        picked = accept_or_resample(target_probs[i], token, draft_probs[i], generator)
        out.append(picked)
        if picked != token:
            return out
    last = target_probs[len(draft_tokens)]
    return out + [int(torch.multinomial(last, 1, generator=generator))]


def accept_or_resample(p: torch.Tensor, token: int, q: torch.Tensor, generator: torch.Generator | None = None) -> int:
    """One position of the rule: ``token`` (drawn from ``q``) if accepted, else a draw from the
    residual (which is 0 at ``token``: a rejection is possible only where ``p(token) < q(token)``)."""
    u = torch.rand((), generator=generator, device=p.device)
    if q[token] > 0 and u * q[token] < p[token]:  # u < p/q, without dividing by a small q
        return token
    residual = (p - q).clamp(min=0)
    if residual.sum() <= 0:  # p == q: a rejection has probability 0; draw from p all the same
        residual = p
    return int(torch.multinomial(residual / residual.sum(), 1, generator=generator))


class Acceptance:
    """A request's running estimate of the chance that its next draft is kept.

    Each verification of ``j`` drafts that keeps ``a`` of them counts ``a`` kept and one
    rejected (if ``a < j``): the maximum-likelihood rate of a geometric run, with older
    verifications fading (``DECAY``) and a prior of ``PRIOR`` worth ``WEIGHT`` drafts. A step
    without drafts fades the evidence a little (``IDLE_DECAY``), so a request whose drafts were
    bad is tried again after a while: its text may have turned to copying its prompt."""

    PRIOR, WEIGHT, DECAY, IDLE_DECAY = 0.6, 2.0, 0.8, 0.97

    def __init__(self) -> None:
        self.kept = 0.0
        self.rejected = 0.0

    @property
    def rate(self) -> float:
        return (self.kept + self.PRIOR * self.WEIGHT) / (self.kept + self.rejected + self.WEIGHT)

    def update(self, proposed: int, kept: int) -> None:
        self.kept = self.kept * self.DECAY + kept
        self.rejected = self.rejected * self.DECAY + (kept < proposed)

    def idle(self) -> None:
        self.kept *= self.IDLE_DECAY
        self.rejected *= self.IDLE_DECAY


def _check(target: torch.Tensor, draft_tokens: Sequence[int]) -> None:
    if target.dim() != 2 or target.shape[0] != len(draft_tokens) + 1:
        raise ValueError(f"the target's rows must be one per draft token plus one ({len(draft_tokens) + 1}), "
                         f"got shape {tuple(target.shape)}")
