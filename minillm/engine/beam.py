"""Beam search on the paged KV cache, with transformers' rules for scores and stopping.

Greedy decoding commits to the single best token each step; beam search keeps the
``num_beams`` best *partial sequences* instead, ranked by their total log-probability. Each
step every beam proposes its continuations, the best ``2 * num_beams`` candidates over all
beams are kept, and:

* a candidate that ends in EOS (or reaches ``max_new_tokens``) and is among the top
  ``num_beams`` becomes a *finished hypothesis*, scored ``sum_logprobs / length **
  length_penalty`` (length = generated tokens; ``length_penalty > 0`` favours longer answers);
* the best ``num_beams`` unfinished candidates become the next step's beams.

The search stops when no running beam can beat the worst of ``num_beams`` finished
hypotheses (transformers' default ``early_stopping=False`` heuristic), or at the length limit.

Beams share their common prefix in the KV cache: a new beam is a ``fork`` of its parent's
sequence (no copy), and copy-on-write duplicates only a shared, partly filled last block.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from minillm.cache import PagedKVCache
from minillm.model.llama import Transformer
from minillm.sampling import SamplingParams, build_processors

_DEAD = -1.0e9  # the score transformers uses to rule a candidate out


@torch.inference_mode()
def beam_search(
    model: Transformer,
    cache: PagedKVCache,
    prompt_ids: list[int],
    params: SamplingParams,
    eos_ids: frozenset[int],
    new_seq_id: Callable[[], int],
) -> list[int]:
    """The best hypothesis's new token ids (EOS included when it ended with one)."""
    num_beams, length_penalty = params.num_beams, params.length_penalty
    processors = build_processors(SamplingParams(repetition_penalty=params.repetition_penalty))
    n_candidates = max(2, 1 + len(eos_ids)) * num_beams
    device = model.device

    root = new_seq_id()
    cache.add_sequence(root)
    owned = {root}
    try:
        logits = model(torch.tensor([prompt_ids], device=device), cache=cache.prepare([root], len(prompt_ids)), last_only=True)
        beams: list[tuple[int, list[int], float]] = [(root, [], 0.0)]  # (seq_id, new tokens, sum of log-probs)
        finished: list[tuple[float, list[int]]] = []  # (score, tokens), best first, at most num_beams
        can_improve = True
        while True:
            histories = torch.tensor([prompt_ids + tokens for _, tokens, _ in beams], device=device)
            log_probs = torch.log_softmax(logits[:, -1].float(), dim=-1)
            for processor in processors:
                log_probs = processor(histories, log_probs)
            scores = log_probs + torch.tensor([score for *_, score in beams], device=device)[:, None]
            vocab = scores.shape[-1]
            top_scores, top_indices = torch.topk(scores.flatten(), min(n_candidates, scores.numel()))
            candidates = []  # (score, parent beam, token, hits a stop rule)
            for rank, (score, index) in enumerate(zip(top_scores.tolist(), top_indices.tolist())):
                parent, token = divmod(index, vocab)
                length = len(beams[parent][1]) + 1
                stops = token in eos_ids or length >= params.max_new_tokens
                candidates.append((score, parent, token, stops, rank))

            # finished hypotheses: stopping candidates among the top num_beams, while improvement is possible
            if can_improve:
                for score, parent, token, stops, rank in candidates:
                    if stops and rank < num_beams:
                        tokens = beams[parent][1] + [token]
                        finished.append((score / (len(tokens) ** length_penalty), tokens))
                finished = sorted(finished, key=lambda item: item[0], reverse=True)[:num_beams]

            # the next beams: the best num_beams candidates that did not stop
            alive = [c for c in candidates if not c[3]][:num_beams]
            if not alive:
                break
            next_beams = []
            for score, parent, token, _, _ in alive:
                child = new_seq_id()
                cache.fork(beams[parent][0], child)
                owned.add(child)
                next_beams.append((child, beams[parent][1] + [token], score))
            for seq_id, _, _ in beams:
                cache.free_sequence(seq_id)
                owned.discard(seq_id)
            beams = next_beams

            # transformers' early-stopping heuristic (early_stopping=False)
            generated = len(beams[0][1])
            best_possible = beams[0][2] / (generated**length_penalty)
            full = len(finished) == num_beams
            can_improve = can_improve and (not full or best_possible > finished[-1][0])
            if not can_improve:
                break
            seq_ids = [seq_id for seq_id, _, _ in beams]
            step_ids = torch.tensor([[tokens[-1]] for _, tokens, _ in beams], device=device)
            logits = model(step_ids, cache=cache.prepare(seq_ids, 1), last_only=True)
        return finished[0][1] if finished else beams[0][1]
    finally:
        for seq_id in owned:
            cache.free_sequence(seq_id)
