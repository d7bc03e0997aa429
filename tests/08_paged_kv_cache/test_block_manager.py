"""The paged cache's bookkeeping (notebooks 08 and 12), tested without tensors: this file imports
no torch (``tests/package/test_import_graph.py`` runs it with torch unimportable).

Random operation streams (hypothesis) check the laws after every step: reference counts are the
block tables' holdings, no block leaks or is freed twice, keys name their own prefix, and a
prefix hit is only ever a block that holds the same tokens.
"""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, rule

from minillm.cache.block_manager import BlockAllocator, BlockContents, BlockManager, OutOfBlocksError


def _invariants(m: BlockManager, tokens: dict[int, list[int]]) -> None:
    a = m.allocator
    counts = [0] * a.num_blocks
    for seq, table in m.block_tables.items():
        for b in table:
            counts[b] += 1
        # every key a sequence holds names its own prefix, block for block
        assert m.keys[seq] == m.prefix_keys(tokens[seq])[: len(m.keys[seq])]
        for b, key in zip(table, m.keys[seq]):
            assert a.key_of.get(b, key) == key
    assert counts == a.ref_counts
    assert a.num_free + sum(1 for c in counts if c) == a.num_blocks
    assert all(a.ref_counts[b] == 0 and b in a.key_of for b in a.evictable)
    assert all(a.ref_counts[b] == 0 and b not in a.key_of for b in a.free_list)
    assert {k: b for b, k in a.key_of.items()} == a.block_of


prompts = st.lists(st.sampled_from([1, 2, 3]), min_size=1, max_size=14)


@settings(max_examples=150, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(["add", "grow", "speculate", "free"]), prompts, st.integers(0, 15)),
                   max_size=40),
       num_blocks=st.integers(2, 12), block_size=st.integers(1, 4))
def test_the_prefix_cache_bookkeeping_never_leaks_or_mixes_prefixes(ops, num_blocks, block_size):
    m = BlockManager(num_blocks, block_size, prefix_caching=True)
    tokens: dict[int, list[int]] = {}
    next_id = 0
    for op, prompt, n in ops:
        if op == "add":
            seq = next_id
            next_id += 1
            cached = m.add_sequence(seq, prompt)
            tokens[seq] = list(prompt)
            assert 0 <= cached < len(prompt) and m.lengths[seq] == cached
            assert len(m.block_tables[seq]) * block_size >= cached
            if not m.can_reserve([seq], [len(prompt) - cached]):
                m.free_sequence(seq)
                del tokens[seq]
            else:
                m.reserve([seq], [len(prompt) - cached])
                m.advance([seq], [len(prompt) - cached])
                m.cache_full_blocks(seq, tokens[seq])
        elif op == "grow" and tokens:
            seq = sorted(tokens)[n % len(tokens)]
            if m.can_reserve([seq], [1]):
                m.reserve([seq], [1])
                m.advance([seq], [1])
                tokens[seq].append(prompt[0])
                m.cache_full_blocks(seq, tokens[seq])
        elif op == "speculate" and tokens:  # a verify step writes k drafted tokens, then keeps a prefix
            seq = sorted(tokens)[n % len(tokens)]
            k = 1 + n % 4
            if m.can_reserve([seq], [k]):
                m.reserve([seq], [k])
                m.advance([seq], [k])
                drafted = tokens[seq] + (list(prompt) * k)[:k]
                m.cache_full_blocks(seq, drafted)
                kept = len(tokens[seq]) + (n // 4) % (k + 1)
                m.truncate(seq, kept)
                tokens[seq] = drafted[:kept]
                assert m.lengths[seq] == kept and len(m.block_tables[seq]) == math.ceil(kept / block_size)
        elif op == "free" and tokens:
            seq = sorted(tokens)[n % len(tokens)]
            m.free_sequence(seq)
            del tokens[seq]
        _invariants(m, tokens)
    for seq in list(tokens):
        m.free_sequence(seq)
    assert m.allocator.num_free == num_blocks


def test_truncate_frees_the_blocks_past_the_kept_tokens_and_refuses_growth():
    m = BlockManager(8, 4)
    m.add_sequence(0)
    m.reserve([0], [10])
    m.advance([0], [10])
    assert len(m.block_tables[0]) == 3 and m.allocator.num_free == 5
    m.truncate(0, 5)
    assert m.lengths[0] == 5 and len(m.block_tables[0]) == 2 and m.allocator.num_free == 6
    m.truncate(0, 0)
    assert m.block_tables[0] == [] and m.allocator.num_free == 8
    with pytest.raises(ValueError, match="cannot truncate sequence 0 of 0 tokens to 1"):
        m.truncate(0, 1)


def test_a_prompt_reuses_the_blocks_of_its_cached_prefix_and_computes_at_least_one_token():
    m = BlockManager(8, 4, prefix_caching=True)
    first = [5, 6, 7, 8, 9, 10, 11, 12, 13]
    assert m.add_sequence(0, first) == 0
    m.reserve([0], [9])
    m.advance([0], [9])
    m.cache_full_blocks(0, first)
    assert len(m.keys[0]) == 2  # two full blocks keyed, the partial third is not
    assert m.add_sequence(1, first[:8] + [99]) == 8  # both full blocks reused, shared
    assert m.block_tables[1] == m.block_tables[0][:2] and m.allocator.ref_counts[m.block_tables[0][0]] == 2
    assert m.add_sequence(2, [5, 6, 7, 0]) == 0  # a different first block: nothing in common
    m.free_sequence(0)
    m.free_sequence(1)
    assert m.allocator.num_free == 8 and len(m.allocator.evictable) == 2  # freed, still findable
    assert m.add_sequence(3, first[:8]) == 7  # a full hit: the last token is computed again


def test_cached_blocks_are_evicted_least_recently_freed_first_when_the_pool_needs_them():
    m = BlockManager(3, 2, prefix_caching=True)
    for seq, prompt in enumerate([[1, 1], [2, 2], [3, 3]]):
        m.add_sequence(seq, prompt)
        m.reserve([seq], [2])
        m.advance([seq], [2])
        m.cache_full_blocks(seq, prompt)
    for seq in (1, 0, 2):
        m.free_sequence(seq)
    assert m.allocator.num_free == 3
    m.add_sequence(9, [])
    m.reserve([9], [2])  # takes the block of [2, 2], freed first
    assert m.add_sequence(10, [2, 2, 5]) == 0 and m.add_sequence(11, [1, 1, 5]) == 2


def test_a_prefix_hit_is_checked_against_the_stored_tokens_not_only_the_hash():
    """A hash collision is simulated by storing a block under the key of another prefix: the
    key matches, the tokens do not, so nothing is reused (and the uncached keys say so)."""
    m = BlockManager(4, 2, prefix_caching=True)
    m.add_sequence(0, [1, 2, 3])
    m.reserve([0], [3])
    m.advance([0], [3])
    key_of_other = m.prefix_keys([7, 7])[0]
    block = m.block_tables[0][0]
    m.allocator.set_key(block, key_of_other, BlockContents(None, (1, 2)))  # the "collision"
    assert m.allocator.block_of[key_of_other] == block
    assert m.uncached_keys([7, 7, 9]) == [key_of_other]
    assert m.add_sequence(1, [7, 7, 9]) == 0 and m.block_tables[1] == []
    assert m.allocator.find(key_of_other, BlockContents(None, (1, 2))) == block


def test_a_block_stored_after_another_parent_is_not_a_hit():
    """Equal tokens under a different parent key are another prefix."""
    allocator = BlockAllocator(2)
    block = allocator.allocate()
    allocator.set_key(block, 123, BlockContents(parent=1, token_ids=(4, 5)))
    assert allocator.find(123, BlockContents(parent=2, token_ids=(4, 5))) is None
    assert allocator.take(123, BlockContents(parent=2, token_ids=(4, 5))) is None
    assert allocator.ref_counts[block] == 1


def test_allocator_refuses_double_free():
    allocator = BlockAllocator(2)
    block = allocator.allocate()
    allocator.free(block)
    with pytest.raises(ValueError, match="double free"):
        allocator.free(block)


def test_running_out_of_blocks_raises_before_changing_anything():
    m = BlockManager(4, 4)
    m.add_sequence(0)
    m.reserve([0], [10])
    m.advance([0], [10])  # 3 blocks
    m.add_sequence(1)
    with pytest.raises(OutOfBlocksError, match="needs 2 more blocks for this step but only 1 of 4 are free"):
        m.reserve([1], [5])
    assert m.block_tables[1] == [] and m.allocator.num_free == 1


@pytest.mark.parametrize("length, copies", [(6, 1), (8, 0)])
def test_copy_on_write_copies_a_shared_partial_block_but_never_a_full_one(length, copies):
    """After a fork, the child's next token goes into the shared last block: copied if that block
    is partly filled (the parent still reads it), a fresh block if it is full (a block boundary)."""
    m = BlockManager(8, 4)
    m.add_sequence(0)
    m.reserve([0], [length])
    m.advance([0], [length])
    m.fork(0, 1)
    shared = list(m.block_tables[0])
    assert len(m.reserve([1], [1])) == copies
    assert m.block_tables[0] == shared  # the parent's table is untouched
    assert m.block_tables[1][: len(shared) - copies] == shared[: len(shared) - copies]
    assert all(m.allocator.ref_counts[b] >= 1 for b in m.block_tables[1])


class ManagerMachine(RuleBasedStateMachine):
    """Random add / reserve / fork / free on a small pool: no block leaks, none is freed twice,
    reference counts always equal the number of block tables holding a block."""

    sequences = Bundle("sequences")

    def __init__(self):
        super().__init__()
        self.m = BlockManager(12, 3)
        self.next_id = 0

    @rule(target=sequences)
    def add(self):
        seq = self.next_id
        self.next_id += 1
        self.m.add_sequence(seq)
        return seq

    @rule(seq=sequences, n=st.integers(1, 7))
    def append(self, seq, n):
        if seq not in self.m.lengths:
            return
        free_before = self.m.allocator.num_free
        tables_before = {s: list(t) for s, t in self.m.block_tables.items()}
        try:
            self.m.reserve([seq], [n])
        except OutOfBlocksError:
            assert self.m.allocator.num_free == free_before  # nothing changed
            assert self.m.block_tables == tables_before
            return
        self.m.advance([seq], [n])

    @rule(parent=sequences, target=sequences)
    def fork(self, parent):
        if parent not in self.m.lengths:
            return self.add()
        child = self.next_id
        self.next_id += 1
        self.m.fork(parent, child)
        return child

    @rule(seq=consumes(sequences))
    def free(self, seq):
        if seq in self.m.lengths:
            self.m.free_sequence(seq)

    @invariant()
    def reference_counts_match_block_tables(self):
        holders = [0] * self.m.allocator.num_blocks
        for table in self.m.block_tables.values():
            for block in table:
                holders[block] += 1
        assert holders == self.m.allocator.ref_counts
        free = self.m.allocator.free_list
        assert len(set(free)) == len(free)  # no block freed twice
        assert all(holders[b] == 0 for b in free)
        assert len(free) + sum(1 for h in holders if h > 0) == self.m.allocator.num_blocks  # no leak

    @invariant()
    def tables_cover_lengths(self):
        for seq, table in self.m.block_tables.items():
            assert len(table) == math.ceil(self.m.lengths[seq] / self.m.block_size)

    def teardown(self):
        for seq in list(self.m.block_tables):
            self.m.free_sequence(seq)
        assert self.m.allocator.num_free == self.m.allocator.num_blocks


TestManagerMachine = ManagerMachine.TestCase
TestManagerMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
