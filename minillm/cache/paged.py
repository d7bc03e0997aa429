"""The paged KV cache: fixed-size blocks from a shared pool, one block table per sequence.

Instead of reserving ``max_len`` slots per sequence up front, keys and values live in blocks of
``block_size`` tokens taken from a pool (per layer: ``[num_blocks, n_kv_heads, block_size,
head_dim]``). A sequence's *block table* lists its blocks in order, so token ``p`` sits in
block ``table[p // block_size]`` at offset ``p % block_size``. A sequence holds at most one
partly filled block, so the waste is under one block per sequence — this is the idea behind
vLLM's PagedAttention.

The bookkeeping (free list, ref counts, block tables, prefix hashes) lives apart, in pure
Python (``block_manager.BlockManager``): the scheduler asks it whether work fits. This module
is the storage — one K and one V pool per layer — and the step metadata a forward reads them
through (``PagedBatch``): where each new token is written, each row's block table and length,
all built on the host.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from minillm.cache.block_manager import BlockAllocator, BlockManager
from minillm.model.attention import paged_decode_attention, paged_prefill_attention
from minillm.model.config import ModelConfig

TABLE_WIDTH_STEP = 4  # block tables are padded to a multiple of this many blocks (fewer shapes)


class PagedKVCache:
    """A block pool for all layers (the storage) plus the ``BlockManager`` that owns its ids.

    Each pool holds one block more than the manager hands out: a *scratch* block (id
    ``num_blocks``) that padded rows and padded block-table entries point at, so a step padded
    to a fixed shape (a CUDA graph bucket) never writes into a block someone owns.
    """

    def __init__(
        self,
        config: ModelConfig,
        num_blocks: int,
        block_size: int = 16,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        prefix_caching: bool = False,
    ) -> None:
        self.config = config
        self.manager = BlockManager(num_blocks, block_size, prefix_caching)
        self.block_size = block_size
        self.scratch_block = num_blocks
        shape = (num_blocks + 1, config.n_kv_heads, block_size, config.head_dim)
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
    def prepare(self, seq_ids: Sequence[int], q_len: int | Sequence[int]) -> PagedBatch:
        """Reserve room for ``q_len`` new tokens in each sequence (one count for all, or one per
        sequence); return the step the model runs on. Raises OutOfBlocksError *before*
        changing anything if the pool is short."""
        q_lens = [q_len] * len(seq_ids) if isinstance(q_len, int) else list(q_len)
        self.copy_blocks(self.manager.reserve(seq_ids, q_lens))
        return self.batch(seq_ids, q_lens)

    def batch(self, seq_ids: Sequence[int], q_lens: Sequence[int], pad_rows_to: int | None = None) -> PagedBatch:
        """The step metadata for blocks already reserved: built on the host, in one go.

        ``pad_rows_to`` adds dummy decode rows (position 0, written to the scratch block) up
        to a fixed row count, for a step whose shapes must not change (a CUDA graph)."""
        seq_ids, q_lens = list(seq_ids), list(q_lens)
        bs = self.block_size
        starts = [self.lengths[s] for s in seq_ids]
        tables = [self.block_tables[s] for s in seq_ids]
        n_pad = 0 if pad_rows_to is None else pad_rows_to - len(seq_ids)
        width = max([len(t) for t in tables] + [1])
        width = -(-width // TABLE_WIDTH_STEP) * TABLE_WIDTH_STEP
        positions, write_blocks, write_offsets = [], [], []
        for start, n, table in zip(starts, q_lens, tables):
            for p in range(start, start + n):
                positions.append(p)
                write_blocks.append(table[p // bs])
                write_offsets.append(p % bs)
        padded_tables = [t + [self.scratch_block] * (width - len(t)) for t in tables]
        padded_tables += [[self.scratch_block] * width] * n_pad
        positions += [0] * n_pad
        write_blocks += [self.scratch_block] * n_pad
        write_offsets += [0] * n_pad
        context_lens = [s + n for s, n in zip(starts, q_lens)] + [1] * n_pad
        ends = torch.tensor(q_lens + [1] * n_pad, dtype=torch.long).cumsum(0)
        device, long = self.device, torch.long
        return PagedBatch(
            self.k,
            self.v,
            positions=torch.tensor(positions, device=device, dtype=long),
            write_blocks=torch.tensor(write_blocks, device=device, dtype=long),
            write_offsets=torch.tensor(write_offsets, device=device, dtype=long),
            block_tables=torch.tensor(padded_tables, device=device, dtype=long),
            context_lens=torch.tensor(context_lens, device=device, dtype=long),
            logits_index=(ends - 1).to(device),
            q_lens=None if all(n == 1 for n in q_lens) else q_lens + [1] * n_pad,
            manager=self.manager,
            seq_ids=seq_ids,
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


class PagedBatch:
    """One forward's step metadata on the paged cache — the model's ``KVCache`` for that step.

    Everything is a flat tensor built on the host by whoever planned the step (the engine's
    scheduler, beam search, notebook 08's loop), so running it needs no read-back:

    * ``positions`` [tokens]: each new token's position in its sequence;
    * ``write_blocks``, ``write_offsets`` [tokens]: where its key and value go;
    * ``block_tables`` [rows, width]: each row's blocks (padded with the scratch block);
    * ``context_lens`` [rows]: how many keys each row attends to after this step;
    * ``logits_index`` [rows]: which token of each row needs logits (its last one);
    * ``q_lens``: tokens per row, on the host, or None when every row has one (a decode step).

    The tokens of a row are consecutive, so the model may be fed ``[rows, q_len]`` (equal
    lengths) or ``[1, tokens]`` (packed, any lengths) alike.
    """

    reads_in_place = True  # the model calls attend() instead of update() + its own attention

    def __init__(
        self,
        k_pools: list[torch.Tensor],
        v_pools: list[torch.Tensor],
        positions: torch.Tensor,
        write_blocks: torch.Tensor,
        write_offsets: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
        logits_index: torch.Tensor | None = None,
        q_lens: list[int] | None = None,
        manager: BlockManager | None = None,
        seq_ids: list[int] | None = None,
    ) -> None:
        self.k_pools, self.v_pools = k_pools, v_pools
        self.positions_flat = positions
        self.write_blocks, self.write_offsets = write_blocks, write_offsets
        self.block_tables, self.context_lens = block_tables, context_lens
        self.logits_index = logits_index
        self.q_lens = q_lens
        self.manager, self.seq_ids = manager, seq_ids

    @property
    def is_decode(self) -> bool:
        return self.q_lens is None

    @property
    def block_size(self) -> int:
        return self.k_pools[0].shape[2]

    # ------------------------------------------------------------------ the KVCache protocol
    @property
    def past_length(self) -> int:
        return 0  # unused: a paged step takes no attention_mask, and its positions are its own

    def positions(self, q_len: int) -> torch.Tensor:
        return self.positions_flat.view(-1, q_len)

    def mask(self, attention_mask: torch.Tensor | None, q_len: int) -> torch.Tensor | None:
        """Only for reading the step by hand (notebook 08, tests): [rows, 1, q_len, keys], query t
        of row r (at position start_r + t) sees keys 0..start_r + t. The model never builds it."""
        if attention_mask is not None:
            raise ValueError("a paged batch holds unpadded sequences: pass no attention_mask")
        positions = self.positions(q_len)
        keys = torch.arange(int(self.context_lens.max()), device=positions.device)
        return (keys[None, None, :] <= positions[:, :, None])[:, None]

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store the new keys and values [batch, n_kv_heads, seq, head_dim] in their slots."""
        n_kv_heads, head_dim = k.shape[1], k.shape[3]
        self.k_pools[layer][self.write_blocks, :, self.write_offsets] = k.transpose(1, 2).reshape(-1, n_kv_heads, head_dim)
        self.v_pools[layer][self.write_blocks, :, self.write_offsets] = v.transpose(1, 2).reshape(-1, n_kv_heads, head_dim)

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write, then gather every row's keys and values into a dense [rows, n_kv_heads, keys,
        head_dim] copy: the simple way to read a paged cache (notebook 08), not the engine's."""
        self.write(layer, k, v)
        return self.gather(self.k_pools[layer]), self.gather(self.v_pools[layer])

    def gather(self, pool: torch.Tensor) -> torch.Tensor:
        blocks = pool[self.block_tables]  # [rows, width, n_kv_heads, block_size, head_dim]
        rows, width, n_kv_heads, block_size, head_dim = blocks.shape
        flat = blocks.transpose(1, 2).reshape(rows, n_kv_heads, width * block_size, head_dim)
        return flat[:, :, : int(self.context_lens.max())]

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Store the new ``k``, ``v`` and return attention [batch, n_heads, seq, head_dim] of the
        queries ``q`` over each row's keys, read from the pool through the block table."""
        batch, n_heads, seq, head_dim = q.shape
        self.write(layer, k, v)
        k_pool, v_pool = self.k_pools[layer], self.v_pools[layer]
        if self.is_decode:
            out = paged_decode_attention(q.transpose(1, 2).reshape(-1, n_heads, head_dim), k_pool, v_pool,
                                         self.block_tables, self.context_lens)
        else:
            assert self.q_lens is not None
            out = paged_prefill_attention(q.transpose(1, 2).reshape(-1, n_heads, head_dim), k, v, k_pool, v_pool,
                                          self.block_tables, self.q_lens, self.context_lens.tolist())
        return out.view(batch, seq, n_heads, head_dim).transpose(1, 2)

    def advance(self, q_len: int) -> None:
        """The step's tokens are now stored: the manager's lengths move on (when it has one)."""
        if self.manager is not None and self.seq_ids is not None:
            n_new = self.q_lens if self.q_lens is not None else [1] * len(self.seq_ids)
            self.manager.advance(self.seq_ids, n_new[: len(self.seq_ids)])
