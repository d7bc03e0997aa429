"""Beam search as a planner of the engine's step, with transformers' rules for scores and stopping.

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

A ``BeamSearch`` owns no loop: the engine's scheduler runs its beams as rows of the same
batched decode step as every other request, and hands each step's logits back to
``advance``. Beams share their common prefix in the KV cache: a new beam is a ``fork`` of its
parent's sequence (no copy), and copy-on-write duplicates only a shared, partly filled block.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from minillm.cache.block_manager import BlockManager
from minillm.engine.sequence import SequenceGroup
from minillm.sampling import RepetitionPenalty, SamplingParams

_DEAD = -1.0e9  # the score transformers uses to rule a candidate out


class BeamSearch(SequenceGroup):
    """The state of one prompt's beam search: its running beams and finished hypotheses. As a
    unit of scheduling it prefills its prompt as one sequence, then decodes ``num_beams`` rows."""

    def __init__(self, prompt_ids: list[int], params: SamplingParams, eos_ids: frozenset[int],
                 new_seq_id: Callable[[], int]) -> None:
        self.prompt_ids = prompt_ids
        self.params = params
        self.eos_ids = eos_ids
        self.new_seq_id = new_seq_id
        self.n_candidates = max(2, 1 + len(eos_ids)) * params.num_beams
        self.restart()

    def restart(self) -> None:
        """Back to the prompt alone (also after a preemption: the search is deterministic, so
        running it again gives the same beams)."""
        self.beams: list[tuple[int, list[int], float]] = []  # (seq_id, new tokens, sum of log-probs)
        self.finished: list[tuple[float, list[int]]] = []  # (score, tokens), best first, at most num_beams
        self.can_improve = True
        self.done = self.params.max_new_tokens == 0
        self.error: str | None = None  # why the search could not go on (its logits held NaN)

    @property
    def seats(self) -> int:
        return self.params.num_beams

    @property
    def seq_ids(self) -> list[int]:
        return [seq_id for seq_id, _, _ in self.beams]

    def start(self) -> int:
        """A fresh root sequence for the prompt's prefill."""
        root = self.new_seq_id()
        self.beams = [(root, [], 0.0)]
        return root

    def prefill_tokens(self) -> list[int]:
        return self.prompt_ids

    def last_tokens(self) -> list[int]:
        return [tokens[-1] for _, tokens, _ in self.beams if tokens]

    def prefix_tokens(self) -> list[int]:
        return self.prompt_ids

    def preempt(self) -> None:
        self.restart()

    def abort(self) -> None:
        self.done = True

    def advance(self, logits: torch.Tensor, manager: BlockManager) -> None:
        """One search step from the beams' next-token logits [beams, vocab]: keep the best
        candidates, fork the beams they extend, free the rest; set ``done`` when it ends."""
        num_beams, length_penalty = self.params.num_beams, self.params.length_penalty
        log_probs = torch.log_softmax(logits.float(), dim=-1)
        if torch.isnan(log_probs).any():  # this search alone ends; the rest of the batch goes on
            self.error = f"the model's logits hold NaN ({int(torch.isnan(logits).sum())} of {logits.numel()})"
            self.free(manager)
            self.beams, self.finished, self.done = [], [], True
            return
        if self.params.repetition_penalty != 1.0:
            histories = torch.tensor([self.prompt_ids + tokens for _, tokens, _ in self.beams], device=logits.device)
            log_probs = RepetitionPenalty(self.params.repetition_penalty)(histories, log_probs)
        scores = log_probs + torch.tensor([score for *_, score in self.beams], device=logits.device)[:, None]
        vocab = scores.shape[-1]
        top_scores, top_indices = torch.topk(scores.flatten(), min(self.n_candidates, scores.numel()))
        candidates = []  # (score, parent beam, token, hits a stop rule, rank)
        for rank, (score, index) in enumerate(zip(top_scores.tolist(), top_indices.tolist())):
            parent, token = divmod(index, vocab)
            length = len(self.beams[parent][1]) + 1
            stops = token in self.eos_ids or length >= self.params.max_new_tokens
            candidates.append((score, parent, token, stops, rank))

        # finished hypotheses: stopping candidates among the top num_beams, while improvement is possible
        if self.can_improve:
            for score, parent, token, stops, rank in candidates:
                if stops and rank < num_beams:
                    tokens = self.beams[parent][1] + [token]
                    self.finished.append((score / (len(tokens) ** length_penalty), tokens))
            self.finished = sorted(self.finished, key=lambda item: item[0], reverse=True)[:num_beams]

        # the next beams: the best num_beams candidates that did not stop
        alive = [c for c in candidates if not c[3]][:num_beams]
        next_beams = []
        for score, parent, token, _, _ in alive:
            child = self.new_seq_id()
            manager.fork(self.beams[parent][0], child)
            next_beams.append((child, self.beams[parent][1] + [token], score))
        self.free(manager)
        self.beams = next_beams
        if not alive:
            self.done = True
            return

        # transformers' early-stopping heuristic (early_stopping=False)
        generated = len(self.beams[0][1])
        best_possible = self.beams[0][2] / (generated**length_penalty)
        full = len(self.finished) == num_beams
        self.can_improve = self.can_improve and (not full or best_possible > self.finished[-1][0])
        self.done = not self.can_improve

    def free(self, manager: BlockManager) -> None:
        """Hand every running beam's blocks back."""
        for seq_id, _, _ in self.beams:
            if seq_id in manager.block_tables:
                manager.free_sequence(seq_id)

    def best(self, n: int) -> list[list[int]]:
        """The ``n`` best hypotheses' new token ids (EOS included when one ended with it),
        topped up with the best running beams when fewer than ``n`` finished."""
        ranked = [tokens for _, tokens in self.finished]
        ranked += [tokens for _, tokens, _ in self.beams]
        return ranked[:n]
