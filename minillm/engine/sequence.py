"""What the scheduler schedules: a *sequence group*, in pure Python (no torch).

A sampled request is one KV-cache sequence; a beam search is one sequence while its prompt is
prefilled, then ``num_beams`` of them, forked from each other. The scheduler admits, runs,
preempts and retires either as one unit, and asks it only what this protocol says: how many
batch rows it takes, which sequences it holds, which tokens a prefill puts in the cache. So
``scheduler.py`` has no case for "a request" or "a beam search", and a new kind of unit (a
speculative proposal, a grammar-constrained request) is one more class that implements it.
"""

from __future__ import annotations

from typing import Protocol

from minillm.cache.block_manager import BlockManager


class SequenceGroup(Protocol):
    """A unit of scheduling: the sequences of one request, admitted and retired together."""

    done: bool  # nothing more to generate (finished, for any reason, or aborted)

    @property
    def seats(self) -> int:
        """The batch rows it decodes once admitted (a beam search: ``num_beams``, from its first
        step on, although its prompt is prefilled as one sequence)."""

    @property
    def seq_ids(self) -> list[int]:
        """The KV-cache sequences it holds now, one decode row each (none before ``start``)."""

    def start(self) -> int:
        """Take the sequence its prefill computes (admission); returns its id."""

    def prefill_tokens(self) -> list[int]:
        """The tokens its prefill puts in the cache: the prompt; after a preemption, a request's
        prompt and every token it had generated but the last (the next decode step feeds it)."""

    def last_tokens(self) -> list[int]:
        """The token each row feeds to the next decode step; empty while it has generated
        nothing, when its prompt's last logits give it its first step instead."""

    def prefix_tokens(self) -> list[int]:
        """The token ids its blocks hold that later prompts may share (prefix caching): a
        request's prompt and output; a beam search's prompt (past it, beams diverge)."""

    def free(self, manager: BlockManager) -> None:
        """Hand the blocks of every sequence it holds back to the pool."""

    def preempt(self) -> None:
        """Its blocks were taken back: go back to the state its next prefill recomputes."""

    def abort(self) -> None:
        """End now (finish reason ``"abort"``); a no-op once done."""
