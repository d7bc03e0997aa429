"""The scheduler's policy, tested with fakes and no torch (``scheduler.py`` is pure Python).

A fake unit scripts what the model would decide (a request that generates ``max_new`` tokens,
a beam search that forks its beams every step); a real ``BlockManager`` keeps the books; and
``_step`` plays the engine: it runs each planned forward by advancing the sequences' lengths,
as the runner does when it writes their keys and values. Each case below is one rule of the
policy; the state machine at the end runs random arrivals, steps, aborts and failed steps on
small pools and checks the laws after every step: no block leaks, no step past
``max_batch_size`` (but a lone oversized unit), no unit lost, and none starved.
"""

from __future__ import annotations

import itertools

import pytest
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from minillm.cache.block_manager import BlockManager
from minillm.engine import prefill_chunk_sizes
from minillm.engine.scheduler import ScheduledBatch, Scheduler


class FakeRequest:
    """A sampled request: one sequence; it generates ``max_new`` tokens (100, 101, ...)."""

    def __init__(self, ids: itertools.count, prompt: list[int], max_new: int) -> None:
        self.seq_id, self.prompt, self.max_new = next(ids), list(prompt), max_new
        self.output: list[int] = []
        self.aborted = False
        self.seats = 1

    @property
    def done(self) -> bool:
        return self.aborted or len(self.output) >= self.max_new

    @property
    def seq_ids(self) -> list[int]:
        return [self.seq_id]

    def start(self) -> int:
        return self.seq_id

    def prefill_tokens(self) -> list[int]:
        return (self.prompt + self.output)[:-1] if self.output else self.prompt

    def last_tokens(self) -> list[int]:
        return self.output[-1:]

    def prefix_tokens(self) -> list[int]:
        return self.prompt + self.output

    def free(self, manager: BlockManager) -> None:
        if self.seq_id in manager.block_tables:
            manager.free_sequence(self.seq_id)

    def preempt(self) -> None:
        pass

    def abort(self) -> None:
        self.aborted = self.aborted or not self.done

    def history(self, seq_id: int) -> list[int]:
        return self.prompt + self.output

    def take_step(self, manager: BlockManager) -> None:
        self.output.append(100 + len(self.output))


class FakeBeams:
    """A beam search: its prompt prefilled as one sequence, then ``width`` beams, each a fork of
    its parent every step (their shared, partly filled blocks are copied on write)."""

    def __init__(self, ids: itertools.count, prompt: list[int], max_new: int, width: int) -> None:
        self.ids, self.prompt, self.max_new, self.seats = ids, list(prompt), max_new, width
        self.beams: list[tuple[int, list[int]]] = []  # (seq_id, tokens)
        self.done = self.aborted = False

    @property
    def seq_ids(self) -> list[int]:
        return [seq_id for seq_id, _ in self.beams]

    def start(self) -> int:
        self.beams = [(next(self.ids), [])]
        return self.beams[0][0]

    def prefill_tokens(self) -> list[int]:
        return self.prompt

    def last_tokens(self) -> list[int]:
        return [tokens[-1] for _, tokens in self.beams if tokens]

    def prefix_tokens(self) -> list[int]:
        return self.prompt

    def free(self, manager: BlockManager) -> None:
        for seq_id in self.seq_ids:
            if seq_id in manager.block_tables:
                manager.free_sequence(seq_id)

    def preempt(self) -> None:
        self.beams = []

    def abort(self) -> None:
        self.aborted = self.aborted or not self.done
        self.done = True

    def history(self, seq_id: int) -> list[int]:
        return self.prompt + dict(self.beams)[seq_id]

    def take_step(self, manager: BlockManager) -> None:
        parents = self.beams * self.seats if not self.last_tokens() else self.beams
        children = []
        for seq_id, tokens in parents:
            child = next(self.ids)
            manager.fork(seq_id, child)
            children.append((child, tokens + [200 + len(tokens)]))
        self.free(manager)
        self.beams = children
        self.done = len(children[0][1]) >= self.max_new


class Boom(Exception):
    pass


def _scheduler(num_blocks: int, block_size: int = 4, max_batch_size: int = 8, chunk: int | None = None,
               prefix_caching: bool = False) -> Scheduler:
    return Scheduler(BlockManager(num_blocks, block_size, prefix_caching), max_batch_size, chunk)


def _check_batch(s: Scheduler, batch: ScheduledBatch) -> None:
    """A planned forward feeds each sequence what its cache lacks: a prompt's next chunk (within
    the budget), or a decode row's last token (its cache holds every token but that one)."""
    m = s.manager
    assert len(set(batch.seq_ids)) == len(batch.seq_ids) == len(batch.token_ids)
    if batch.is_prefill:
        assert s.prefill_chunk_tokens is None or sum(map(len, batch.token_ids)) <= s.prefill_chunk_tokens
        units = {p.seq_id: p.unit for p in s.prefilling}
        for seq_id, chunk in zip(batch.seq_ids, batch.token_ids):
            start = m.lengths[seq_id]
            assert chunk and chunk == units[seq_id].prefill_tokens()[start : start + len(chunk)]
    else:
        assert [row for _, rows in batch.outputs for row in rows] == list(range(len(batch.seq_ids)))
        for unit, rows in batch.outputs:
            for row in rows:
                history = unit.history(batch.seq_ids[row])
                assert m.lengths[batch.seq_ids[row]] == len(history) - 1 and batch.token_ids[row] == history[-1:]
    for source, destination in batch.copies:  # copy-on-write: into a block of the writer's own
        assert source != destination and m.allocator.ref_counts[destination] == 1


def _step(s: Scheduler, fail: str | None = None) -> list[ScheduledBatch]:
    """One engine step with a fake model: ``fail`` raises Boom in the first forward ("forward") or
    right after it, while the units take their step ("sample"); the units in flight are aborted."""
    batches = []
    try:
        for schedule in (s.schedule_prefill, s.schedule_decode):
            batch = schedule()
            _check_batch(s, batch)
            if batch.seq_ids:
                if fail == "forward":
                    raise Boom
                s.manager.advance(batch.seq_ids, [len(tokens) for tokens in batch.token_ids])  # the runner's part
                s.mark_computed(batch)
                if fail == "sample":
                    raise Boom
                for unit, _ in batch.outputs:
                    unit.take_step(s.manager)
            s.postprocess()
            batches.append(batch)
    except Boom:
        for unit in [p.unit for p in s.prefilling] + s.running:
            s.abort(unit)
        raise
    return batches


def _drain(s: Scheduler, bound: int) -> int:
    steps = 0
    while s.has_unfinished():
        _step(s)
        steps += 1
        assert steps <= bound, "no end: livelock or a starved unit"
    return steps


def _whole(s: Scheduler) -> bool:
    m = s.manager
    return m.allocator.num_free == m.allocator.num_blocks and not m.block_tables


# --------------------------------------------------------------------------- admission
def test_admission_stops_at_max_batch_size_and_a_beam_search_takes_all_its_seats():
    ids = itertools.count()
    s = _scheduler(64, max_batch_size=3)
    beams, first, second = FakeBeams(ids, [1, 2, 3], 4, width=2), FakeRequest(ids, [4, 5], 4), FakeRequest(ids, [6], 4)
    for unit in (beams, first, second):
        s.add(unit)
    _step(s)  # the beam search prefills one sequence, but decodes 2 rows from its first step on
    assert s.running == [beams, first] and list(s.waiting) == [second]
    _drain(s, 10)
    assert len(second.output) == 4 and _whole(s)


def test_admission_keeps_a_spare_block_per_row_and_nobody_overtakes_the_head():
    ids = itertools.count()
    s = _scheduler(10, block_size=4)
    units = [FakeRequest(ids, [7] * 8, 2) for _ in range(4)] + [FakeRequest(ids, [7], 2)]
    for unit in units:
        s.add(unit)
    batch = s.schedule_prefill()  # 2 blocks each: 2 + 1, 4 + 2, 6 + 3 = 9 <= 10; a fourth needs 8 + 4
    assert batch.seq_ids == [0, 1, 2] and list(s.waiting) == units[3:]  # the small fifth waits its turn


def test_a_request_that_finishes_in_its_prefill_leaves_room_for_the_next():
    ids = itertools.count()
    s = _scheduler(64, max_batch_size=1)
    units = [FakeRequest(ids, [i + 1], 1) for i in range(3)]
    for unit in units:
        s.add(unit)
    for done in range(1, 4):
        _step(s)
        assert [u.done for u in units] == [i < done for i in range(3)] and not s.running
    assert _whole(s)


@pytest.mark.parametrize("kind", ["wide", "long"])
def test_an_empty_batch_takes_even_an_oversized_unit(kind):
    # Wider than max_batch_size, or needing the whole pool with no spare block: alone, it is served
    # (the engine refused up front what would not fit the pool alone), and the next one after it.
    ids = itertools.count()
    if kind == "wide":
        s, make = _scheduler(64, max_batch_size=1), lambda: FakeBeams(ids, [1, 2, 3], 3, width=3)
    else:
        s, make = _scheduler(2, block_size=4), lambda: FakeRequest(ids, [1, 2, 3, 4, 5], 3)  # 8 tokens: 2 blocks
    units = [make(), make()]
    for unit in units:
        s.add(unit)
    _step(s)
    assert s.running == units[:1] and list(s.waiting) == units[1:]
    _drain(s, 10)
    assert all(u.done and not u.aborted for u in units) and _whole(s)


# --------------------------------------------------------------------------- chunked prefill
def test_prefill_chunk_sizes_fill_the_budget_in_arrival_order():
    assert prefill_chunk_sizes([5, 3, 7], 6) == [5, 1, 0]
    assert prefill_chunk_sizes([5, 3, 7], None) == [5, 3, 7]
    assert prefill_chunk_sizes([], 4) == []


def test_a_long_prompt_is_computed_within_the_budget_while_the_running_rows_decode():
    ids = itertools.count()
    s = _scheduler(64, chunk=4)
    running = FakeRequest(ids, [1, 2], 20)
    s.add(running)
    _step(s)
    long = FakeRequest(ids, list(range(10, 20)), 2)
    s.add(long)
    chunks = []
    while not long.output:
        before = len(running.output)
        prefill, decode = _step(s)
        chunks.append([len(tokens) for tokens in prefill.token_ids])
        assert running.seq_id in decode.seq_ids and len(running.output) == before + 1
    assert chunks == [[4], [4], [2]]  # and the last step samples its first token and decodes its second
    assert long.output == [100, 101]


# --------------------------------------------------------------------------- prefix caching
@pytest.mark.parametrize("prefix_caching", [False, True])
def test_a_unit_waits_for_the_prefix_a_prompt_in_flight_is_computing(prefix_caching):
    ids = itertools.count()
    s = _scheduler(64, block_size=4, chunk=4, prefix_caching=prefix_caching)
    prompt = list(range(30, 39))  # 2 full blocks and 1 token
    twin, sibling = FakeRequest(ids, prompt, 2), FakeRequest(ids, prompt, 2)
    s.add(twin)
    s.add(sibling)
    _step(s)
    if not prefix_caching:  # nothing to share: both are admitted at once
        assert [p.unit for p in s.prefilling] == [twin, sibling]
        return
    for _ in range(2):  # the twin computes block 0, then block 1: the sibling waits for each
        assert list(s.waiting) == [sibling]
        _step(s)
    assert s.cached_prompt_tokens == 8 and s.prompt_tokens == 18  # it took both blocks, computed 1 token
    _drain(s, 10)
    assert sibling.output == twin.output and _whole(s)


# --------------------------------------------------------------------------- preemption
def test_a_prompt_being_prefilled_is_preempted_before_any_running_row():
    # 7 blocks of 1 token, 1 prompt token per step: both admitted in the first step (1 + 4 prompt
    # blocks and a spare per row); the running request grows until the pool is short.
    ids = itertools.count()
    s = _scheduler(7, block_size=1, max_batch_size=2, chunk=1)
    running, prefilling = FakeRequest(ids, [7], 5), FakeRequest(ids, [1, 1, 1, 1], 1)
    s.add(running)
    s.add(prefilling)
    for _ in range(3):
        _step(s)
    assert s.preemptions == 1 and s.running == [running] and list(s.waiting) == [prefilling]
    _drain(s, 20)
    assert len(running.output) == 5 and len(prefilling.output) == 1 and _whole(s)


def test_the_newest_running_unit_is_preempted_and_recomputes_its_tokens():
    ids = itertools.count()
    s = _scheduler(5, block_size=1, max_batch_size=2)
    old, new = FakeRequest(ids, [1], 5), FakeRequest(ids, [2], 5)
    s.add(old)
    s.add(new)
    _step(s)  # both prefilled and decoded once: 4 blocks held, 1 free
    _step(s)  # 2 rows need 2 blocks: the newest goes back to the front of the queue
    assert s.preemptions == 1 and s.running == [old] and list(s.waiting) == [new]
    assert new.output == [100, 101] and new.prefill_tokens() == [2, 100]  # all but the last, which decode feeds
    _drain(s, 20)
    assert old.output == new.output == [100, 101, 102, 103, 104] and _whole(s)


# --------------------------------------------------------------------------- abort and failure
@pytest.mark.parametrize("stage", ["waiting", "prefilling", "running", "finished"])
def test_abort_at_every_stage_frees_the_unit_and_keeps_the_others(stage):
    ids = itertools.count()
    s = _scheduler(64, chunk=2, max_batch_size=2)
    victim, other = FakeRequest(ids, [1, 2, 3, 4, 5], 4), FakeRequest(ids, [6], 4)
    s.add(other)
    s.add(victim)
    steps = {"waiting": 0, "prefilling": 1, "running": 4, "finished": 7}[stage]
    for _ in range(steps):
        _step(s)
    assert victim in (list(s.waiting) if stage == "waiting" else [p.unit for p in s.prefilling]
                      if stage == "prefilling" else s.running if stage == "running" else [victim])
    s.abort(victim)
    s.abort(victim)  # twice is harmless
    assert victim.aborted == (stage != "finished") and victim not in list(s.waiting) + s.running
    _drain(s, 10)
    assert len(other.output) == 4 and not other.aborted and _whole(s)


@pytest.mark.parametrize("fail", ["forward", "sample"])
def test_a_failed_step_aborts_the_units_it_was_running_and_keeps_the_queue(fail):
    ids = itertools.count()
    s = _scheduler(64, max_batch_size=1)
    running, queued = FakeRequest(ids, [1, 2, 3], 6), FakeRequest(ids, [4, 5], 6)
    s.add(running)
    s.add(queued)
    _step(s)
    with pytest.raises(Boom):
        _step(s, fail)
    assert running.aborted and not queued.aborted and list(s.waiting) == [queued]
    _drain(s, 10)
    assert len(queued.output) == 6 and _whole(s)


def test_units_admitted_but_not_started_when_a_start_fails_keep_their_place():
    ids = itertools.count()
    s = _scheduler(64)
    first, failing, after = (FakeRequest(ids, [i], 2) for i in (1, 2, 3))
    failing.start = lambda: (_ for _ in ()).throw(Boom())  # type: ignore[method-assign]
    for unit in (first, failing, after):
        s.add(unit)
    with pytest.raises(Boom):
        s.schedule_prefill()
    assert [p.unit for p in s.prefilling] == [first] and list(s.waiting) == [failing, after]
    s.abort(failing)
    _drain(s, 10)
    assert first.output == after.output == [100, 101] and _whole(s)


# --------------------------------------------------------------------------- random streams
class SchedulerMachine(RuleBasedStateMachine):
    """Random arrivals (requests and beam searches, prompts sharing prefixes), steps, aborts and
    failed steps, on small pools: preemption, prefix holds and eviction all happen."""

    @initialize(block_size=st.sampled_from([1, 1, 2, 4]), num_blocks=st.integers(3, 32), batch=st.integers(1, 4),
                chunk=st.sampled_from([None, None, 1, 2, 3, 5]), prefix_caching=st.booleans())
    def setup(self, block_size, num_blocks, batch, chunk, prefix_caching):
        self.s = _scheduler(num_blocks, block_size, batch, chunk, prefix_caching)
        self.ids = itertools.count()
        self.units: list[FakeRequest | FakeBeams] = []

    @rule(base=st.sampled_from([[5, 6, 7, 8, 9, 10, 11, 12], [5, 6, 7, 8, 1, 2]]), cut=st.integers(0, 8),
          tail=st.lists(st.integers(1, 3), max_size=3), max_new=st.integers(1, 10), width=st.sampled_from([1, 1, 2, 3]),
          n=st.integers(1, 3))
    def add(self, base, cut, tail, max_new, width, n):
        """``n`` units with one prompt (the engine's ``n`` completions), arriving together."""
        prompt = base[:cut] + tail or [4]
        m = self.s.manager
        # the engine refuses up front what cannot fit the pool alone (beams: a copy-on-write block each too)
        if width * m.blocks_for_tokens(len(prompt) + max_new) * (2 if width > 1 else 1) > m.allocator.num_blocks:
            return
        for _ in range(n):
            unit = FakeRequest(self.ids, prompt, max_new) if width == 1 else FakeBeams(self.ids, prompt, max_new, width)
            self.units.append(unit)
            self.s.add(unit)

    @rule(steps=st.integers(1, 3))
    def step(self, steps):
        for _ in range(steps):
            _step(self.s)

    @rule(how=st.sampled_from(["abort", "abort", "forward", "sample"]), i=st.integers(0, 30))
    def interrupt(self, how, i):
        """A caller aborts a unit, or a step fails (in the model's forward, or the sampler)."""
        if how == "abort" and self.units:
            self.s.abort(self.units[i % len(self.units)])
        elif how != "abort":
            try:
                _step(self.s, how)
            except Boom:
                pass

    @invariant()
    def books_balance(self):
        m = self.s.manager
        counts = [0] * m.allocator.num_blocks
        for table in m.block_tables.values():
            for block in table:
                counts[block] += 1
        assert counts == m.allocator.ref_counts  # no block leaked, none freed twice
        held = {seq_id for p in self.s.prefilling for seq_id in p.unit.seq_ids}
        held |= {seq_id for unit in self.s.running for seq_id in unit.seq_ids}
        assert set(m.block_tables) == held  # only the units in flight hold blocks

    @invariant()
    def batch_fits(self):
        units = [p.unit for p in self.s.prefilling] + self.s.running
        assert sum(u.seats for u in units) <= self.s.max_batch_size or len(units) == 1

    @invariant()
    def no_unit_lost(self):
        queued = [id(u) for u in self.s.waiting] + [id(p.unit) for p in self.s.prefilling]
        queued += [id(u) for u in self.s.running]
        assert len(queued) == len(set(queued))
        assert {id(u) for u in self.units if not u.done} == set(queued)

    def teardown(self):
        if not hasattr(self, "s"):
            return
        pending = [u for u in self.units if not u.done]
        _drain(self.s, 10 + 2 * sum(len(u.prompt) + u.max_new * u.seats for u in pending))  # linear: nobody starves
        event(f"preempted: {self.s.preemptions > 0}")
        event(f"took cached prefix blocks: {self.s.cached_prompt_tokens > 0}")
        event(f"beam searches: {any(isinstance(u, FakeBeams) for u in self.units)}")
        for unit in self.units:
            generated = unit.output if isinstance(unit, FakeRequest) else unit.beams[0][1] if unit.beams else []
            assert unit.aborted or len(generated) == unit.max_new  # everyone not aborted ran to its end
        assert _whole(self.s)


TestSchedulerMachine = SchedulerMachine.TestCase
TestSchedulerMachine.settings = settings(max_examples=300, stateful_step_count=40, deadline=None)
