"""Scoring a prompt: the log-probability of each of its tokens given the ones before it.

What ``echo`` + ``logprobs`` return on ``/v1/completions``, and what evaluation harnesses
(lm-evaluation-harness's ``local-completions``) sum to score a multiple-choice answer:
``log p(answer | question)`` is the sum of the answer tokens' log-probabilities. Generation
needs only the last position's logits; scoring needs every position's, so it runs its own
forward: the prompt in chunks through a contiguous KV cache (notebook 07), each chunk's
[chunk, vocab] logits turned into log-probabilities and dropped before the next, so the memory
is one chunk's logits, not the prompt's.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from minillm.cache import ContiguousKVCache
from minillm.model.llama import Transformer
from minillm.sampling import TokenLogprob, token_logprobs

SCORE_CHUNK_TOKENS = 256


@torch.inference_mode()
def prompt_logprobs(model: Transformer, prompt_ids: Sequence[int], top: int = 0,
                    chunk: int = SCORE_CHUNK_TOKENS) -> list[TokenLogprob | None]:
    """``log p(prompt_ids[i] | prompt_ids[:i])`` for every i, with the ``top`` best tokens at each
    position; None for the first token, which nothing predicts (as in the OpenAI API)."""
    ids = list(prompt_ids)
    if not ids:
        return []
    cache = ContiguousKVCache(model.config, 1, len(ids), model.device, model.dtype)
    scored: list[TokenLogprob | None] = [None]
    for start in range(0, len(ids) - 1, chunk):
        piece = ids[start:start + chunk]
        mask = torch.ones(1, start + len(piece), dtype=torch.long, device=model.device)
        logits = model(torch.tensor([piece], device=model.device), attention_mask=mask, cache=cache)[0]
        targets = ids[start + 1:start + 1 + len(piece)]  # position j predicts token j + 1
        scored += token_logprobs(logits[: len(targets)], targets, top)
    return scored
