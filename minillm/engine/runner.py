"""The model runner: one step function on the paged cache, compiled for decode.

Every path that generates text — the engine's continuous batching, beam search, streaming,
the CLI, the demo, the benchmarks — ends up here, in two calls:

* ``prefill(seq_ids, token_lists)``: the admitted prompts packed end to end into one
  ``[1, tokens]`` forward, each attending causally to itself (``paged_prefill_attention``);
  the LM head runs only at each prompt's last token. Eager: a prompt is a matrix-matrix
  product, which MKL/cuBLAS already run at full speed, and its length changes every time.
* ``decode(seq_ids, tokens)``: one new token for every running row, ``[rows, 1]``, attending
  through the block tables in place (``paged_decode_attention``). This is the step that runs
  hundreds of times per answer, so it is **compiled**.

Both run ``Transformer.run`` on a ``PagedBatch``: the step metadata (positions, write slots,
block tables, lengths, which rows need logits) built on the host by the caller's plan. The
step itself reads nothing back from the device.

What compiling buys on the CPU (measured on the course machine, notebook 10 shows the
profile): a decode step of the eager model is a few thousand small ops, each paying Python
and dispatch overhead, and MKL's one-row matrix products stream the weights on one core.
``torch.compile`` fuses each layer into a handful of loops, turns the one-row products into
all-core reductions (``layers.Linear``), and fuses the block-table reads into attention.
On CUDA it compiles with ``mode="reduce-overhead"``: each step is replayed as a CUDA graph
(one launch instead of hundreds), one graph per bucket of rows and table width, the inputs
padded up to the bucket with rows that write to the pool's scratch block — as vLLM and
nano-vllm do. Inductor keeps its compiled code on disk, so later processes start faster.
"""

from __future__ import annotations

import shutil
import sys
import time
from collections.abc import Sequence

import torch

from minillm.cache.paged import PagedBatch, PagedKVCache
from minillm.model.llama import Transformer

CUDA_ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def can_compile(device: torch.device) -> tuple[bool, str]:
    """Whether ``torch.compile`` can build code here, and if not, why (said to the user)."""
    if device.type == "cpu" and not any(shutil.which(cxx) for cxx in ("g++", "c++", "clang++")):
        return False, "no C++ compiler found (torch.compile writes C++ for the CPU); running eagerly"
    if sys.platform == "win32":
        return False, "torch.compile is not supported on Windows here; running eagerly"
    return True, ""


def decode_step(
    model: Transformer,
    token_ids: torch.Tensor,
    positions: torch.Tensor,
    write_blocks: torch.Tensor,
    write_offsets: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    k_pools: list[torch.Tensor],
    v_pools: list[torch.Tensor],
) -> torch.Tensor:
    """Logits [rows, vocab] for one new token per row: the function that gets compiled.

    Only tensors come in (no Python bookkeeping object), so the compiled program is reused for
    every step, every engine and every row count; the lengths it needs are the tensors' sizes.
    """
    batch = PagedBatch(k_pools, v_pools, positions, write_blocks, write_offsets, block_tables, context_lens)
    return model.run(token_ids, positions[:, None], None, batch)[:, -1]


class ModelRunner:
    """Runs prefill and decode steps of a model on a ``PagedKVCache``.

    Args:
        model: the loaded ``Transformer``.
        cache: the block pool it reads and writes (its ``BlockManager`` holds the tables).
        compile: compile the decode step (default: when this machine can; see ``can_compile``).
    """

    def __init__(self, model: Transformer, cache: PagedKVCache, compile: bool | None = None) -> None:
        self.model = model
        self.cache = cache
        self.on_cuda = model.device.type == "cuda"
        if compile is None:
            compile, why = can_compile(model.device)
            if not compile:
                print(f"minillm: {why}", file=sys.stderr)
        self.compiled = compile
        self.compile_seconds: dict[str, float] = {}  # first call of each compiled variant, in seconds
        self.trace: list[tuple[str, int]] | None = None  # set to [] to record every step: (kind, rows)
        self._decode = decode_step
        if compile:
            mode = "reduce-overhead" if self.on_cuda else None  # CUDA graphs on a GPU
            self._decode = torch.compile(decode_step, fullgraph=True, mode=mode, dynamic=False)

    @torch.inference_mode()
    def prefill(self, seq_ids: Sequence[int], token_lists: Sequence[Sequence[int]]) -> torch.Tensor:
        """Write the tokens of each sequence (already holding room for them) into the cache in one
        packed forward; return the logits at each one's last token, [len(seq_ids), vocab]."""
        lengths = [len(tokens) for tokens in token_lists]
        if self.trace is not None:
            self.trace.append(("prefill", len(seq_ids)))
        batch = self.cache.batch(seq_ids, lengths)
        flat = torch.tensor([[t for tokens in token_lists for t in tokens]], device=self.model.device)
        positions = batch.positions(flat.shape[1])
        logits = self.model.run(flat, positions, None, batch, logits_index=batch.logits_index)
        return logits[0]

    @torch.inference_mode()
    def decode(self, seq_ids: Sequence[int], tokens: Sequence[int] | torch.Tensor) -> torch.Tensor:
        """One step for rows whose sequences already hold room for one more token: feed
        ``tokens[i]`` to ``seq_ids[i]``; return logits [len(seq_ids), vocab]."""
        rows = len(seq_ids)
        if self.trace is not None:
            self.trace.append(("decode", rows))
        pad_to = next(b for b in CUDA_ROW_BUCKETS + (rows,) if b >= rows) if self.on_cuda else None
        batch = self.cache.batch(seq_ids, [1] * rows, pad_rows_to=pad_to)
        if self.on_cuda:
            width = batch.block_tables.shape[1]
            bucket = 1 << (width - 1).bit_length()  # powers of two: a few CUDA graphs cover every length
            pad = torch.full((batch.block_tables.shape[0], bucket - width), self.cache.scratch_block,
                             device=batch.block_tables.device, dtype=batch.block_tables.dtype)
            batch.block_tables = torch.cat([batch.block_tables, pad], dim=1)
        token_ids = torch.as_tensor(tokens, device=self.model.device).view(-1)
        if pad_to is not None and pad_to > rows:
            token_ids = torch.cat([token_ids, token_ids.new_zeros(pad_to - rows)])
        args = (self.model, token_ids[:, None], batch.positions_flat, batch.write_blocks, batch.write_offsets,
                batch.block_tables, batch.context_lens, self.cache.k, self.cache.v)
        if self.compiled and not self.on_cuda:
            # One program for every row count > 1 and every table width; a single row is its
            # own program (the compiler specializes size-1 dimensions, and rows=1 is the
            # batch-1 fast path). CUDA instead pads to buckets: a CUDA graph has fixed shapes.
            if rows > 1:
                for tensor in args[1:7]:
                    torch._dynamo.mark_dynamic(tensor, 0)
            torch._dynamo.mark_dynamic(batch.block_tables, 1)
            for pool in self.cache.k + self.cache.v:  # any pool and block size: engines of one model share it
                torch._dynamo.mark_dynamic(pool, 0)
                if pool.shape[2] > 1:  # block_size 1 is its own program (size-1 dimensions specialize)
                    torch._dynamo.mark_dynamic(pool, 2)
        variant = "rows=1" if rows == 1 else "rows>1"
        start = time.perf_counter()
        logits = self._decode(*args)[:rows]
        if self.compiled and variant not in self.compile_seconds:
            self.compile_seconds[variant] = time.perf_counter() - start
        self.cache.manager.advance(seq_ids, [1] * rows)
        return logits
