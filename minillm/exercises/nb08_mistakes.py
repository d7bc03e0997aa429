"""The learner's block manager for notebook 08's check, and the classic wrong ones.

``OnThePackage`` is the interface the exercise asks for, built on minillm's ``BlockManager``;
each other class replaces one piece of it (the allocator, ``fork``, ``append_slot``) with the
code a learner would plausibly write, so ``nb08.check_block_manager`` can name the mistake.
"""

from __future__ import annotations

from minillm.cache import BlockAllocator, BlockManager, OutOfBlocksError


class OnThePackage:
    """The learner's interface on top of minillm's ``BlockManager``. Each wrong answer below
    replaces one piece of it: the allocator (``allocator_class``), ``fork`` or ``append_slot``."""

    allocator_class: type[BlockAllocator] = BlockAllocator

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.m = BlockManager(num_blocks, block_size)
        self.m.allocator = self.allocator_class(num_blocks)
        self.block_size = block_size

    ref_counts = property(lambda self: self.m.allocator.ref_counts)
    tables = property(lambda self: self.m.block_tables)
    lengths = property(lambda self: self.m.lengths)
    num_free = property(lambda self: self.m.allocator.num_free)

    def add_sequence(self, seq: int) -> None:
        self.m.add_sequence(seq)

    def free_sequence(self, seq: int) -> None:
        self.m.free_sequence(seq)

    def allocate(self) -> int:
        return self.m.allocator.allocate()

    def free_block(self, block: int) -> None:
        self.m.allocator.free(block)

    def fork(self, parent: int, child: int) -> None:
        self.m.fork(parent, child)

    def append_slot(self, seq: int) -> tuple[int, int, tuple[int, int] | None]:
        copies = self.m.reserve([seq], [1])
        position = self.lengths[seq]
        self.m.advance([seq], [1])
        return self.tables[seq][position // self.block_size], position % self.block_size, (copies or [None])[0]


class FifoAllocator(BlockAllocator):
    def allocate(self) -> int:
        if not self.free_list:
            raise OutOfBlocksError("no free block")
        block = self.free_list.pop(0)
        self.ref_counts[block] = 1
        return block


class FreedToTheBottom(BlockAllocator):
    """Pushes a freed block under the others (``insert(0, ...)``): it comes out last, not next."""

    def free(self, block: int) -> None:
        if self.ref_counts[block] == 0:
            raise ValueError(f"block {block} is already free")
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            self.free_list.insert(0, block)


class PopsAnEmptyList(BlockAllocator):
    def allocate(self) -> int:
        block = self.free_list.pop()
        self.ref_counts[block] = 1
        return block


class FreeAlwaysReturns(BlockAllocator):
    def free(self, block: int) -> None:
        if self.ref_counts[block] == 0:
            raise ValueError(f"block {block} is already free")
        self.ref_counts[block] -= 1
        self.free_list.append(block)


class FreeForgetsTheOthers(BlockAllocator):
    def free(self, block: int) -> None:
        if self.ref_counts[block] == 0:
            raise ValueError(f"block {block} is already free")
        self.ref_counts[block] = 0
        self.free_list.append(block)


class DoubleFreeAccepted(BlockAllocator):
    def free(self, block: int) -> None:
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            self.free_list.append(block)


class AllocatesOnDemand(OnThePackage):
    """``append_slot`` as a learner writes it: allocate when the token needs a block, without
    asking first how many are free (the package's ``reserve`` checks before it changes anything).
    The copy-on-write of a shared last block is its own method, so each classic mistake below
    rewrites only that."""

    def append_slot(self, seq: int) -> tuple[int, int, tuple[int, int] | None]:
        position, table = self.lengths[seq], self.tables[seq]
        copy = None
        if position % self.block_size == 0:
            table.append(self.allocate())
        elif self.ref_counts[table[-1]] > 1:
            copy = self.copy_on_write(table)
        self.lengths[seq] += 1
        return table[-1], position % self.block_size, copy

    def copy_on_write(self, table: list[int]) -> tuple[int, int] | None:
        copy = (table[-1], self.allocate())
        self.free_block(copy[0])
        table[-1] = copy[1]
        return copy


def adapted(allocator: type[BlockAllocator], base: type[OnThePackage] = OnThePackage) -> type[OnThePackage]:
    return type(f"_With{allocator.__name__}", (base,), {"allocator_class": allocator})


class ForkWithoutCounting(OnThePackage):
    def fork(self, parent: int, child: int) -> None:
        self.tables[child] = list(self.tables[parent])
        self.lengths[child] = self.lengths[parent]


class ForkSharesTheList(OnThePackage):
    def fork(self, parent: int, child: int) -> None:
        for block in self.tables[parent]:
            self.ref_counts[block] += 1
        self.tables[child] = self.tables[parent]
        self.lengths[child] = self.lengths[parent]


class NoCopyOnWrite(AllocatesOnDemand):
    def copy_on_write(self, table: list[int]) -> tuple[int, int] | None:
        return None  # writes into the shared block


class CopyKeepsTheOldHold(AllocatesOnDemand):
    def copy_on_write(self, table: list[int]) -> tuple[int, int] | None:
        copy = (table[-1], self.allocate())
        table[-1] = copy[1]
        return copy


class ReleasesBeforeCopying(AllocatesOnDemand):
    def copy_on_write(self, table: list[int]) -> tuple[int, int] | None:
        old = table[-1]
        self.free_block(old)
        copy = (old, self.allocate())
        table[-1] = copy[1]
        return copy


class CopiesAFullBlock(AllocatesOnDemand):
    """Copy-on-write whenever the last block is shared, full or not: a full shared block is copied
    (a wasted block and a wasted copy), then the token starts a new block anyway."""

    def append_slot(self, seq: int) -> tuple[int, int, tuple[int, int] | None]:
        position, table = self.lengths[seq], self.tables[seq]
        copy = None
        if table and self.ref_counts[table[-1]] > 1:
            copy = self.copy_on_write(table)
        if position % self.block_size == 0:
            table.append(self.allocate())
        self.lengths[seq] += 1
        return table[-1], position % self.block_size, copy


class SharedBeforeFull(AllocatesOnDemand):
    """Asks "is the last block shared?" before "is it full?": a full shared block is copied and the
    token is written at offset 0 of the copy, over the first token of that block."""

    def append_slot(self, seq: int) -> tuple[int, int, tuple[int, int] | None]:
        position, table = self.lengths[seq], self.tables[seq]
        copy = None
        if table and self.ref_counts[table[-1]] > 1:
            copy = self.copy_on_write(table)
        elif position % self.block_size == 0:
            table.append(self.allocate())
        self.lengths[seq] += 1
        return table[-1], position % self.block_size, copy
