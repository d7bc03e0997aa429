"""Exercises of notebook 08 (the paged KV cache): where a token lives, how many blocks a sequence
takes, and the block manager itself — free list, reference counts, fork and copy-on-write.

The expected answers come from the package (``minillm.cache``): the addressing from the step
``PagedKVCache.step`` builds, the block counts from ``BlockManager``, and the block manager's behaviour
from a real ``PagedKVCache`` driven through the same script of operations (its tables, reference
counts, free blocks, and the tokens each sequence reads back from its storage). Each classic
mistake is written out as the code a learner would write, so a wrong answer of that kind is named.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from minillm.cache import BlockManager, OutOfBlocksError, PagedKVCache
from minillm.exercises import Mistake, check
from minillm.exercises.nb08_mistakes import (
    AllocatesOnDemand,
    CopiesAFullBlock,
    CopyKeepsTheOldHold,
    DoubleFreeAccepted,
    FifoAllocator,
    ForkSharesTheList,
    ForkWithoutCounting,
    FreeAlwaysReturns,
    FreedToTheBottom,
    FreeForgetsTheOthers,
    NoCopyOnWrite,
    PopsAnEmptyList,
    ReleasesBeforeCopying,
    SharedBeforeFull,
    adapted,
)
from minillm.model.attention import write_kv
from minillm.model.config import ModelConfig

# one KV head of 2 numbers, one layer: a pool whose slots hold one token id each
TINY = ModelConfig(vocab_size=1, hidden_size=2, n_layers=1, n_heads=1, n_kv_heads=1, intermediate_size=1)

# ------------------------------------------------------------------ exercise: where a token lives

# positions in the first, a middle and the last block of their tables (a token does not always live in the last)
SLOT_CASES_IN = [(0, [7, 3], 4), (3, [7, 3], 4), (5, [7, 3], 4), (20, [2, 9, 4], 8), (9, [4, 11, 2, 7], 4),
                 (6, [5, 0, 2, 1, 3, 8, 6], 1), (3, [5, 0, 2, 1, 3, 8, 6], 1)]


def _package_slot(position: int, block_table: list[int], block_size: int) -> tuple[int, int]:
    """Where the package's step (``PagedKVCache.step``) writes the token at ``position`` of a sequence with this table."""
    cache = PagedKVCache(TINY, num_blocks=max(block_table) + 1, block_size=block_size)
    cache.manager.block_tables[0], cache.manager.lengths[0] = list(block_table), position
    step = cache.step([0], [1])
    return int(step.write_blocks[0]), int(step.write_offsets[0])


SLOT_MISTAKES = [
    Mistake(lambda p, t, bs: (p // bs, p % bs),
            "you returned the *index* into the block table (position // block_size); the block id is "
            "block_table[that index]: the blocks of a sequence need not be 0, 1, 2, ..."),
    Mistake(lambda p, t, bs: (p % bs, t[p // bs]), "the pair is the wrong way round: (block id, offset)."),
    Mistake(lambda p, t, bs: (t[p // bs], p), "the offset is the slot inside the block, position % block_size, "
            "not the position in the sequence."),
    Mistake(lambda p, t, bs: (t[p % len(t)], p // bs), "position // block_size picks the table entry and "
            "position % block_size the offset inside that block."),
    Mistake(lambda p, t, bs: (t[-1], p % bs), "you returned the sequence's last block: that is where its *next* "
            "token goes, but a token at any position lives in block_table[position // block_size]."),
]

SLOT_HINTS = [
    "Block i of the table holds positions i * block_size .. (i + 1) * block_size - 1.",
    "The table index is position // block_size, the offset inside the block is position % block_size.",
    "return block_table[position // block_size], position % block_size",
]


def check_slot_of(fn: Callable[[int, list[int], int], tuple[int, int]], hint: int = 0) -> bool:
    """``fn(position, block_table, block_size)`` -> ``(block id, offset)`` where that token lives."""
    cases = [(args, _package_slot(*args)) for args in SLOT_CASES_IN]
    return check("slot_of", fn, cases, hint=hint, hints=SLOT_HINTS, mistakes=SLOT_MISTAKES)


# ------------------------------------------------------------------ exercise: blocks for a sequence

BLOCKS_CASES_IN = [(1, 16), (16, 16), (17, 16), (0, 16), (500, 1), (38, 8)]

BLOCKS_MISTAKES = [
    Mistake(lambda n, bs: n // bs, "you rounded down: a partly filled block is still a whole block taken."),
    Mistake(lambda n, bs: max(1, -(-n // bs)), "an empty sequence takes no block: 0 tokens -> 0 blocks (a "
            "sequence takes its first block when its first token arrives)."),
    Mistake(lambda n, bs: n // bs + 1, "one too many when the length is a multiple of the block size "
            "(16 tokens in blocks of 16 take 1 block), and 0 tokens take none."),
    Mistake(lambda n, bs: n / bs, "a number of blocks is a whole number (an int): round up."),
]

BLOCKS_HINTS = [
    "A sequence takes whole blocks: round length / block_size up.",
    "math.ceil(length / block_size), or with integers only: -(-length // block_size).",
    "return -(-length // block_size)",
]


def check_blocks_needed(fn: Callable[[int, int], int], hint: int = 0) -> bool:
    """``fn(length, block_size)`` -> blocks a sequence of ``length`` tokens occupies
    (``BlockManager.blocks_for_tokens``)."""
    cases = [((n, bs), BlockManager(1, bs).blocks_for_tokens(n)) for n, bs in BLOCKS_CASES_IN]
    return check("blocks_needed", fn, cases, hint=hint, hints=BLOCKS_HINTS, mistakes=BLOCKS_MISTAKES)


# ------------------------------------------------------------------ exercise: the block manager
#
# The learner's class has the interface of the notebook's stub:
#   free_list, ref_counts, tables, lengths, num_free, add_sequence(seq), free_sequence(seq)   (given)
#   allocate() -> block, free_block(block), fork(parent, child),
#   append_slot(seq) -> (block, offset, copy: (src, dst) or None)                           (written)

Op = tuple[Any, ...]


@dataclass(frozen=True)
class Script:
    """Operations on a fresh pool of ``num_blocks`` blocks of ``block_size`` slots; after each one,
    the ``fields`` of the state are compared."""

    name: str
    num_blocks: int
    block_size: int
    ops: tuple[Op, ...]
    fields: tuple[str, ...]

    def __repr__(self) -> str:
        ops = ", ".join(_label(op) for op in self.ops)
        return f"the {self.name!r} script on {self.num_blocks} blocks of {self.block_size}: {ops}"


def _label(op: Op) -> str:
    return f"{op[0]}({', '.join(map(str, op[1:]))})"


SCRIPTS = [
    Script("allocate and free", 6, 4,
           (("add_sequence", 0), ("append", 0, 5), ("add_sequence", 1), ("append", 1, 3), ("free_sequence", 0),
            ("add_sequence", 2), ("append", 2, 6)),
           ("result", "tables", "free", "reads")),
    Script("fork", 6, 4,
           (("add_sequence", 0), ("append", 0, 6), ("fork", 0, 1)),
           ("result", "tables", "ref counts", "lengths", "reads")),
    Script("free a shared sequence", 4, 4,
           (("add_sequence", 0), ("append", 0, 8), ("fork", 0, 1), ("free_sequence", 0), ("add_sequence", 2),
            ("append", 2, 4)),
           ("result", "tables", "ref counts", "free", "reads")),
    Script("copy-on-write", 6, 4,
           (("add_sequence", 0), ("append", 0, 6), ("fork", 0, 1), ("append", 1, 1), ("append", 0, 1),
            ("append", 1, 3)),
           ("result", "tables", "ref counts", "reads")),
    # the fork falls on a block boundary: the shared last block is full, so the next token of either
    # sequence starts a block of its own and nothing is copied
    Script("fork at a block boundary", 6, 4,
           (("add_sequence", 0), ("append", 0, 8), ("fork", 0, 1), ("append", 1, 1), ("append", 0, 1),
            ("append", 1, 3)),
           ("result", "tables", "ref counts", "free", "reads")),
    Script("double free", 4, 4,
           (("add_sequence", 0), ("append", 0, 2), ("free_sequence", 0), ("free_block", 0)),
           ("result",)),
    Script("out of blocks", 2, 4,
           (("add_sequence", 0), ("append", 0, 6), ("fork", 0, 1), ("append", 1, 1), ("free_sequence", 0),
            ("append", 1, 1)),
           ("result", "tables", "ref counts", "free", "reads")),
]


def _token(seq: int, position: int) -> int:
    """The token id written at ``position`` of ``seq``: a forked child reads its parent's below the fork."""
    return 100 * seq + position


def _record(op: Op, result: tuple[str, ...], state: dict[str, Any], fields: Sequence[str]) -> tuple[str, ...]:
    """One operation as labelled strings, short enough to be printed whole in a failing check."""
    record = [_label(op), *result]
    for field in fields:
        if field == "reads":
            record.extend(state["reads"])
        elif field != "result":
            record.append(state[field])
    return tuple(record)


def _appended(slots: list[tuple[int, int]], copies: list[tuple[int, int]]) -> tuple[str, ...]:
    """``-> wrote block 0 @ 0..3, block 1 @ 0..1`` and ``copied block 1 to 2`` (or ``copied nothing``)."""
    runs: list[list[int]] = []  # [block, first offset, last offset]
    for block, offset in slots:
        if runs and runs[-1][0] == block and runs[-1][2] == offset - 1:
            runs[-1][2] = offset
        else:
            runs.append([block, offset, offset])
    wrote = ", ".join(f"block {b} @ {lo}" + (f"..{hi}" if hi != lo else "") for b, lo, hi in runs)
    copied = ", ".join(f"block {src} to {dst}" for src, dst in copies) or "nothing"
    return f"-> wrote {wrote}", f"copied {copied}"


def _state(block_size: int, tables: dict[int, list[int]], ref_counts: list[int], num_free: int,
           lengths: dict[int, int], read: Callable[[int, int], int]) -> dict[str, str]:
    """The state as labelled strings (a difference then reads as "ref counts [1, 1] instead of [2, 2]")."""
    reads: dict[int, Any] = {}
    for seq in sorted(tables):
        try:
            reads[seq] = [read(tables[seq][p // block_size], p % block_size) for p in range(lengths[seq])]
        except (IndexError, KeyError, TypeError):
            reads[seq] = "unreadable: the table is too short for the length"
    return {
        "tables": f"tables {dict(sorted((s, list(t)) for s, t in tables.items()))}",
        "ref counts": f"ref counts {list(ref_counts)}",
        "free": f"{num_free} free",
        "lengths": f"lengths {dict(sorted(lengths.items()))}",
        "reads": [f"seq {s} reads {r}" for s, r in reads.items()],
    }


def _trace(script: Script, run_op: Callable[..., tuple[str, ...]], state: Callable[[], dict[str, str]],
           errors: tuple[type[BaseException], ...]) -> tuple[tuple[str, ...], ...]:
    """Run the script's operations one by one (``run_op(name, *args)`` -> its result), recording
    each result (or the error it raised) and the state after it."""
    trace = []
    for op in script.ops:
        try:
            result = run_op(*op)
        except NotImplementedError:
            raise
        except errors as err:
            result = (f"-> {type(err).__name__}",)
        trace.append(_record(op, result, state(), script.fields))
    return tuple(trace)


def _run_package(script: Script) -> tuple[tuple[str, ...], ...]:
    """The script on minillm's ``PagedKVCache``: its manager's bookkeeping, its pool's contents."""
    cache = PagedKVCache(TINY, num_blocks=script.num_blocks, block_size=script.block_size)
    manager, pool = cache.manager, cache.k[0]  # pool [blocks + 1, 1 KV head, block_size, 2]

    def run_op(name: str, *args: Any) -> tuple[str, ...]:
        if name == "append":
            seq, n = args
            copies = manager.reserve([seq], [n])
            cache.copy_blocks(copies)
            step = cache.step([seq], [n])
            start = manager.lengths[seq]
            tokens = torch.tensor([float(_token(seq, p)) for p in range(start, start + n)])
            write_kv(step, 0, tokens.view(1, 1, n, 1).expand(1, 1, n, 2), tokens.view(1, 1, n, 1).expand(1, 1, n, 2))
            manager.advance([seq], [n])
            return _appended(list(zip(step.write_blocks.tolist(), step.write_offsets.tolist())), copies)
        if name == "free_block":
            manager.allocator.free(*args)
        else:
            getattr(manager, name)(*args)
        return ("-> ok",)

    def state() -> dict[str, str]:
        allocator = manager.allocator
        return _state(script.block_size, manager.block_tables, allocator.ref_counts, allocator.num_free,
                      manager.lengths, lambda b, o: int(pool[b, 0, o, 0]))

    return _trace(script, run_op, state, (OutOfBlocksError, ValueError, KeyError))


def _run_learner(cls: type, script: Script) -> tuple[tuple[str, ...], ...]:
    """The script on the learner's class: it says where each token goes and what to copy; the
    storage (one token id per slot) is this function's, as the pool is the cache's."""
    manager = cls(script.num_blocks, script.block_size)
    pool = torch.full((script.num_blocks, script.block_size), -1, dtype=torch.long)

    def run_op(name: str, *args: Any) -> tuple[str, ...]:
        if name == "append":
            seq, n = args
            slots, copies = [], []
            for _ in range(n):
                position = manager.lengths[seq]
                block, offset, copy = manager.append_slot(seq)
                if copy is not None:
                    src, dst = copy
                    pool[dst] = pool[src]
                    copies.append((src, dst))
                pool[block, offset] = _token(seq, position)
                slots.append((block, offset))
            return _appended(slots, copies)
        getattr(manager, name)(*args)
        return ("-> ok",)

    def state() -> dict[str, str]:
        return _state(script.block_size, manager.tables, manager.ref_counts, manager.num_free, manager.lengths,
                      lambda b, o: int(pool[b, o]))

    # the learner's code may fail in any way: the trace says how
    return _trace(script, run_op, state, (Exception,))


def _as_mistake(cls: type, message: str) -> Mistake:
    return Mistake(lambda script: _run_learner(cls, script), message)


FREED_WHILE_HELD = ("a block went back on the free list while another sequence still holds it: free_block() must "
                    "only decrement its count, and return it to the free list when the count reaches 0 — "
                    "otherwise the next allocation hands out a block someone is still reading.")

MANAGER_MISTAKES = [
    *(_as_mistake(adapted(order), "your allocator hands out blocks in another order: the free list is a stack "
                  "(pop() from its end gives 0, 1, 2, ... at first; a freed block is pushed back on the end, "
                  "append(), so the most recently freed block is the next one out).")
      for order in (FifoAllocator, FreedToTheBottom)),
    _as_mistake(adapted(PopsAnEmptyList, AllocatesOnDemand),
                "allocate() on an empty free list must raise OutOfBlocksError (the step is "
                "refused and the scheduler decides what to preempt), not IndexError."),
    _as_mistake(ForkWithoutCounting, "fork() did not increment the reference counts: after fork(0, 1) each of "
                "sequence 0's blocks is held by two tables, so its count must be 2 (otherwise freeing one "
                "sequence frees blocks the other still reads)."),
    _as_mistake(ForkSharesTheList, "fork() gave the child the parent's table itself (the same list object): "
                "copy it, list(table), or a block the child appends or copies shows up in the parent's table."),
    _as_mistake(adapted(FreeAlwaysReturns), FREED_WHILE_HELD),
    _as_mistake(adapted(FreeForgetsTheOthers), FREED_WHILE_HELD),
    _as_mistake(adapted(DoubleFreeAccepted),
                "free_block() of a block that is already free was accepted: refuse a double "
                "free with ValueError (a block on the free list twice would be handed to two sequences)."),
    _as_mistake(NoCopyOnWrite, "a sequence wrote into a block it shares (its last, partly filled one): copy it "
                "first (copy-on-write): allocate a new block, return (old, new) as the copy, free_block(old) and "
                "put the new block in the table; the other sequence's tokens must not change."),
    _as_mistake(SharedBeforeFull, "a full shared block was copied and the new token written at offset 0 of the "
                "copy, over a token already there: check for a full block (position % block_size == 0: a new "
                "block) *before* asking whether the last block is shared."),
    _as_mistake(CopiesAFullBlock, "a full shared block was copied: nobody writes into a full block, so it can "
                "stay shared; the next token starts a new block of its own (position % block_size == 0). "
                "Copy-on-write is only for a shared block that is partly filled."),
    _as_mistake(CopyKeepsTheOldHold, "after copy-on-write, release the writer's hold on the old block "
                "(free_block(old)): its count stays too high and it never returns to the free list."),
    _as_mistake(ReleasesBeforeCopying, "copy-on-write changed the reference counts before it had its new block: "
                "allocate the copy first, then free_block(old), so a step that runs out of blocks leaves the "
                "pool as it was."),
]

MANAGER_HINTS = [
    "allocate: pop a block off the free list and set its count to 1. free_block: refuse a count of 0, "
    "decrement, and push the block back only at 0. fork: the child gets a copy of the parent's table and "
    "length, and every block in it one more holder.",
    "append_slot(seq): position = self.lengths[seq]. If position % block_size == 0 the token starts a new "
    "block: append self.allocate() to the table. Otherwise, if the last block's count is > 1, it is shared: "
    "copy-on-write. Then the token goes to (table[-1], position % block_size) and the length grows by 1.",
    "copy-on-write: old = table[-1]; new = self.allocate(); self.free_block(old); table[-1] = new; "
    "return new, position % block_size, (old, new) — allocate before freeing, so running out changes nothing.",
]


def check_block_manager(cls: type, hint: int = 0) -> bool:
    """``cls(num_blocks, block_size)``: a block manager that matches minillm's ``PagedKVCache`` on seven
    scripts — allocate and free, fork, freeing a shared sequence, copy-on-write, a fork at a block
    boundary (a full shared block: no copy), a double free, running out of blocks. After every operation its result, block tables, reference counts, free
    blocks, lengths and the tokens each sequence reads back are compared (the fields each script
    is about)."""

    def run(script: Script) -> tuple[tuple[str, ...], ...]:
        return _run_learner(cls, script)

    run.__name__ = getattr(cls, "__name__", "manager")
    cases = [((script,), _run_package(script)) for script in SCRIPTS]
    return check("block_manager", run, cases, hint=hint, hints=MANAGER_HINTS, mistakes=MANAGER_MISTAKES)
