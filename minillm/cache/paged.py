"""The paged KV cache: fixed-size blocks from a shared pool, one block table per sequence.

Instead of reserving ``max_len`` slots per sequence up front, keys and values live in blocks of
``block_size`` tokens taken from a pool (per layer: ``[num_blocks, n_kv_heads, block_size,
head_dim]``). A sequence's *block table* lists its blocks in order, so token ``p`` sits in
block ``table[p // block_size]`` at offset ``p % block_size``. A sequence holds at most one
partly filled block, so the waste is under one block per sequence — this is the idea behind
vLLM's PagedAttention.

Blocks are reference-counted, which makes sharing cheap: ``fork`` gives a child sequence the
parent's blocks (a shared prompt for several completions, or beam search). When a sequence is
about to write into a block someone else also holds, it first copies it (copy-on-write).

Attention reads K/V *through* the block table: the blocks of each sequence are gathered into
a ``[batch, n_kv_heads, keys, head_dim]`` view and attended with a length mask — the same
numbers, in the same order, as the contiguous cache.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from minillm.cache.base import OutOfBlocksError
from minillm.model.config import ModelConfig


class BlockAllocator:
    """Hands out block ids from a free list and counts how many sequences hold each block."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))  # a stack: pop() gives 0, 1, 2, ... at first

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        if not self._free:
            raise OutOfBlocksError(f"all {self.num_blocks} KV blocks are in use")
        block = self._free.pop()
        self.ref_counts[block] = 1
        return block

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
            self._free.append(block)


class PagedKVCache:
    """A block pool for all layers plus the block table and length of every sequence."""

    def __init__(
        self,
        config: ModelConfig,
        num_blocks: int,
        block_size: int = 16,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.config = config
        self.block_size = block_size
        self.allocator = BlockAllocator(num_blocks)
        shape = (num_blocks, config.n_kv_heads, block_size, config.head_dim)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(config.n_layers)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(config.n_layers)]
        self.block_tables: dict[int, list[int]] = {}
        self.lengths: dict[int, int] = {}

    # ------------------------------------------------------------------ sequences
    def add_sequence(self, seq_id: int) -> None:
        if seq_id in self.block_tables:
            raise ValueError(f"sequence {seq_id} is already in the cache")
        self.block_tables[seq_id] = []
        self.lengths[seq_id] = 0

    def free_sequence(self, seq_id: int) -> None:
        """Release a finished sequence's blocks at once, so waiting work can use them."""
        for block in self._table(seq_id):
            self.allocator.free(block)
        del self.block_tables[seq_id], self.lengths[seq_id]

    def fork(self, parent: int, child: int) -> None:
        """The child starts as a copy of the parent, sharing every block (no data is copied)."""
        table = self._table(parent)
        if child in self.block_tables:
            raise ValueError(f"sequence {child} is already in the cache")
        for block in table:
            self.allocator.share(block)
        self.block_tables[child] = list(table)
        self.lengths[child] = self.lengths[parent]

    def _table(self, seq_id: int) -> list[int]:
        if seq_id not in self.block_tables:
            raise KeyError(f"sequence {seq_id} is not in the cache")
        return self.block_tables[seq_id]

    # ------------------------------------------------------------------ a step
    def blocks_needed(self, seq_id: int, n_new: int) -> int:
        """Blocks to allocate before ``seq_id`` can store ``n_new`` more tokens."""
        length, table = self.lengths[seq_id], self._table(seq_id)
        fresh = math.ceil((length + n_new) / self.block_size) - len(table)
        shared_tail = length % self.block_size != 0 and self.allocator.ref_counts[table[-1]] > 1
        return max(fresh, 0) + int(shared_tail and n_new > 0)

    def prepare(self, seq_ids: Sequence[int], q_len: int) -> PagedBatch:
        """Reserve room for ``q_len`` new tokens in each sequence; return the batch view the
        model runs on. Raises OutOfBlocksError *before* changing anything if the pool is short."""
        needed = sum(self.blocks_needed(s, q_len) for s in seq_ids)
        if needed > self.allocator.num_free:
            raise OutOfBlocksError(
                f"the KV cache needs {needed} more blocks for this step but only "
                f"{self.allocator.num_free} of {self.allocator.num_blocks} are free "
                f"(block_size {self.block_size}); free finished sequences or make the pool larger"
            )
        for seq_id in seq_ids:
            self._copy_on_write(seq_id)
            table = self.block_tables[seq_id]
            while len(table) * self.block_size < self.lengths[seq_id] + q_len:
                table.append(self.allocator.allocate())
        return PagedBatch(self, list(seq_ids), q_len)

    def prepare_prefill(self, seq_ids: Sequence[int], lengths: Sequence[int]) -> PackedPrefill:
        """Reserve blocks for new (empty) sequences' prompts and pack them for one forward."""
        for seq_id in seq_ids:
            if self.lengths[seq_id] != 0:
                raise ValueError(f"sequence {seq_id} is not new: a packed prefill starts from an empty sequence")
        needed = sum(math.ceil(n / self.block_size) for n in lengths)
        if needed > self.allocator.num_free:
            raise OutOfBlocksError(
                f"the prompts need {needed} blocks but only {self.allocator.num_free} of "
                f"{self.allocator.num_blocks} are free (block_size {self.block_size})"
            )
        for seq_id, n in zip(seq_ids, lengths):
            table = self.block_tables[seq_id]
            while len(table) * self.block_size < n:
                table.append(self.allocator.allocate())
        return PackedPrefill(self, list(seq_ids), list(lengths))

    def _copy_on_write(self, seq_id: int) -> None:
        """Give ``seq_id`` its own copy of a shared, partly filled last block before writing to it."""
        table, length = self.block_tables[seq_id], self.lengths[seq_id]
        if length % self.block_size == 0 or self.allocator.ref_counts[table[-1]] == 1:
            return
        old, new = table[-1], self.allocator.allocate()
        for pool in self.k + self.v:
            pool[new] = pool[old]
        self.allocator.free(old)
        table[-1] = new

    # ------------------------------------------------------------------ accounting
    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def slots_in_use(self) -> int:
        """Token slots in allocated blocks (what paging actually reserves)."""
        return (self.allocator.num_blocks - self.allocator.num_free) * self.block_size

    def tokens_stored(self) -> int:
        return sum(self.lengths.values())


class PagedBatch:
    """One forward's view of the paged cache: which sequences, their slots and block tables."""

    def __init__(self, cache: PagedKVCache, seq_ids: list[int], q_len: int) -> None:
        self.cache = cache
        self.seq_ids = seq_ids
        self.q_len = q_len
        device = cache.k[0].device
        bs = cache.block_size
        self.starts = torch.tensor([cache.lengths[s] for s in seq_ids], device=device)
        positions = self.starts[:, None] + torch.arange(q_len, device=device)  # [batch, q_len]
        tables = [cache.block_tables[s] for s in seq_ids]
        width = max(len(t) for t in tables)
        self.block_table = torch.tensor([t + [0] * (width - len(t)) for t in tables], device=device)
        # where each new token goes: (block, offset) for [batch * q_len] tokens
        self.slot_blocks = torch.gather(self.block_table, 1, positions // bs).flatten()
        self.slot_offsets = (positions % bs).flatten()
        self._positions = positions
        self.n_keys = int(self.starts.max()) + q_len

    @property
    def past_length(self) -> int:
        return int(self.starts.max())

    def positions(self, q_len: int) -> torch.Tensor:
        return self._positions

    def mask(self, attention_mask: torch.Tensor | None, q_len: int) -> torch.Tensor:
        """Query t of row b (at position start_b + t) sees keys 0..start_b + t of its own sequence."""
        if attention_mask is not None:
            raise ValueError("a paged batch holds unpadded sequences: pass no attention_mask")
        keys = torch.arange(self.n_keys, device=self._positions.device)
        return (keys[None, None, :] <= self._positions[:, :, None])[:, None]

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        batch, n_kv_heads, q_len, head_dim = k.shape
        k_pool, v_pool = self.cache.k[layer], self.cache.v[layer]
        k_pool[self.slot_blocks, :, self.slot_offsets] = k.transpose(1, 2).reshape(-1, n_kv_heads, head_dim)
        v_pool[self.slot_blocks, :, self.slot_offsets] = v.transpose(1, 2).reshape(-1, n_kv_heads, head_dim)
        return self._gather(k_pool), self._gather(v_pool)

    def _gather(self, pool: torch.Tensor) -> torch.Tensor:
        """The sequences' blocks in table order -> [batch, n_kv_heads, n_keys, head_dim]."""
        blocks = pool[self.block_table]  # [batch, width, n_kv_heads, block_size, head_dim]
        batch, width, n_kv_heads, block_size, head_dim = blocks.shape
        flat = blocks.transpose(1, 2).reshape(batch, n_kv_heads, width * block_size, head_dim)
        return flat[:, :, : self.n_keys]

    def advance(self, q_len: int) -> None:
        for seq_id in self.seq_ids:
            self.cache.lengths[seq_id] += q_len


class PackedPrefill:
    """Several *new* sequences' prompts packed into one row, so one forward fills all their blocks.

    Prefilling requests one at a time runs the weights through memory once per request; packing
    their prompts end to end (``[1, total_tokens]``) runs them once for all. A block-diagonal
    causal mask keeps each prompt's tokens from seeing the others', and each token's key and
    value go to its own sequence's blocks.
    """

    def __init__(self, cache: PagedKVCache, seq_ids: list[int], lengths: list[int]) -> None:
        self.cache = cache
        self.seq_ids = seq_ids
        self.lengths = lengths
        device = cache.k[0].device
        bs = cache.block_size
        positions = torch.cat([torch.arange(n, device=device) for n in lengths])
        owner = torch.cat([torch.full((n,), i, device=device) for i, n in enumerate(lengths)])
        tables = [cache.block_tables[s] for s in seq_ids]
        width = max(len(t) for t in tables)
        block_table = torch.tensor([t + [0] * (width - len(t)) for t in tables], device=device)
        self.slot_blocks = block_table[owner, positions // bs]
        self.slot_offsets = positions % bs
        self._positions = positions[None]
        same_sequence = owner[:, None] == owner[None, :]
        causal = positions[None, :] <= positions[:, None]
        self._mask = (same_sequence & causal)[None, None]
        self.last_index = torch.tensor(lengths, device=device).cumsum(0) - 1  # each prompt's last token

    @property
    def past_length(self) -> int:
        return 0

    def positions(self, q_len: int) -> torch.Tensor:
        return self._positions

    def mask(self, attention_mask: torch.Tensor | None, q_len: int) -> torch.Tensor:
        if attention_mask is not None:
            raise ValueError("a packed prefill holds unpadded sequences: pass no attention_mask")
        return self._mask

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        _, n_kv_heads, total, head_dim = k.shape
        self.cache.k[layer][self.slot_blocks, :, self.slot_offsets] = k[0].transpose(0, 1)
        self.cache.v[layer][self.slot_blocks, :, self.slot_offsets] = v[0].transpose(0, 1)
        return k, v  # fresh sequences: the prompts' own keys are all there is to attend to

    def advance(self, q_len: int) -> None:
        for seq_id, n in zip(self.seq_ids, self.lengths):
            self.cache.lengths[seq_id] += n
