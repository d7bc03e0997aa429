"""The paged KV cache's storage: fixed-size blocks from a shared pool, and the step that addresses them.

Instead of reserving ``max_len`` slots per sequence up front, keys and values live in blocks of
``block_size`` tokens taken from a pool (per layer: ``[num_blocks, n_kv_heads, block_size,
head_dim]``). A sequence's *block table* lists its blocks in order, so token ``p`` sits in
block ``table[p // block_size]`` at offset ``p % block_size``. A sequence holds at most one
partly filled block, so the waste is under one block per sequence — this is the idea behind
vLLM's PagedAttention.

Three parts, kept apart as nano-vllm and vLLM keep them:

* ``block_manager.BlockManager`` — the bookkeeping (free list, ref counts, block tables,
  prefix hashes) in pure Python: the scheduler *asks* it whether work fits;
* ``PagedKVCache`` — the storage: one K and one V pool per layer, plus its manager;
* ``PagedStep`` — one forward's step input, plain tensors built on the host: each new token's
  position and write slot, each row's block table and length, which tokens need logits. The
  model is handed a step and the pools it addresses (``model(ids, paged=step)``) and reads the
  keys and values through the block tables in place (``model.attention.paged_attention``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from minillm.cache.base import KVShape
from minillm.cache.block_manager import BlockAllocator, BlockManager
from minillm.cache.memory import free_memory

TABLE_WIDTH_STEP = 4  # block tables are padded to a multiple of this many blocks (fewer shapes)


class PagedKVCache:
    """A block pool for all layers (the storage) plus the ``BlockManager`` that owns its ids.

    Each pool holds one block more than the manager hands out: a *scratch* block (id
    ``num_blocks``) that padded rows and padded block-table entries point at, so a step padded
    to a fixed shape (a CUDA graph bucket) never writes into a block someone owns.
    """

    def __init__(
        self,
        config: KVShape,
        num_blocks: int,
        block_size: int = 16,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        prefix_caching: bool = False,
    ) -> None:
        shape = (num_blocks + 1, config.n_kv_heads, block_size, config.head_dim)
        needed = 2 * config.n_layers * math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        free = free_memory(device)
        if free is not None and needed > free:  # (checked before the manager lists num_blocks free blocks)
            raise MemoryError(f"the KV pools need {needed / 2**30:,.1f} GiB but {torch.device(device)} has "
                              f"{free / 2**30:,.1f} GiB free")
        self.config = config
        self.manager = BlockManager(num_blocks, block_size, prefix_caching)
        self.block_size = block_size
        self.scratch_block = num_blocks
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(config.n_layers)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(config.n_layers)]

    # The manager's state, under the names notebook 08 teaches.
    @property
    def allocator(self) -> BlockAllocator:
        return self.manager.allocator

    @property
    def block_tables(self) -> dict[int, list[int]]:
        return self.manager.block_tables

    @property
    def lengths(self) -> dict[int, int]:
        return self.manager.lengths

    @property
    def device(self) -> torch.device:
        return self.k[0].device

    def add_sequence(self, seq_id: int) -> None:
        self.manager.add_sequence(seq_id)

    def free_sequence(self, seq_id: int) -> None:
        self.manager.free_sequence(seq_id)

    def fork(self, parent: int, child: int) -> None:
        self.manager.fork(parent, child)

    def blocks_needed(self, seq_id: int, n_new: int) -> int:
        return self.manager.blocks_needed(seq_id, n_new)

    def copy_blocks(self, copies: Sequence[tuple[int, int]]) -> None:
        """Carry out copy-on-write: block ``dst`` becomes a copy of ``src`` in every layer."""
        for src, dst in copies:
            for pool in self.k + self.v:
                pool[dst] = pool[src]

    # ------------------------------------------------------------------ a step
    def prepare(self, seq_ids: Sequence[int], q_len: int | Sequence[int]) -> PagedStep:
        """Plan a forward by hand (notebook 08): reserve room for ``q_len`` new tokens in each
        sequence (one count for all, or one per sequence), build the step that writes them, and
        count them as stored. Raises OutOfBlocksError *before* changing anything if the pool is
        short. (The engine's runner does the same three things for every step it plans.)"""
        q_lens = [q_len] * len(seq_ids) if isinstance(q_len, int) else list(q_len)
        self.copy_blocks(self.manager.reserve(seq_ids, q_lens))
        step = self.step(seq_ids, q_lens)
        self.manager.advance(seq_ids, q_lens)
        return step

    def step(self, seq_ids: Sequence[int], q_lens: Sequence[int], pad_rows_to: int | None = None,
             pad_width_to: int | None = None, row_per_token: bool = False) -> PagedStep:
        """The step input for ``q_lens[i]`` new tokens of each sequence, whose blocks are already
        reserved and whose lengths do not count them yet: built on the host, in one go.

        ``pad_rows_to`` adds dummy decode rows (position 0, written to the scratch block) and
        ``pad_width_to`` widens the block tables (with the scratch block), for a step whose
        shapes must not change (a CUDA graph bucket).

        ``row_per_token`` shapes it as a decode step with a row for *every* token: each row has
        its sequence's block table and its own length (its position + 1), and gets logits. A
        step writes every row's key and value before any row attends, so a row sees the tokens
        before it in its sequence and itself: this is how a speculative step verifies a
        sequence's drafted tokens in the engine's one decode step."""
        seq_ids, q_lens = list(seq_ids), list(q_lens)
        bs = self.block_size
        starts = [self.lengths[s] for s in seq_ids]
        tables = [self.block_tables[s] for s in seq_ids]
        n_pad = 0 if pad_rows_to is None else pad_rows_to - len(seq_ids)
        width = max([len(t) for t in tables] + [1])
        width = max(-(-width // TABLE_WIDTH_STEP) * TABLE_WIDTH_STEP, pad_width_to or 0)
        positions, write_blocks, write_offsets = [], [], []
        for start, n, table in zip(starts, q_lens, tables):
            for p in range(start, start + n):
                positions.append(p)
                write_blocks.append(table[p // bs])
                write_offsets.append(p % bs)
        padded_tables = [t + [self.scratch_block] * (width - len(t)) for t in tables]
        context_lens = [s + n for s, n in zip(starts, q_lens)]
        if row_per_token:  # (then padding adds rows to the tokens, not to the sequences)
            padded_tables = [table for table, n in zip(padded_tables, q_lens) for _ in range(n)]
            context_lens, q_lens = [p + 1 for p in positions], [1] * len(positions)
            n_pad = 0 if pad_rows_to is None else pad_rows_to - len(positions)
        padded_tables += [[self.scratch_block] * width] * n_pad
        positions += [0] * n_pad
        write_blocks += [self.scratch_block] * n_pad
        write_offsets += [0] * n_pad
        context_lens += [1] * n_pad
        ends = torch.tensor(q_lens + [1] * n_pad, dtype=torch.long).cumsum(0)

        def tensor(values: list) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.long).to(self.device, non_blocking=True)

        return PagedStep(
            k_pools=self.k,
            v_pools=self.v,
            positions=tensor(positions),
            write_blocks=tensor(write_blocks),
            write_offsets=tensor(write_offsets),
            block_tables=tensor(padded_tables),
            context_lens=tensor(context_lens),
            logits_index=(ends - 1).to(self.device),  # each row's last token
            q_lens=None if all(n == 1 for n in q_lens) else q_lens + [1] * n_pad,
        )

    # ------------------------------------------------------------------ accounting
    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def slots_in_use(self) -> int:
        """Token slots in allocated blocks (what paging actually reserves)."""
        return (self.allocator.num_blocks - self.allocator.num_free) * self.block_size

    def tokens_stored(self) -> int:
        return sum(self.lengths.values())


@dataclass
class PagedStep:
    """One forward's step input on the paged cache: flat tensors built on the host by whoever
    planned the step (the engine's runner, notebook 08's loop), so running it reads nothing back.

    * ``k_pools``, ``v_pools``: the storage it addresses, one pool per layer;
    * ``positions``, ``write_blocks``, ``write_offsets`` [tokens]: each new token's position in
      its sequence and the slot its key and value go to;
    * ``block_tables`` [rows, width]: each row's blocks (padded with the scratch block);
    * ``context_lens`` [rows]: how many keys each row attends to once this step is written;
    * ``logits_index`` [rows]: which token of the flattened step is each row's last (None for
      a step that computes no logits, such as a group of layers);
    * ``q_lens``: tokens per row, on the host, or None when every row has one (a decode step).

    The tokens of a row are consecutive, so the model may be fed ``[rows, 1]`` (a decode step)
    or ``[1, tokens]`` (a packed prefill, any lengths) alike.
    """

    k_pools: list[torch.Tensor]
    v_pools: list[torch.Tensor]
    positions: torch.Tensor
    write_blocks: torch.Tensor
    write_offsets: torch.Tensor
    block_tables: torch.Tensor
    context_lens: torch.Tensor
    logits_index: torch.Tensor | None = None
    q_lens: list[int] | None = None

    @property
    def is_decode(self) -> bool:
        return self.q_lens is None

    def for_layers(self, first: int, last: int) -> PagedStep:
        """The same step on the pools of layers ``first..last-1`` only (a group of layers run as one program)."""
        return replace(self, k_pools=self.k_pools[first:last], v_pools=self.v_pools[first:last])
