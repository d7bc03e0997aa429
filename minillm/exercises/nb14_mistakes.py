"""The classic wrong answers of notebook 14's exercises, written as a learner would write them.

``minillm.exercises.nb14`` names each one when a learner's answer equals its result.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


# ------------------------------------------------------------------ the residual distribution
def residual_not_clamped(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    r = p - q
    return r / r.sum()


def residual_not_renormalised(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    return (p - q).clamp(min=0)


def residual_q_minus_p(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    r = (q - p).clamp(min=0)
    return r / r.sum()


def residual_is_p(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    return p.clone()


# ------------------------------------------------------------------ greedy verification
def no_bonus_token(target_logits: torch.Tensor, draft: Sequence[int]) -> list[int]:
    best = target_logits.argmax(-1).tolist()
    out = []
    for i, token in enumerate(draft):
        if best[i] != token:
            return out + [best[i]]
        out.append(token)
    return out


def no_correction(target_logits: torch.Tensor, draft: Sequence[int]) -> list[int]:
    best = target_logits.argmax(-1).tolist()
    out = []
    for i, token in enumerate(draft):
        if best[i] != token:
            return out
        out.append(token)
    return out + [best[len(draft)]]


def continues_after_mismatch(target_logits: torch.Tensor, draft: Sequence[int]) -> list[int]:
    best = target_logits.argmax(-1).tolist()
    out = []
    for i, token in enumerate(draft):
        out.append(token if best[i] == token else best[i])  # corrects, and goes on checking
    return out + [best[len(draft)]]


def row_off_by_one(target_logits: torch.Tensor, draft: Sequence[int]) -> list[int]:
    best = target_logits.argmax(-1).tolist()
    out = []
    for i, token in enumerate(draft):
        if best[i + 1] != token:  # row i + 1 taken as the prediction for draft i
            return out + [best[i + 1]]
        out.append(token)
    return out + [best[len(draft)]]


# ------------------------------------------------------------------ the expected tokens per step
def expected_linear(alpha: float, k: int) -> float:
    return 1 + k * alpha


def expected_drafts_only(alpha: float, k: int) -> float:
    return sum(alpha**i for i in range(1, k + 1))


def expected_k_terms(alpha: float, k: int) -> float:
    return sum(alpha**i for i in range(k))
