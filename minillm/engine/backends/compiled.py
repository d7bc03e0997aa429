"""The compiled backend: the decode step through ``torch.compile``.

A decode step of the eager model is a few thousand small ops, each paying Python and dispatch
overhead; compiled, each layer becomes a handful of fused loops. On a CPU, what gets compiled
is a *group* of layers (``decode_layers``: 6 of SmolLM2's 30) and the LM head, not the whole
step: every group has the same code and shapes — only its weights and pools differ, and those
are inputs — so one program serves all five groups ("regional compilation"), and the compiler
traces 6 layers instead of 30, which is what makes a process ready in seconds, not minutes.

On CUDA the whole step is compiled with ``mode="reduce-overhead"``: it is replayed as a CUDA
graph (one launch instead of hundreds). A graph has fixed shapes and fixed addresses, so the
pools are marked static and the step is padded up to a bucket of rows and of table width, the
padding rows writing to the pool's scratch block — as vLLM and nano-vllm do.

An engine owns its model: the programs are built for the model as it was when the engine was
built, and editing the model under a running engine is not supported.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch

from minillm.cache.paged import PagedKVCache, PagedStep
from minillm.engine.backends.eager import EagerBackend
from minillm.model.layers import Linear, RMSNorm
from minillm.model.llama import Block, Transformer

CUDA_ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


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
    regions: CompiledRegions | None = None,
) -> torch.Tensor:
    """Logits [rows, vocab] for one new token per row, a group of layers after another.

    Only tensors come in (no Python bookkeeping object), so a compiled program is reused for
    every step, every engine and every row count. With ``regions``, each group of layers and the
    LM head run as compiled programs (the CPU); without, this whole function is what gets
    compiled (CUDA: one graph per bucket).
    """
    run_layers = regions.layers if regions else decode_layers
    run_logits = regions.logits if regions else decode_logits
    x = model.embed_tokens(token_ids[:, None])
    cos, sin = model.rotary(positions[:, None], model.dtype)
    layers = list(model.layers)  # (slicing the ModuleList itself would build new modules)
    size = layer_group_size(len(layers)) if regions else len(layers)
    for first in range(0, len(layers), size):
        group = slice(first, first + size)
        x = run_layers(tuple(layers[group]), x, cos, sin, tuple(k_pools[group]), tuple(v_pools[group]),
                       positions, write_blocks, write_offsets, block_tables, context_lens)
    return run_logits(model.norm, model.lm_head, x)


def layer_group_size(n_layers: int) -> int:
    """How many consecutive layers one compiled program runs: the largest divisor of
    ``n_layers`` up to 8 (SmolLM2's 30 layers: 5 calls of 6), so every call is the same program."""
    return max(size for size in range(1, 9) if n_layers % size == 0)


def decode_layers(
    layers: tuple[Block, ...],
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_pools: tuple[torch.Tensor, ...],
    v_pools: tuple[torch.Tensor, ...],
    positions: torch.Tensor,
    write_blocks: torch.Tensor,
    write_offsets: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
) -> torch.Tensor:
    """A group of decoder layers of a decode step, on their own pools: what gets compiled."""
    step = PagedStep(list(k_pools), list(v_pools), positions, write_blocks, write_offsets, block_tables,
                     context_lens)
    for index, layer in enumerate(layers):
        x = layer(x, cos, sin, paged=step, layer_idx=index)  # the step holds only this group's pools
    return x


def decode_logits(norm: RMSNorm, lm_head: Linear, x: torch.Tensor) -> torch.Tensor:
    """The final norm and the LM head (the largest matrix) at each row's new token: [rows, vocab]."""
    return lm_head(norm(x[:, -1]))


class CompiledRegions:
    """``decode_layers`` and ``decode_logits`` compiled, each once for the whole model (the CPU).

    **Guards checked once per input shape, not at every call.** A function compiled by
    ``torch.compile`` checks its guards at every call — that the ~150 weight tensors of a group
    and their modules still look like the ones the program was built for — which costs about as
    much as a layer's arithmetic here. So each program is built ahead of time (``aot_compile``)
    and called directly; its guards are checked once for each new *signature* (the shapes of
    the step's tensors and pools) and remembered. ``aot_compile`` is not a stable torch API:
    where it is missing or fails, the regions call the guarded compiled function instead, which
    is slower and otherwise the same.
    """

    # Inductor's generated code checks the size and stride of every input and every extern op's
    # result (a debugging aid); the guards already checked the inputs, so skip them.
    OPTIONS = {"size_asserts": False, "alignment_asserts": False}

    # The programs built in this process, shared by every engine (the weights are inputs).
    _built: dict[str, list[Callable[..., torch.Tensor]]] = {"layers": [], "logits": []}

    def __init__(self) -> None:
        self._layers = torch.compile(decode_layers, fullgraph=True, dynamic=False, options=self.OPTIONS)
        self._logits = torch.compile(decode_logits, fullgraph=True, dynamic=False, options=self.OPTIONS)
        self._accepted: dict[tuple, Callable[..., torch.Tensor]] = {}  # signature -> the program whose guards passed

    def layers(self, layers: tuple[Block, ...], x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               *step: torch.Tensor | tuple[torch.Tensor, ...]) -> torch.Tensor:
        args = (layers, x, cos, sin, *step)
        k_pools, block_tables = step[0], step[5]
        signature = ("layers", len(layers), x.dtype, x.shape, k_pools[0].shape, block_tables.shape)  # type: ignore[union-attr]
        return self._program(self._layers, "layers", signature, args)(*args)

    def logits(self, norm: RMSNorm, lm_head: Linear, x: torch.Tensor) -> torch.Tensor:
        args = (norm, lm_head, x)
        return self._program(self._logits, "logits", ("logits", x.dtype, x.shape), args)(*args)

    def _program(self, compiled: Callable[..., torch.Tensor], kind: str, signature: tuple,
                 args: tuple) -> Callable[..., torch.Tensor]:
        program = self._accepted.get(signature)
        if program is None:
            _mark_step_dynamic(args)
            program = next((p for p in self._built[kind] if _guards_pass(p, args)), None)
            if program is None:
                program = _build(compiled, args)
                self._built[kind].append(program)
            self._accepted[signature] = program
        return program


def _build(compiled: Any, args: tuple) -> Callable[..., torch.Tensor]:
    """A compiled function's program for ``args``, built now and called without its guards; where
    ahead-of-time building is unavailable, the compiled function itself (guards at every call)."""
    try:
        program = compiled.aot_compile((args, {}))
    except Exception as error:  # noqa: BLE001 (any failure: the guarded function still works)
        print(f"minillm: ahead-of-time compile unavailable ({type(error).__name__}: {error}); "
              "calling the compiled step with its guards", file=sys.stderr)
        return compiled
    program.disable_guard_check()  # checked by CompiledRegions, once per signature
    return program


def _guards_pass(program: Any, args: tuple) -> bool:
    check = getattr(program, "guard_check", None)
    return check(*args) if check is not None else True  # (the guarded fallback checks its own)


def _mark_step_dynamic(args: tuple) -> None:
    """Mark the dimensions of a region's step tensors that vary: the rows when there are more
    than one (a single row is its own program, the batch-1 fast path) and the block tables' width."""
    for arg in args:
        if isinstance(arg, torch.Tensor):
            if arg.shape[0] > 1:
                torch._dynamo.mark_dynamic(arg, 0)
            if arg.dtype in (torch.int32, torch.int64) and arg.dim() == 2:  # the block tables
                torch._dynamo.mark_dynamic(arg, 1)


def layer_structure(layer: torch.nn.Module) -> tuple:
    """What a compiled program assumes of a layer: its modules' types and plain attributes, and
    its tensors' dtypes, shapes, strides and devices (not their values)."""
    modules = tuple((name, type(module).__qualname__,
                     tuple(sorted((key, value) for key, value in vars(module).items()
                                  if isinstance(value, (bool, int, float, str)) and key != "layer_idx")))
                    for name, module in layer.named_modules())
    tensors = tuple((name, tensor.dtype, tuple(tensor.shape), tensor.stride(), tensor.device)
                    for name, tensor in [*layer.named_parameters(), *layer.named_buffers()])
    return modules + tensors


def uniform(model: Transformer, cache: PagedKVCache) -> bool:
    """Whether every layer and every pool looks like the first one (then one program, whose guards
    were checked on the first group, serves every group)."""
    first = layer_structure(model.layers[0])
    pools = {(pool.dtype, tuple(pool.shape), pool.stride()) for pool in cache.k + cache.v}
    return len(pools) == 1 and all(layer_structure(layer) == first for layer in model.layers)


class CompiledBackend(EagerBackend):
    """Prefill eagerly (see ``eager.py``); decode through compiled programs."""

    name = "compiled"
    compiles = True

    def __init__(self, model: Transformer, cache: PagedKVCache) -> None:
        super().__init__(model)
        self.cache = cache
        self.on_cuda = model.device.type == "cuda"
        self.regions: CompiledRegions | None = None
        if self.on_cuda:
            # One graph per (row bucket, width bucket): raise dynamo's recompile limit to cover them,
            # or it would silently fall back to eager after the eighth.
            limit = len(CUDA_ROW_BUCKETS) * 16
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, limit)
            torch._dynamo.config.accumulated_recompile_limit = max(
                torch._dynamo.config.accumulated_recompile_limit, 4 * limit)
            for pool in cache.k + cache.v:
                torch._dynamo.mark_static_address(pool)  # a CUDA graph reads and writes them where they are
            self._step: Callable[..., torch.Tensor] = torch.compile(decode_step, fullgraph=True, mode="reduce-overhead",
                                                                    dynamic=False)
            return
        # Any pool and block size: engines of one model share the programs. Marked once here.
        for pool in cache.k + cache.v:
            torch._dynamo.mark_dynamic(pool, 0)
            if pool.shape[2] > 1:  # block_size 1 is its own program (size-1 dimensions specialize)
                torch._dynamo.mark_dynamic(pool, 2)
        if uniform(model, cache):
            self.regions = CompiledRegions()
            self._step = decode_step
        else:  # a model whose layers differ (a file mixing float and packed matrices): the whole step
            self._step = torch.compile(decode_step, fullgraph=True, dynamic=False)

    def decode(self, token_ids: torch.Tensor, step: PagedStep) -> torch.Tensor:
        args = (token_ids, step.positions, step.write_blocks, step.write_offsets, step.block_tables,
                step.context_lens)
        if not self.on_cuda and self.regions is None:
            if token_ids.shape[0] > 1:  # one program for every row count > 1 and every table width
                for tensor in args:
                    torch._dynamo.mark_dynamic(tensor, 0)
            torch._dynamo.mark_dynamic(step.block_tables, 1)
        return self._step(self.model, *args, step.k_pools, step.v_pools, regions=self.regions)

    def padded_rows(self, rows: int) -> int:
        return next(b for b in CUDA_ROW_BUCKETS + (rows,) if b >= rows) if self.on_cuda else rows

    def padded_width(self, width: int) -> int:
        return 1 << (width - 1).bit_length() if self.on_cuda else width  # powers of two: a few graphs cover every length
