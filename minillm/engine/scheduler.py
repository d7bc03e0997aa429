"""The scheduler: which sequences each engine step computes, in pure Python (no torch).

A step has two forwards, and the scheduler plans each one:

1. **admit** waiting units while there is room in the batch and in the block pool (it *asks*
   the ``BlockManager``), and plan one packed prefill over the next chunk of every prompt being
   computed (``schedule_prefill``). With prefix caching a prompt first takes the cached blocks of
   its longest known prefix and computes only the rest; with ``prefill_chunk_tokens`` at most
   that many prompt tokens are computed per step, so a long prompt is spread over several steps
   instead of stalling everyone's next token. A prompt now complete takes its first step from
   the prefill's logits and joins the running batch, in time for this very step's decode;
2. **decode** one token for every running row in one batched step (``schedule_decode``): the
   rows have different lengths, and each reads its own keys through its block table;
3. after each forward, **retire** finished units at once (``postprocess``), handing their
   blocks back, so a waiting unit can join on the very next step.

That last point is *continuous batching*: the batch is refilled token by token instead of
waiting for its slowest member, which is why throughput scales with the number of requests. A
request that finishes during its prefill (one new token, a stop string, EOS first) simply
leaves room for the next admission.

If a decode step finds the pool short, the most recently admitted unit is *preempted*: its
blocks are freed and it goes back to the front of the queue, to be prefilled again (prompt and
tokens so far) when room returns. Its output is unchanged, only recomputed.

No tensors and no model here: a unit is a ``SequenceGroup`` (a request, or a beam search's
beams) and a forward is a ``ScheduledBatch``, which the engine runs (tested with fakes in
``tests/10_engine_on_gpu/test_scheduler.py``).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from minillm.cache.block_manager import BlockManager
from minillm.engine.sequence import SequenceGroup


@dataclass
class Prefill:
    """An admitted unit whose prompt is being computed: its sequence, and the tokens still to go."""

    unit: SequenceGroup
    seq_id: int
    tokens: list[int]
    pending_keys: list[int]  # prefix keys of the full blocks it computes (with prefix caching)


@dataclass
class ScheduledBatch:
    """One forward planned for the engine: a packed prefill, or a decode step.

    Row ``i`` feeds ``token_ids[i]`` to sequence ``seq_ids[i]`` (a prompt chunk, or the one token
    a decode row feeds, then any drafted ones); ``outputs`` are the units that take their next step from this forward's
    logits, each with its rows; ``copies`` are the blocks to copy (copy-on-write) before it runs.
    """

    is_prefill: bool
    seq_ids: list[int] = field(default_factory=list)
    token_ids: list[list[int]] = field(default_factory=list)
    outputs: list[tuple[SequenceGroup, range]] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)

    @property
    def verifies(self) -> bool:
        """A decode step that feeds drafted tokens (speculative decoding): logits at every token."""
        return not self.is_prefill and any(len(tokens) > 1 for tokens in self.token_ids)


class Scheduler:
    """The queues (``waiting``, ``prefilling``, ``running``) and the policy that moves units along.

    Each engine step: ``schedule_prefill``, run it, ``mark_computed``, the units take their step,
    ``postprocess``; then the same with ``schedule_decode``, planned only now, as a prompt
    completed in this step decodes in it too, fed the token its prefill gave. The runner
    advances the sequences' lengths in the ``BlockManager`` as it writes them.
    """

    def __init__(self, manager: BlockManager, max_batch_size: int, prefill_chunk_tokens: int | None = None) -> None:
        self.manager = manager
        self.max_batch_size = max_batch_size
        self.prefill_chunk_tokens = prefill_chunk_tokens
        self.waiting: deque[SequenceGroup] = deque()  # in arrival order (preempted ones go back to the front)
        self.prefilling: list[Prefill] = []  # admitted, their prompts being computed chunk by chunk
        self.running: list[SequenceGroup] = []  # holding KV blocks, decoded every step
        self.preemptions = 0  # units sent back to the queue because the pool ran out
        self.prompt_tokens = 0  # prompt tokens admitted (recomputed ones of preempted units too)
        self.cached_prompt_tokens = 0  # of those, found in the prefix cache instead of computed

    def add(self, unit: SequenceGroup) -> None:
        self.waiting.append(unit)

    def abort(self, unit: SequenceGroup) -> None:
        """End a unit now: out of the queue or the batch (by identity), its blocks freed; an
        unfinished one ends as aborted, a finished one keeps its result (a failed step frees
        this way the units it was running, also one that finished in it before it could retire)."""
        self.waiting = deque(u for u in self.waiting if u is not unit)
        self.prefilling = [p for p in self.prefilling if p.unit is not unit]
        self.running = [u for u in self.running if u is not unit]
        unit.free(self.manager)
        unit.abort()

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.prefilling or self.running)

    # ------------------------------------------------------------------ a step
    def schedule_prefill(self) -> ScheduledBatch:
        """Admit what fits, give each newcomer its blocks, and plan the packed prefill of the next
        chunk of every prompt being computed, within the step's token budget (all of them whole
        without one)."""
        batch = ScheduledBatch(is_prefill=True)
        admitted = self._admit()
        for i, unit in enumerate(admitted):
            try:
                batch.copies += self._start(unit)
            except BaseException:  # the units not started yet keep their place; a failed step aborts the rest
                started = {id(p.unit) for p in self.prefilling}
                self.waiting.extendleft(reversed([u for u in admitted[i:] if id(u) not in started]))
                raise
        sizes = prefill_chunk_sizes([len(p.tokens) for p in self.prefilling], self.prefill_chunk_tokens)
        for prefill, n in zip(self.prefilling, sizes):
            if n == 0:
                continue
            if n == len(prefill.tokens) and not prefill.unit.last_tokens():  # its prompt's last logits
                batch.outputs.append((prefill.unit, range(len(batch.seq_ids), len(batch.seq_ids) + 1)))
            batch.seq_ids.append(prefill.seq_id)
            batch.token_ids.append(prefill.tokens[:n])
        return batch

    def schedule_decode(self, drafts: Mapping[int, Sequence[int]] | None = None) -> ScheduledBatch:
        """Reserve room for every running row (preempting the newest while the pool is short) and
        plan one decode row per sequence, fed its last token.

        ``drafts`` (speculative decoding: sequence id -> tokens a proposer guessed after its last
        one) make it a *verify* step: such a sequence is fed its last token and its drafts, a row
        per token, and reserves a slot for each. Drafts are a bonus: if the pool cannot hold them
        all, the step drops them rather than preempt anyone."""
        batch = ScheduledBatch(is_prefill=False)
        if not self.running:
            return batch
        batch.copies, drafts = self._reserve_or_preempt(drafts or {})
        row = 0  # (a row of logits per token: a sequence with drafts takes several)
        for unit in self.running:
            first = row
            for seq_id, token in zip(unit.seq_ids, unit.last_tokens()):
                batch.seq_ids.append(seq_id)
                batch.token_ids.append([token, *drafts.get(seq_id, ())])
                row += len(batch.token_ids[-1])
            batch.outputs.append((unit, range(first, row)))
        return batch

    def rollback(self, unit: SequenceGroup, seq_id: int, length: int) -> None:
        """After a verify step: keep the first ``length`` tokens of ``seq_id`` (the accepted
        drafts), hand back the slots of the rejected ones (no copy), and with prefix caching key
        the blocks that are now full of accepted tokens."""
        self.manager.truncate(seq_id, length)
        if self.manager.has_unkeyed_full_blocks(seq_id):
            self.manager.cache_full_blocks(seq_id, unit.prefix_tokens())

    def mark_computed(self, batch: ScheduledBatch) -> None:
        """The forward wrote its tokens: each prompt moves past its chunk, and with prefix caching
        the blocks that filled get their keys, so later prompts with the same prefix reuse them.
        (Before the units take their step: a beam search's first step frees its prompt's sequence.)"""
        if batch.is_prefill:
            units = []
            by_seq = {p.seq_id: p for p in self.prefilling}
            for seq_id, chunk in zip(batch.seq_ids, batch.token_ids):
                prefill = by_seq[seq_id]
                prefill.tokens = prefill.tokens[len(chunk) :]
                units.append((prefill.unit, [seq_id]))
        else:  # (a unit that verified drafts is keyed once they are settled: ``rollback``)
            units = [(unit, unit.seq_ids) for unit, rows in batch.outputs if len(rows) == len(unit.seq_ids)]
        for unit, seq_ids in units:
            for seq_id in seq_ids:  # (building the ids copies them: only when a block filled)
                if self.manager.has_unkeyed_full_blocks(seq_id):
                    self.manager.cache_full_blocks(seq_id, unit.prefix_tokens())

    def postprocess(self) -> None:
        """After the units took their step: the completed prompts join the running batch, and
        finished units retire, their blocks back in the pool. (The completed prompts leave
        ``prefilling`` only now: had their step failed, the engine still finds them to abort.)"""
        self.running += [p.unit for p in self.prefilling if not p.tokens]
        self.prefilling = [p for p in self.prefilling if p.tokens]
        for unit in self.running:
            if unit.done:
                unit.free(self.manager)
        self.running = [u for u in self.running if not u.done]

    # ------------------------------------------------------------------ the policy
    def _admit(self) -> list[SequenceGroup]:
        """Pop waiting units while the batch has rows and the pool has blocks for their prompts,
        keeping one spare block per row so the next decode step does not force a preemption. An
        empty batch takes the first unit whatever its size: alone it has the whole pool, which
        is enough (the engine refuses larger requests up front), and nobody is there to preempt.
        So every step has work, and the oldest unit always progresses.

        With prefix caching, a unit whose next uncached block is being computed right now by a
        prompt in flight (admitted earlier, or just before it in this step) waits, keeping its
        place in the queue: once that block is computed and cached it reuses it instead of
        computing the same prefix a second time. This is how ``n > 1`` completions of one
        prompt, and many clients arriving together with one system prompt, share its blocks.
        """
        waiting, manager = self.waiting, self.manager
        admitted: list[SequenceGroup] = []
        held: list[SequenceGroup] = []  # waiting for a prefix in flight; back to the front of the queue
        in_flight = {key for prefill in self.prefilling for key in prefill.pending_keys}
        rows = sum(len(u.seq_ids) for u in self.running) + sum(p.unit.seats for p in self.prefilling)
        blocks = 0
        while waiting:
            unit = waiting[0]
            tokens = unit.prefill_tokens()
            unit_blocks = manager.blocks_for_tokens(len(tokens))
            if rows + unit.seats > self.max_batch_size and rows:  # an empty batch takes even an oversized unit
                break
            if blocks + unit_blocks + rows + unit.seats > manager.allocator.num_free and rows:
                break  # (an empty batch has the whole pool, and the engine let in only units that fit it)
            waiting.popleft()
            if manager.prefix_caching:
                uncached = manager.uncached_keys(tokens)
                if uncached and uncached[0] in in_flight:
                    held.append(unit)
                    continue
                in_flight.update(uncached)
            admitted.append(unit)
            rows += unit.seats
            blocks += unit_blocks
        waiting.extendleft(reversed(held))
        return admitted

    def _start(self, unit: SequenceGroup) -> list[tuple[int, int]]:
        """Give an admitted unit its sequence and the blocks for its whole prompt (reusing cached
        prefix blocks), and queue the prompt tokens still to compute; returns the block copies
        its reservation needs (a fully cached prompt writes into its last, shared block)."""
        prefill = Prefill(unit, unit.start(), unit.prefill_tokens(), [])
        self.prefilling.append(prefill)  # (first: if what follows fails, the failed step finds it)
        tokens = prefill.tokens
        cached = self.manager.add_sequence(prefill.seq_id, tokens)  # > 0 only with prefix caching
        self.prompt_tokens += len(tokens)
        self.cached_prompt_tokens += cached
        if self.manager.prefix_caching:
            prefill.pending_keys = self.manager.uncached_keys(tokens)
        prefill.tokens = tokens[cached:]
        return self.manager.reserve([prefill.seq_id], [len(tokens) - cached])

    def _reserve_or_preempt(self, drafts: Mapping[int, Sequence[int]] | None = None
                            ) -> tuple[list[tuple[int, int]], Mapping[int, Sequence[int]]]:
        """Reserve one token for every running row (and a slot per draft, if they all fit),
        preempting the newest until it fits; returns the block copies and the drafts kept.

        The newest are the prompts still being prefilled (chunked prefill): each holds the blocks
        of its whole prompt from admission on, for as many steps as its chunks take, while the
        running rows keep growing; so they go back to the queue first, newest first. A single
        running unit left alone always fits (the engine refuses any request larger than the
        pool), so each step decodes at least one unit and the engine always makes progress.
        """
        if drafts:
            seq_ids = [s for unit in self.running for s in unit.seq_ids]
            counts = [1 + len(drafts.get(s, ())) for s in seq_ids]
            if self.manager.can_reserve(seq_ids, counts):
                return self.manager.reserve(seq_ids, counts), drafts
        while True:
            seq_ids = [s for unit in self.running for s in unit.seq_ids]
            alone = len(self.running) == 1 and not self.prefilling
            if alone or self.manager.can_reserve(seq_ids, [1] * len(seq_ids)):
                return self.manager.reserve(seq_ids, [1] * len(seq_ids)), {}
            victim = self.prefilling.pop().unit if self.prefilling else self.running.pop()  # the most recent arrival
            victim.free(self.manager)
            victim.preempt()
            self.waiting.appendleft(victim)
            self.preemptions += 1


def prefill_chunk_sizes(remaining: Sequence[int], budget: int | None) -> list[int]:
    """How many prompt tokens each prompt being prefilled computes this step: in arrival order,
    each takes what it still needs while the step's ``budget`` lasts (``prefill_chunk_tokens``),
    so one prompt may get a partial chunk and the ones after it wait (0); with no budget (None)
    every prompt is computed whole. The budget counts prompt tokens only: every running request
    also decodes its one token each step, whatever the budget."""
    left = math.inf if budget is None else budget
    sizes = []
    for n in remaining:
        take = int(min(n, left))
        sizes.append(take)
        left -= take
    return sizes
