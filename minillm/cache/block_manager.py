"""The paged cache's bookkeeping: which blocks each sequence holds, in pure Python.

A sequence's *block table* lists its blocks in order, so token ``p`` sits in block
``table[p // block_size]`` at offset ``p % block_size``. Blocks are reference-counted: ``fork``
gives a child the parent's blocks (several completions of one prompt, beam search), and a
sequence about to write into a block someone else holds copies it first (copy-on-write).

With *prefix caching* every full block is keyed by a hash chain (its tokens and the key of the
block before it), so a key names the whole prefix up to that block. A new prompt whose leading
blocks are in the cache reuses them. A key is only a hash: a hit is confirmed against the token
ids the block was stored with and the key of its parent, so a collision can never hand a
sequence another prompt's keys and values.

No tensors here: the scheduler *asks* the manager whether work fits (``can_reserve``,
``blocks_needed``), and the storage (``paged.PagedKVCache``) carries out the copies it returns.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass


class OutOfBlocksError(RuntimeError):
    """The paged KV cache has no free block left for a step (the pool is left unchanged)."""


@dataclass(frozen=True)
class BlockContents:
    """What a keyed block holds: its token ids and the key of the block before it (None for the first)."""

    parent: int | None
    token_ids: tuple[int, ...]


class BlockAllocator:
    """Hands out block ids from a free list and counts how many sequences hold each block.

    With prefix caching, a full block can carry a *key* (its prefix hash). A keyed block that
    nobody holds is free, but it is not wiped: it waits in ``evictable`` (least recently freed
    first) and can be taken back by a prompt with the same prefix; ``allocate`` uses truly free
    blocks first and evicts the oldest keyed one only when there are none.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self.free_list = list(range(num_blocks - 1, -1, -1))  # a stack: pop() gives 0, 1, 2, ... at first
        self.evictable: OrderedDict[int, None] = OrderedDict()  # free keyed blocks, least recently freed first
        self.key_of: dict[int, int] = {}  # block -> the prefix hash of its contents
        self.block_of: dict[int, int] = {}  # prefix hash -> block
        self.contents: dict[int, BlockContents] = {}  # keyed block -> what it was stored with

    @property
    def num_free(self) -> int:
        return len(self.free_list) + len(self.evictable)

    def allocate(self) -> int:
        if self.free_list:
            block = self.free_list.pop()
        elif self.evictable:
            block, _ = self.evictable.popitem(last=False)  # the least recently freed cached prefix goes
            del self.block_of[self.key_of.pop(block)]
            del self.contents[block]
        else:
            raise OutOfBlocksError(f"all {self.num_blocks} KV blocks are in use")
        self.ref_counts[block] = 1
        return block

    def set_key(self, block: int, key: int, contents: BlockContents) -> None:
        """Record that held ``block`` holds the prefix ``key`` (the first block with a key keeps it)."""
        if key not in self.block_of and block not in self.key_of:
            self.key_of[block] = key
            self.block_of[key] = block
            self.contents[block] = contents

    def find(self, key: int, contents: BlockContents) -> int | None:
        """The block stored under ``key`` if it really holds ``contents`` (a hash is not proof), else None."""
        block = self.block_of.get(key)
        return block if block is not None and self.contents[block] == contents else None

    def take(self, key: int, contents: BlockContents) -> int | None:
        """The block holding prefix ``key`` with ``contents``, now held once more (revived if it
        was free); or None."""
        block = self.find(key, contents)
        if block is None:
            return None
        if self.ref_counts[block] == 0:
            del self.evictable[block]
        self.ref_counts[block] += 1
        return block

    def unkey(self, block: int) -> None:
        """Forget ``block``'s prefix key (its contents are about to change)."""
        key = self.key_of.pop(block, None)
        if key is not None:
            del self.block_of[key], self.contents[block]

    def share(self, block: int) -> None:
        """One more holder of an allocated block."""
        if self.ref_counts[block] == 0:
            raise ValueError(f"block {block} is free and cannot be shared")
        self.ref_counts[block] += 1

    def free(self, block: int) -> None:
        """One holder fewer; the block returns to the free list when nobody holds it."""
        if self.ref_counts[block] == 0:
            raise ValueError(f"block {block} is already free (double free)")
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            if block in self.key_of:
                self.evictable[block] = None  # free, but its prefix stays findable until evicted
            else:
                self.free_list.append(block)


class BlockManager:
    """Block tables and lengths of every sequence, on top of a ``BlockAllocator``.

    Pure bookkeeping: it decides which blocks a step writes to and which shared blocks must be
    copied first, and returns those copies as ``(source, destination)`` pairs for the storage
    to carry out. Every method that can run out of blocks checks first and changes nothing
    when it does.
    """

    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = False) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self.allocator = BlockAllocator(num_blocks)
        self.block_tables: dict[int, list[int]] = {}
        self.lengths: dict[int, int] = {}
        self.keys: dict[int, list[int]] = {}  # each sequence's prefix hashes, one per full block so far

    # ------------------------------------------------------------------ sequences
    def add_sequence(self, seq_id: int, tokens: Sequence[int] = ()) -> int:
        """Start a sequence; with prefix caching, reuse the cached blocks that begin ``tokens``
        (its prompt). Returns how many of its tokens are already in the cache, so the caller
        computes only the rest. At least one token is always left to compute — the last
        prompt token's logits are needed even when the whole prompt is cached (a full hit)."""
        if seq_id in self.block_tables:
            raise ValueError(f"sequence {seq_id} is already in the cache")
        self.block_tables[seq_id], self.lengths[seq_id], self.keys[seq_id] = [], 0, []
        if not (self.prefix_caching and tokens):
            return 0
        for key, contents in self._chain(tokens):
            block = self.allocator.take(key, contents)
            if block is None:
                break
            self.block_tables[seq_id].append(block)
            self.keys[seq_id].append(key)
        cached = min(len(self.block_tables[seq_id]) * self.block_size, len(tokens) - 1)
        self.lengths[seq_id] = cached
        return cached

    def prefix_keys(self, tokens: Sequence[int], previous: int | None = None) -> list[int]:
        """The hash chain of ``tokens``' full blocks: each key hashes the block's token ids
        together with the previous block's key, so equal keys name equal prefixes (up to a hash
        collision, which ``BlockAllocator.find`` rules out)."""
        return [key for key, _ in self._chain(tokens, previous)]

    def _chain(self, tokens: Sequence[int], previous: int | None = None) -> list[tuple[int, BlockContents]]:
        chain, bs = [], self.block_size
        for start in range(0, len(tokens) - bs + 1, bs):
            contents = BlockContents(previous, tuple(tokens[start : start + bs]))
            previous = hash((previous, contents.token_ids))
            chain.append((previous, contents))
        return chain

    def uncached_keys(self, tokens: Sequence[int]) -> list[int]:
        """The prefix keys of ``tokens``' full blocks from the first one not in the cache on:
        the blocks a prefill of ``tokens`` would compute (and an empty list on a full hit)."""
        chain = self._chain(tokens)
        cached = 0
        while cached < len(chain) and self.allocator.find(*chain[cached]) is not None:
            cached += 1
        return [key for key, _ in chain[cached:]]

    def has_unkeyed_full_blocks(self, seq_id: int) -> bool:
        """Whether the sequence has filled a block since its blocks were last keyed (with prefix
        caching on): the cheap question to ask each step before handing over its tokens."""
        return self.prefix_caching and self.lengths[seq_id] // self.block_size > len(self.keys[seq_id])

    def cache_full_blocks(self, seq_id: int, tokens: Sequence[int]) -> None:
        """Key the sequence's blocks that are full of computed tokens (``tokens`` are its ids so
        far, prompt then output), so later prompts can find them. A no-op without prefix caching."""
        if not self.has_unkeyed_full_blocks(seq_id):
            return
        keys, table = self.keys[seq_id], self.block_tables[seq_id]
        full = self.lengths[seq_id] // self.block_size
        start = len(keys) * self.block_size
        new = self._chain(tokens[start : full * self.block_size], keys[-1] if keys else None)
        for block, (key, contents) in zip(table[len(keys) : full], new):
            self.allocator.set_key(block, key, contents)
        keys += [key for key, _ in new]

    def free_sequence(self, seq_id: int) -> None:
        """Release a sequence's blocks at once, so waiting work can use them."""
        for block in self.table(seq_id):
            self.allocator.free(block)
        del self.block_tables[seq_id], self.lengths[seq_id], self.keys[seq_id]

    def truncate(self, seq_id: int, length: int) -> None:
        """Roll ``seq_id`` back to its first ``length`` tokens (speculative decoding's rejected
        tokens): the blocks past them return to the pool, nothing is copied, and the block left
        partly full loses its prefix key if this sequence alone holds it (its tail will be written
        again; a shared one keeps its key and is copied on the next write, as ``reserve`` does)."""
        table = self.table(seq_id)
        if not 0 <= length <= self.lengths[seq_id]:
            raise ValueError(f"cannot truncate sequence {seq_id} of {self.lengths[seq_id]} tokens to {length}")
        keep = self.blocks_for_tokens(length)
        for block in table[keep:]:
            self.allocator.free(block)
        del table[keep:]
        self.lengths[seq_id] = length
        full, keys = length // self.block_size, self.keys[seq_id]
        for block in table[full:len(keys)]:
            if self.allocator.ref_counts[block] == 1:
                self.allocator.unkey(block)
        del keys[full:]

    def fork(self, parent: int, child: int) -> None:
        """The child starts as a copy of the parent, sharing every block (no data is copied)."""
        table = self.table(parent)
        if child in self.block_tables:
            raise ValueError(f"sequence {child} is already in the cache")
        for block in table:
            self.allocator.share(block)
        self.block_tables[child] = list(table)
        self.lengths[child] = self.lengths[parent]
        self.keys[child] = list(self.keys[parent])

    def table(self, seq_id: int) -> list[int]:
        if seq_id not in self.block_tables:
            raise KeyError(f"sequence {seq_id} is not in the cache")
        return self.block_tables[seq_id]

    # ------------------------------------------------------------------ questions the scheduler asks
    def blocks_needed(self, seq_id: int, n_new: int) -> int:
        """Blocks to allocate before ``seq_id`` can store ``n_new`` more tokens."""
        length, table = self.lengths[seq_id], self.table(seq_id)
        fresh = math.ceil((length + n_new) / self.block_size) - len(table)
        shared_tail = length % self.block_size != 0 and self.allocator.ref_counts[table[-1]] > 1
        return max(fresh, 0) + int(shared_tail and n_new > 0)

    def can_reserve(self, seq_ids: Sequence[int], n_new: Sequence[int]) -> bool:
        return sum(self.blocks_needed(s, n) for s, n in zip(seq_ids, n_new)) <= self.allocator.num_free

    def blocks_for_tokens(self, n_tokens: int) -> int:
        return math.ceil(n_tokens / self.block_size)

    # ------------------------------------------------------------------ a step
    def reserve(self, seq_ids: Sequence[int], n_new: Sequence[int]) -> list[tuple[int, int]]:
        """Make room for ``n_new[i]`` more tokens in ``seq_ids[i]``; return the block copies
        (copy-on-write) the storage must do before the step writes. Raises
        OutOfBlocksError *before* changing anything if the pool is short."""
        needed = sum(self.blocks_needed(s, n) for s, n in zip(seq_ids, n_new))
        if needed > self.allocator.num_free:
            raise OutOfBlocksError(
                f"the KV cache needs {needed} more blocks for this step but only "
                f"{self.allocator.num_free} of {self.allocator.num_blocks} are free "
                f"(block_size {self.block_size}); free finished sequences or make the pool larger"
            )
        copies = []
        for seq_id, n in zip(seq_ids, n_new):
            table, length = self.block_tables[seq_id], self.lengths[seq_id]
            if n > 0 and length % self.block_size != 0 and self.allocator.ref_counts[table[-1]] > 1:
                old, new = table[-1], self.allocator.allocate()
                self.allocator.free(old)
                table[-1] = new
                copies.append((old, new))
            while len(table) * self.block_size < length + n:
                table.append(self.allocator.allocate())
        return copies

    def advance(self, seq_ids: Sequence[int], n_new: Sequence[int]) -> None:
        for seq_id, n in zip(seq_ids, n_new):
            self.lengths[seq_id] += n
