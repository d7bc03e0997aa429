"""Log-probabilities: what the model thought of each token it produced (and of its rivals).

``logprobs`` in the OpenAI API report, for every generated token, ``log p(token)`` and the
``top_logprobs`` most likely tokens at that position. Which distribution ``p`` is matters: here
it is the model's own, the log-softmax of the raw logits, *before* logit_bias, a grammar mask
and the processors (temperature, top-k, ...), as vLLM reports by default. A token that a grammar
forced, or that top-k let through, still shows how likely the model found it; an evaluation
harness that scores answers by log-likelihood needs exactly these numbers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TokenLogprob:
    """One position: the token taken, its log-probability (nats) and the most likely alternatives
    as (token id, log-probability) pairs, best first."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def token_logprobs(logits: torch.Tensor, tokens: Sequence[int], k: int) -> list[TokenLogprob]:
    """For each row of ``logits`` [rows, vocab], the log-probability of ``tokens[row]`` and the
    ``k`` best tokens of that row (one log-softmax and one top-k for all rows, in float32)."""
    logp = torch.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)
    index = torch.as_tensor(list(tokens), dtype=torch.long, device=logits.device).clamp(min=0)
    chosen = logp.gather(-1, index[:, None])[:, 0].tolist()
    if k > 0:
        top_values, top_ids = logp.topk(k, dim=-1)
        tops = [tuple(zip(ids, values)) for ids, values in zip(top_ids.tolist(), top_values.tolist())]
    else:
        tops = [()] * len(tokens)
    return [TokenLogprob(int(t), lp, top) for t, lp, top in zip(tokens, chosen, tops)]
