"""One scheduler, many ranks: rank 0 plans every step and sends its inputs; every rank runs it.

Tensor parallelism is a property of the backend and of the weights, not a second engine: the
scheduler, the block manager and the sampler run once, on rank 0, exactly as in one process.
Each step the runner builds (a ``PagedStep``: positions, write slots, block tables, lengths,
which tokens need logits) plus its token ids is broadcast to the other ranks, and every rank
then runs the same backend call on its shard — its model's collectives meet in the middle.
The other ranks hold KV pools of the same number of blocks (their KV heads only) and never
decide anything: the block ids in the step are rank 0's, and they mean the same blocks
everywhere. Copy-on-write copies (``PagedKVCache.copy_blocks``) travel the same way.

How it plugs into the engine (rank 0):

    group = init_group(...)                              # or launch.run_ranks / torchrun
    model, tokenizer, shard = load_tensor_parallel(None, group)
    cache = TensorParallelKVCache(group, shard.local_config(model.config), num_blocks, block_size)
    backend = TensorParallelBackend(EagerBackend(model), group)   # what choose_backend returns
    ... the engine runs as usual; at the end: backend.stop()

and on every other rank, the whole program is:

    model, _, shard = load_tensor_parallel(None, group)
    cache = PagedKVCache(shard.local_config(model.config), num_blocks, block_size)
    serve_steps(group, EagerBackend(model), cache)      # returns when rank 0 calls stop()

A message is a header of 8 integers on the control group (which waits without a timeout to
speak of: an idle server is no failure), then one flat int64 tensor with the step's tensors
end to end on the compute group.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from minillm.cache.base import KVShape
from minillm.cache.paged import PagedKVCache, PagedStep
from minillm.distributed.group import Group

STOP, PREFILL, DECODE, COPY = range(4)
HEADER = 8  # kind, tokens, rows, table width, logits (or -1), has q_lens, copies, spare


class StepSender:
    """Rank 0's side: sends each step (or copy, or stop) to the other ranks."""

    def __init__(self, group: Group) -> None:
        self.group = group

    def send(self, kind: int, token_ids: torch.Tensor | None = None, step: PagedStep | None = None,
             copies: Sequence[tuple[int, int]] = ()) -> None:
        if self.group.world_size == 1:
            return
        payload: list[torch.Tensor] = []
        header = [kind, 0, 0, 0, -1, 0, len(copies), 0]
        if step is not None and token_ids is not None:
            header[1:4] = [token_ids.numel(), step.block_tables.shape[0], step.block_tables.shape[1]]
            payload += [token_ids, step.positions, step.write_blocks, step.write_offsets, step.block_tables,
                        step.context_lens]
            if step.logits_index is not None:
                header[4] = step.logits_index.numel()
                payload.append(step.logits_index)
            if step.q_lens is not None:
                header[5] = 1
                payload.append(torch.tensor(step.q_lens))
        if copies:
            payload.append(torch.tensor(copies).view(-1))
        self.group.broadcast(torch.tensor(header, dtype=torch.long), control=True)
        if payload:
            self.group.broadcast(torch.cat([t.reshape(-1).long().cpu() for t in payload]))


def receive(group: Group, cache: PagedKVCache) -> tuple[int, torch.Tensor | None, PagedStep | None, list]:
    """A worker's side of ``StepSender.send``: (kind, token ids, step on ``cache``'s pools, copies)."""
    header = group.broadcast(torch.empty(HEADER, dtype=torch.long), control=True).tolist()
    kind, tokens, rows, width, n_logits, has_q_lens, n_copies, _ = header
    size = 4 * tokens + rows * width + rows + max(n_logits, 0) + has_q_lens * rows + 2 * n_copies
    if size == 0:
        return kind, None, None, []
    flat = group.broadcast(torch.empty(size, dtype=torch.long))
    sizes = [tokens] * 4 + [rows * width, rows, max(n_logits, 0), has_q_lens * rows, 2 * n_copies]
    ids, positions, blocks, offsets, tables, lens, logits, q_lens, copies = flat.split(sizes)
    device = cache.device
    step = None
    if kind in (PREFILL, DECODE):
        step = PagedStep(k_pools=cache.k, v_pools=cache.v, positions=positions.to(device),
                         write_blocks=blocks.to(device), write_offsets=offsets.to(device),
                         block_tables=tables.view(rows, width).to(device), context_lens=lens.to(device),
                         logits_index=logits.to(device) if n_logits >= 0 else None,
                         q_lens=q_lens.tolist() if has_q_lens else None)
    return kind, ids.to(device), step, copies.view(-1, 2).tolist()


def receive_pool_size(group: Group) -> tuple[int, int]:
    """A worker's first message: the (num_blocks, block_size) of rank 0's ``TensorParallelKVCache``."""
    num_blocks, block_size = group.broadcast(torch.empty(2, dtype=torch.long), control=True).tolist()
    return num_blocks, block_size


def serve_steps(group: Group, backend, cache: PagedKVCache) -> int:
    """A worker rank's whole life: run every step rank 0 sends, on ``cache``'s pools, until it
    sends stop; returns how many steps ran. ``backend`` is the same kind rank 0 runs (its
    logits are thrown away here: rank 0 samples)."""
    steps = 0
    while True:
        kind, ids, step, copies = receive(group, cache)
        if kind == STOP:
            return steps
        if kind == COPY:
            cache.copy_blocks(copies)
            continue
        (backend.prefill if kind == PREFILL else backend.decode)(ids, step)
        steps += 1


class TensorParallelBackend:
    """Rank 0's backend: sends each step to the other ranks, then runs it with ``inner``
    (an ``EagerBackend`` of the rank's model), whose collectives meet theirs."""

    def __init__(self, inner, group: Group) -> None:
        self.inner, self.sender = inner, StepSender(group)
        self.name = f"{inner.name} x{group.world_size} ranks"
        self.compiles = inner.compiles

    def prefill(self, token_ids: torch.Tensor, step: PagedStep) -> torch.Tensor:
        self.sender.send(PREFILL, token_ids, step)
        return self.inner.prefill(token_ids, step)

    def decode(self, token_ids: torch.Tensor, step: PagedStep) -> torch.Tensor:
        self.sender.send(DECODE, token_ids, step)
        return self.inner.decode(token_ids, step)

    def padded_rows(self, rows: int) -> int:
        return self.inner.padded_rows(rows)

    def padded_width(self, width: int) -> int:
        return self.inner.padded_width(width)

    def stop(self) -> None:
        """Release the other ranks from ``serve_steps``."""
        self.sender.send(STOP)


class TensorParallelKVCache(PagedKVCache):
    """Rank 0's paged cache: its copy-on-write copies happen on every rank's pools. Built, it
    tells the other ranks its size (``receive_pool_size``), so they build pools of the same blocks."""

    def __init__(self, group: Group, config: KVShape, num_blocks: int, block_size: int = 16, **kwargs) -> None:
        super().__init__(config, num_blocks, block_size, **kwargs)
        self.sender = StepSender(group)
        if group.world_size > 1:
            group.broadcast(torch.tensor([num_blocks, block_size]), control=True)

    def copy_blocks(self, copies: Sequence[tuple[int, int]]) -> None:
        if copies:
            self.sender.send(COPY, copies=list(copies))
        super().copy_blocks(copies)
