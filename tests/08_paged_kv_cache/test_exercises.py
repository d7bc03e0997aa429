"""Notebook 08's exercises: a right answer passes, each classic wrong answer fails with its message.

The block managers here are written as a learner writes the notebook's stub (free list, reference
counts, fork, copy-on-write in ``append_slot``), independently of ``minillm.exercises.nb08``'s
wrong answers, so these tests also show that the diagnosis does not depend on the exact code.
"""

from __future__ import annotations

import pytest

from minillm.cache import OutOfBlocksError
from minillm.exercises import nb08, nb08_mistakes


class RightManager:
    def __init__(self, num_blocks, block_size):
        self.block_size = block_size
        self.free_list = list(range(num_blocks - 1, -1, -1))
        self.ref_counts = [0] * num_blocks
        self.tables = {}
        self.lengths = {}

    @property
    def num_free(self):
        return len(self.free_list)

    def add_sequence(self, seq):
        self.tables[seq], self.lengths[seq] = [], 0

    def free_sequence(self, seq):
        for block in self.tables.pop(seq):
            self.free_block(block)
        del self.lengths[seq]

    def allocate(self):
        if not self.free_list:
            raise OutOfBlocksError("the pool is empty")
        block = self.free_list.pop()
        self.ref_counts[block] = 1
        return block

    def free_block(self, block):
        if self.ref_counts[block] == 0:
            raise ValueError("double free")
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            self.free_list.append(block)

    def fork(self, parent, child):
        for block in self.tables[parent]:
            self.ref_counts[block] += 1
        self.tables[child] = list(self.tables[parent])
        self.lengths[child] = self.lengths[parent]

    def append_slot(self, seq):
        table, position = self.tables[seq], self.lengths[seq]
        offset = position % self.block_size
        copy = None
        if offset == 0:
            table.append(self.allocate())
        elif self.ref_counts[table[-1]] > 1:
            old, new = table[-1], self.allocate()
            self.free_block(old)
            table[-1] = new
            copy = (old, new)
        self.lengths[seq] = position + 1
        return table[-1], offset, copy


class ForkForgetsTheCounts(RightManager):
    def fork(self, parent, child):
        self.tables[child] = self.tables[parent].copy()
        self.lengths[child] = self.lengths[parent]


class FreesSharedBlocks(RightManager):
    def free_block(self, block):
        if self.ref_counts[block] == 0:
            raise ValueError("double free")
        self.ref_counts[block] -= 1
        self.free_list.append(block)  # even when someone else still holds it


class WritesIntoSharedBlocks(RightManager):
    def append_slot(self, seq):
        table, position = self.tables[seq], self.lengths[seq]
        if position % self.block_size == 0:
            table.append(self.allocate())
        self.lengths[seq] = position + 1
        return table[-1], position % self.block_size, None


class AcceptsDoubleFree(RightManager):
    def free_block(self, block):
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            self.free_list.append(block)


class AcceptsDoubleFreeAndPushesAgain(RightManager):
    def free_block(self, block):
        self.ref_counts[block] = max(0, self.ref_counts[block] - 1)
        if self.ref_counts[block] == 0:
            self.free_list.append(block)


class PopsEmpty(RightManager):
    def allocate(self):
        block = self.free_list.pop()
        self.ref_counts[block] = 1
        return block


class ForkAliasesTheTable(RightManager):
    def fork(self, parent, child):
        for block in self.tables[parent]:
            self.ref_counts[block] += 1
        self.tables[child] = self.tables[parent]
        self.lengths[child] = self.lengths[parent]


class KeepsTheOldBlock(RightManager):
    def append_slot(self, seq):
        table, position = self.tables[seq], self.lengths[seq]
        copy = None
        if position % self.block_size == 0:
            table.append(self.allocate())
        elif self.ref_counts[table[-1]] > 1:
            copy = (table[-1], self.allocate())
            table[-1] = copy[1]
        self.lengths[seq] = position + 1
        return table[-1], position % self.block_size, copy


class FreesBeforeAllocating(RightManager):
    def append_slot(self, seq):
        table, position = self.tables[seq], self.lengths[seq]
        copy = None
        if position % self.block_size == 0:
            table.append(self.allocate())
        elif self.ref_counts[table[-1]] > 1:
            old = table[-1]
            self.free_block(old)
            table[-1] = self.allocate()
            copy = (old, table[-1])
        self.lengths[seq] = position + 1
        return table[-1], position % self.block_size, copy


class CopiesFullSharedBlocks(RightManager):
    """Copy-on-write whenever the last block is shared, even a full one the next token leaves alone."""

    def append_slot(self, seq):
        table, position = self.tables[seq], self.lengths[seq]
        copy = None
        if table and self.ref_counts[table[-1]] > 1:
            old, new = table[-1], self.allocate()
            self.free_block(old)
            table[-1] = new
            copy = (old, new)
        if position % self.block_size == 0:
            table.append(self.allocate())
        self.lengths[seq] = position + 1
        return table[-1], position % self.block_size, copy


class ChecksSharedBeforeFull(RightManager):
    """Asks "shared?" before "full?": at a block boundary it copies and writes into the copy's slot 0."""

    def append_slot(self, seq):
        table, position = self.tables[seq], self.lengths[seq]
        offset, copy = position % self.block_size, None
        if table and self.ref_counts[table[-1]] > 1:
            old, new = table[-1], self.allocate()
            self.free_block(old)
            table[-1] = new
            copy = (old, new)
        elif offset == 0:
            table.append(self.allocate())
        self.lengths[seq] = position + 1
        return table[-1], offset, copy


class QueueNotStack(RightManager):
    def allocate(self):
        if not self.free_list:
            raise OutOfBlocksError("the pool is empty")
        block = self.free_list.pop(0)
        self.ref_counts[block] = 1
        return block


class FreedBlocksGoUnderTheOthers(RightManager):
    def free_block(self, block):
        if self.ref_counts[block] == 0:
            raise ValueError("double free")
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            self.free_list.insert(0, block)  # comes out last, not next


class ForkSkipsThePartialBlock(RightManager):
    """Does not count the child's hold on the last block ("it will be copied anyway")."""

    def fork(self, parent, child):
        for block in self.tables[parent][:-1]:
            self.ref_counts[block] += 1
        self.tables[child] = list(self.tables[parent])
        self.lengths[child] = self.lengths[parent]


class CopyTheWrongWay(RightManager):
    def append_slot(self, seq):
        block, offset, copy = super().append_slot(seq)
        return block, offset, copy[::-1] if copy else None


class DoubleFreeByMembership(RightManager):
    """Refuses a double free by looking the block up in the free list: slower, and right."""

    def free_block(self, block):
        if block in self.free_list:
            raise ValueError("double free")
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            self.free_list.append(block)


def test_right_manager_passes(capsys):
    assert nb08.check_block_manager(RightManager) is True
    assert "✅ block_manager: all 7 checks pass" in capsys.readouterr().out


@pytest.mark.parametrize(
    "wrong, says",
    [
        (ForkForgetsTheCounts, "fork() did not increment the reference counts"),
        (FreesSharedBlocks, "went back on the free list while another sequence still holds it"),
        (WritesIntoSharedBlocks, "wrote into a block it shares"),
        (AcceptsDoubleFree, "refuse a double free with ValueError"),
        (AcceptsDoubleFreeAndPushesAgain, "refuse a double free with ValueError"),
        (PopsEmpty, "must raise OutOfBlocksError"),
        (ForkAliasesTheTable, "the same list object"),
        (KeepsTheOldBlock, "release the writer's hold on the old block"),
        (FreesBeforeAllocating, "allocate the copy first"),
        (QueueNotStack, "the free list is a stack"),
        (CopiesFullSharedBlocks, "a full shared block was copied: nobody writes into a full block"),
        (ChecksSharedBeforeFull, "check for a full block (position % block_size == 0: a new block) *before*"),
        (FreedBlocksGoUnderTheOthers, "the free list is a stack"),
    ],
    ids=["fork-no-refcount", "free-shared-block", "no-copy-on-write", "double-free", "double-free-pushes",
         "empty-pop", "fork-aliases-table", "cow-keeps-old-ref", "cow-frees-first", "fifo",
         "cow-copies-full-block", "cow-shared-before-full", "freed-to-the-bottom"],
)
def test_manager_mistakes_are_named(capsys, wrong, says):
    assert nb08.check_block_manager(wrong) is False
    assert says in capsys.readouterr().out


@pytest.mark.parametrize("wrong", [ForkSkipsThePartialBlock, CopyTheWrongWay], ids=["fork-skips-last", "copy-reversed"])
def test_other_wrong_managers_fail(capsys, wrong):
    """Wrong in ways no named mistake describes: the check still fails them, and shows the operation."""
    assert nb08.check_block_manager(wrong) is False
    assert "❌ block_manager" in capsys.readouterr().out


def test_double_free_by_membership_passes():
    assert nb08.check_block_manager(DoubleFreeByMembership) is True


def test_the_failing_operation_is_shown(capsys):
    nb08.check_block_manager(ForkForgetsTheCounts)
    out = capsys.readouterr().out
    assert "the 'fork' script" in out
    assert "'ref counts [1, 1, 0, 0, 0, 0]' instead of 'ref counts [2, 2, 0, 0, 0, 0]'" in out


def test_stub_is_waiting(capsys):
    class Stub(RightManager):
        def append_slot(self, seq):
            raise NotImplementedError

    assert nb08.check_block_manager(Stub) is False
    assert "⏳ block_manager: not attempted yet" in capsys.readouterr().out


def test_the_package_adapter_passes(capsys):
    """The wrong answers are built on the package's BlockManager: unchanged, it passes every script.
    (The two adapters are private to the module, the base classes of its listed mistakes: there is
    no public name for them, and that they pass is what makes each mistake a one-bug variant.)"""
    assert nb08.check_block_manager(nb08_mistakes.OnThePackage) is True
    assert nb08.check_block_manager(nb08_mistakes.AllocatesOnDemand) is True


@pytest.mark.parametrize("wrong", [nb08_mistakes.CopiesAFullBlock, nb08_mistakes.SharedBeforeFull])
def test_a_full_shared_block_is_not_copied(capsys, wrong):
    """The fork at a block boundary is the only script where the two differ from the right answer."""
    assert nb08.check_block_manager(wrong) is False
    assert "the 'fork at a block boundary' script" in capsys.readouterr().out


@pytest.mark.parametrize(
    "wrong, says",
    [
        (lambda p, t, bs: (p // bs, p % bs), "*index* into the block table"),
        (lambda p, t, bs: (p % bs, t[p // bs]), "wrong way round"),
        (lambda p, t, bs: (t[p // bs], p), "position % block_size"),
        (lambda p, t, bs: (t[p // bs], p % bs) if p < bs else (t[-1], p % bs), "the sequence's last block"),
    ],
    ids=["index-not-id", "swapped", "position-as-offset", "last-block"],
)
def test_slot_of(capsys, wrong, says):
    assert nb08.check_slot_of(lambda p, t, bs: (t[p // bs], p % bs)) is True
    assert nb08.check_slot_of(wrong) is False
    assert says in capsys.readouterr().out


@pytest.mark.parametrize(
    "wrong, says",
    [
        (lambda n, bs: n // bs, "rounded down"),
        (lambda n, bs: n // bs + 1, "one too many"),
        (lambda n, bs: n / bs, "whole number"),
        (lambda n, bs: max(1, -(-n // bs)), "0 tokens -> 0 blocks"),
    ],
    ids=["floor", "floor-plus-one", "float", "at-least-one"],
)
def test_blocks_needed(capsys, wrong, says):
    assert nb08.check_blocks_needed(lambda n, bs: -(-n // bs)) is True
    assert nb08.check_blocks_needed(wrong) is False
    assert says in capsys.readouterr().out


def test_other_right_addressing_passes():
    assert nb08.check_slot_of(lambda p, t, bs: (t[divmod(p, bs)[0]], divmod(p, bs)[1])) is True
    assert nb08.check_blocks_needed(lambda n, bs: (n + bs - 1) // bs) is True
