"""Constrained decoding as a logits processor with per-request state (notebook 13, step 5).

Each constrained request carries a ``GrammarState``: where it stands in the DFA. Before a
token is drawn, every disallowed token's score becomes ``-inf`` (so softmax gives it exactly 0
and argmax never picks it); after the token is drawn, ``advance(token)`` moves the state. The
index (``token_index``) is shared by every request with the same pattern; the state is one int.

How it is meant to be wired into the sampler (a later change: ``minillm.sampling`` will import
this module, never the reverse)::

    # the pattern (or schema, as JSON text) can be a field of the frozen, hashable
    # SamplingParams; the state, which changes every token, belongs in SamplingState:
    # minillm/sampling: SamplingState gains  grammar: GrammarState | None
    #   SamplingState.record(token)  ->  also  self.grammar.advance(token)  when it has one
    # sample_batch(logits, states):
    #   rows = [r for r, s in enumerate(states) if s.grammar is not None]
    #   scores = apply_grammar(logits.float(), rows, [states[r].grammar for r in rows])
    #   ... then the parameter groups, processors and draws exactly as today

    # the engine builds the state when it admits a request with a pattern or schema:
    #   GrammarState(token_index(pattern, tokenizer, eos_ids=<the request's stop ids>))
    # n > 1 completions and beams fork it with .copy(); speculative decoding undoes rejected
    # drafted tokens with .rollback(k); a finished state allows only eos.

The mask is applied *before* the processors on purpose: temperature, top-k, top-p and min-p
then work on the distribution restricted to what the grammar allows (a top-k of 5 keeps the 5
best *allowed* tokens), and an ``-inf`` stays ``-inf`` through every one of them. One
function masks all constrained rows of the batch with a single host-to-device copy.

A state from which the vocabulary cannot continue (the pattern needs a byte that no token
has, say) allows nothing: ``is_dead_end`` says so, and the engine should end that request with
an error instead of sampling from a row of ``-inf``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

from minillm.structured.dfa import DEAD
from minillm.structured.index import TokenIndex


class GrammarState:
    """One request's position in its grammar: the DFA state after the tokens so far."""

    def __init__(self, index: TokenIndex) -> None:
        self.index = index
        self.state = index.start
        self.finished = False  # an end-of-sequence token was accepted
        self._history: list[tuple[int, bool]] = []  # (state, finished) before each token, for rollback

    def allowed(self) -> np.ndarray:
        """Boolean mask [vocab_size] of the tokens allowed next (only eos once finished)."""
        if self.finished:
            mask = np.zeros(self.index.vocab_size, dtype=bool)
            mask[self.index.eos_ids] = True
            return mask
        return self.index.allowed(self.state)

    def allowed_ids(self) -> np.ndarray:
        return np.flatnonzero(self.allowed())

    @property
    def is_accepting(self) -> bool:
        """Whether the output so far is a whole match (the request may end here)."""
        return self.index.is_accepting(self.state)

    @property
    def is_dead_end(self) -> bool:
        """No token is allowed: the vocabulary cannot spell any continuation of the pattern."""
        return not self.finished and not self.index.next_states(self.state).any()

    def advance(self, token_id: int) -> None:
        """Move past ``token_id``; a ValueError if the grammar does not allow it."""
        if self.finished:
            if int(token_id) in self.index.eos_set:
                return
            raise ValueError(f"token {token_id} after the end of the constrained output")
        nxt = self.index.next_state(self.state, int(token_id))
        if nxt == DEAD:
            raise ValueError(f"token {token_id} is not allowed by the grammar in state {self.state}")
        self._history.append((self.state, self.finished))
        self.finished = int(token_id) in self.index.eos_set
        self.state = nxt

    def rollback(self, n: int = 1) -> None:
        """Undo the last ``n`` tokens (speculative decoding rejects drafted tokens)."""
        if not 0 <= n <= len(self._history):
            raise ValueError(f"cannot roll back {n} tokens: only {len(self._history)} were advanced")
        for _ in range(n):
            self.state, self.finished = self._history.pop()

    def copy(self) -> GrammarState:
        """An independent state at the same position (for n > 1 completions or beams)."""
        other = GrammarState(self.index)
        other.state, other.finished, other._history = self.state, self.finished, list(self._history)
        return other

    def __repr__(self) -> str:
        return f"GrammarState(state={self.state}, accepting={self.is_accepting}, finished={self.finished})"


def grammar_mask(grammars: Sequence[GrammarState], vocab: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The allowed tokens of each state, as a bool tensor [len(grammars), vocab] on ``device``.

    ``vocab`` is the width of the logits, which may exceed the tokenizer's vocabulary (models
    pad their embedding to a multiple of 64 or 128): the ids past it are never allowed. Each
    state's mask is cached by its index, so a step costs one stack and one copy.
    """
    rows = np.stack([grammar.allowed() for grammar in grammars]) if grammars else np.zeros((0, vocab), dtype=bool)
    if rows.shape[1] != vocab:
        rows = np.pad(rows[:, :vocab], ((0, 0), (0, max(0, vocab - rows.shape[1]))))
    return torch.from_numpy(rows).to(device)


def apply_grammar(scores: torch.Tensor, rows: Sequence[int], grammars: Sequence[GrammarState]) -> torch.Tensor:
    """``scores`` [batch, vocab] with every token the grammar of row ``rows[i]`` (``grammars[i]``)
    disallows set to ``-inf``; the other rows are untouched. Returns a new tensor (the input,
    often the model's logits buffer, is not modified); the input itself when ``rows`` is empty."""
    if len(rows) != len(grammars):
        raise ValueError(f"{len(rows)} rows but {len(grammars)} grammar states")
    if not rows:
        return scores
    allowed = grammar_mask(grammars, scores.shape[-1], scores.device)
    if list(rows) == list(range(scores.shape[0])):  # every row constrained: one op, no gather
        return scores.masked_fill(~allowed, -math.inf)
    index = torch.tensor(list(rows), dtype=torch.long, device=scores.device)
    out = scores.clone()
    out[index] = out[index].masked_fill(~allowed, -math.inf)
    return out
