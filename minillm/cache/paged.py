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

Sharing also works across requests that never met: with *prefix caching* on, every full block
is keyed by a hash of its tokens and of the block before it (a hash chain, so a key names the
whole prefix up to that block). A new prompt whose leading blocks have keys in the cache reuses
them instead of computing them again, and a block nobody holds any more keeps its contents and
its key until the pool needs the room (least recently freed goes first).

Three parts, kept apart as nano-vllm and vLLM keep them:

* ``BlockManager`` — pure-Python bookkeeping (free list, ref counts, block tables, lengths,
  what a step needs). No tensors: the scheduler *asks* it whether work fits.
* ``PagedKVCache`` — the storage (one K and one V pool per layer) plus its manager.
* ``PagedBatch`` — one forward's step metadata, built on the host: where each new token is
  written, each row's block table and length. The model reads K/V *through* it in place.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence

import torch

from minillm.cache.base import OutOfBlocksError
from minillm.model.attention import paged_decode_attention, paged_prefill_attention
from minillm.model.config import ModelConfig

TABLE_WIDTH_STEP = 4  # block tables are padded to a multiple of this many blocks (fewer shapes)


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
        self._free = list(range(num_blocks - 1, -1, -1))  # a stack: pop() gives 0, 1, 2, ... at first
        self.evictable: OrderedDict[int, None] = OrderedDict()  # free keyed blocks, least recently freed first
        self.key_of: dict[int, int] = {}  # block -> the prefix hash of its contents
        self.block_of: dict[int, int] = {}  # prefix hash -> block

    @property
    def num_free(self) -> int:
        return len(self._free) + len(self.evictable)

    def allocate(self) -> int:
        if self._free:
            block = self._free.pop()
        elif self.evictable:
            block, _ = self.evictable.popitem(last=False)  # the least recently freed cached prefix goes
            del self.block_of[self.key_of.pop(block)]
        else:
            raise OutOfBlocksError(f"all {self.num_blocks} KV blocks are in use")
        self.ref_counts[block] = 1
        return block

    def set_key(self, block: int, key: int) -> None:
        """Record that held ``block`` holds the prefix ``key`` (the first block with a key keeps it)."""
        if key not in self.block_of and block not in self.key_of:
            self.key_of[block] = key
            self.block_of[key] = block

    def take(self, key: int) -> int | None:
        """The block holding prefix ``key``, now held once more (revived if it was free); or None."""
        block = self.block_of.get(key)
        if block is None:
            return None
        if self.ref_counts[block] == 0:
            del self.evictable[block]
        self.ref_counts[block] += 1
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
            if block in self.key_of:
                self.evictable[block] = None  # free, but its prefix stays findable until evicted
            else:
                self._free.append(block)


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
        for key in self.prefix_keys(tokens):
            block = self.allocator.take(key)
            if block is None:
                break
            self.block_tables[seq_id].append(block)
            self.keys[seq_id].append(key)
        cached = min(len(self.block_tables[seq_id]) * self.block_size, len(tokens) - 1)
        self.lengths[seq_id] = cached
        return cached

    def prefix_keys(self, tokens: Sequence[int], previous: int | None = None) -> list[int]:
        """The hash chain of ``tokens``' full blocks: each key hashes the block's token ids
        together with the previous block's key, so equal keys mean equal prefixes."""
        keys, bs = [], self.block_size
        for start in range(0, len(tokens) - bs + 1, bs):
            previous = hash((previous, tuple(tokens[start : start + bs])))
            keys.append(previous)
        return keys

    def uncached_keys(self, tokens: Sequence[int]) -> list[int]:
        """The prefix keys of ``tokens``' full blocks from the first one not in the cache on:
        the blocks a prefill of ``tokens`` would compute (and an empty list on a full hit)."""
        keys = self.prefix_keys(tokens)
        cached = 0
        while cached < len(keys) and keys[cached] in self.allocator.block_of:
            cached += 1
        return keys[cached:]

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
        new = self.prefix_keys(tokens[start : full * self.block_size], keys[-1] if keys else None)
        for block, key in zip(table[len(keys) : full], new):
            self.allocator.set_key(block, key)
        keys += new

    def free_sequence(self, seq_id: int) -> None:
        """Release a sequence's blocks at once, so waiting work can use them."""
        for block in self.table(seq_id):
            self.allocator.free(block)
        del self.block_tables[seq_id], self.lengths[seq_id], self.keys[seq_id]

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
