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
``torch.compile`` fuses each layer into a handful of loops and turns the one-row products into
all-core reductions (``layers.Linear``); attention through the block tables and the products of
a few rows call hand-written C++ kernels (``minillm/model/kernels``, built at first use; without
a compiler, PyTorch formulations of the same).

What gets compiled on the CPU is a group of layers (``decode_layers``: 6 of SmolLM2's 30, see
``layer_group_size``) and the LM head (``decode_logits``), not the whole step: the 5 groups
share one program, called with their own weights and pools ("regional compilation"). The
compiler traces 6 layers instead of 30, so a process is ready in 9-12 s instead of 114 s with
the compiled code on disk (65 s instead of ~250 s without); measured on the course machine, the
step is 5-9 % slower than the whole-step program (each call into compiled code checks its
guards). One-layer regions started faster still (3 s) but decoded 20 % slower, hence groups.

Those guards are dynamo's checks, before every call, that the inputs still look like the ones
the program was compiled for: ~1,600 per group (every weight's dtype, shape and strides, every
module's type and attributes). Measured on the course machine, going through them (and
gathering the ~180 inputs from the modules) cost 0.3-0.45 ms per group call, ~1.5-2 ms of a
native token. So the regions check them *once per signature* instead (``CompiledRegions``):
each program is built ahead of time and called directly, its guards checked the first time a
new shape of the step's tensors comes by. What the guards said about the weights, the runner
now says: once, when it is built, that every layer has the first one's structure (``uniform``:
the guards checked on the first group speak for the others), and before every
step, in ~10 µs, that the first layer, the norm and the LM head are the modules and tensors
they were (``structure_fingerprint``); when they are not, it plans again. A model whose layers
differ gets the whole step compiled, every guard kept.

A model whose every matrix is packed (the native GGUF, or ``weights="q8_0"``...) needs no
compiler at all on a CPU with the vector kernels: its layers, table and head are C++ already,
so the runner hands their tensors to one C++ object when it plans (``KernelLayers``) and a decode
step is one call of it, token ids to logits -- the same step, with the Python between the
kernels gone. A short prefill (up to ``STEP_PREFILL_TOKENS`` tokens and ``STEP_PREFILL_KEYS``
keys read) is that step too: a row per prompt token, each with its sequence's block table and
its own length, the head on the last tokens.

On CUDA the whole step is compiled with ``mode="reduce-overhead"``: each step is replayed as a
CUDA graph (one launch instead of hundreds), one graph per bucket of rows and table width, the
inputs padded up to the bucket with rows that write to the pool's scratch block — as vLLM and
nano-vllm do. Inductor keeps its compiled code on disk, so later processes start faster.
"""

from __future__ import annotations

import functools
import operator
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from minillm.cache.paged import PagedBatch, PagedKVCache
from minillm.model import kernels
from minillm.model.layers import Linear, RMSNorm
from minillm.model.llama import Block, Transformer
from minillm.model.quant import ends_arguments, layer_arguments, layer_matrices, packs_ends, packs_whole_layer

CUDA_ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)

# A prefill of up to this many tokens, whose rows read up to this many keys in all (row t of a
# sequence reads its position + 1), runs as the one-call step on the packed path (a row per
# token). Each row reads its own keys, where flash attention shares a key among a block of rows,
# so the keys read bound it, not only the tokens. Measured on the course machine (SmolLM2, best
# of 3) against the layer-by-layer prefill: a fresh prompt of 24 tokens 54 vs 72 ms, 64 tokens
# 150 vs 178, 256 tokens (32,896 keys) 473 vs 564, 512 tokens (131,328 keys) 925 vs 936; a
# 64-token chunk after 1,024 cached tokens (67,616 keys) 198 vs 212 ms, 32 after 2,048 (66,064)
# 131 vs 149; 64 after 4,000 (258,080) 403 vs 394; 128 after 2,048 (270,400) 467 vs 414.
STEP_PREFILL_TOKENS = 256
STEP_PREFILL_KEYS = 131_072


_EPS = operator.attrgetter("eps")


class Assignments:
    """How many modules, parameters and buffers have been assigned in this process so far:
    PyTorch calls its global registration hooks on every ``module.name = value`` of those kinds
    (``model.layers[3] = block``, ``matrix.qs = tensor``, ``register_buffer``...). A runner that
    holds tensors collected from a model re-checks where they came from only when this count
    moved (``KernelLayers.still_current``): the 1,740 identity tests for SmolLM2 cost ~0.3 ms a
    step with the caches cold from the step before, this comparison nothing."""

    count = 0

    @classmethod
    def seen(cls, module: torch.nn.Module, name: str, value: Any) -> None:
        cls.count += 1


for _register in (torch.nn.modules.module.register_module_module_registration_hook,
                  torch.nn.modules.module.register_module_parameter_registration_hook,
                  torch.nn.modules.module.register_module_buffer_registration_hook):
    _register(Assignments.seen)


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
    regions: CompiledRegions | None = None,
) -> torch.Tensor:
    """Logits [rows, vocab] for one new token per row, a group of layers after another.

    Only tensors come in (no Python bookkeeping object), so a compiled program is reused for
    every step, every engine and every row count; the lengths it needs are the tensors' sizes.
    With ``regions``, each group of layers and the LM head run as compiled programs (the CPU);
    without, this whole function is what gets compiled (CUDA, one graph per step) or run eagerly.
    """
    run_layers = regions.layers if regions else decode_layers
    run_logits = regions.logits if regions else decode_logits
    x = model.embed_tokens(token_ids)
    cos, sin = model.rotary(positions[:, None], model.dtype)
    layers = list(model.layers)  # (slicing the ModuleList itself would build new modules)
    size = regions.group_size(len(layers)) if regions else layer_group_size(len(layers))
    for first in range(0, len(layers), size):
        group = slice(first, first + size)
        x = run_layers(tuple(layers[group]), x, cos, sin, tuple(k_pools[group]), tuple(v_pools[group]),
                       positions, write_blocks, write_offsets, block_tables, context_lens)
    return run_logits(model.norm, model.lm_head, x)


def layer_group_size(n_layers: int) -> int:
    """How many consecutive layers one compiled program runs: the largest divisor of
    ``n_layers`` up to 8 (SmolLM2's 30 layers: 5 calls of 6), so that every call is the same
    program."""
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
    """A group of decoder layers of a decode step, on their own block pools: what gets compiled.

    Every group has the same code and shapes; only the weights and pools differ, and those are
    inputs. So one compiled program serves all the groups ("regional compilation"): the
    compiler traces and optimizes 6 layers instead of 30, which is what makes a process ready
    in seconds rather than a minute.
    """
    batch = PagedBatch(list(k_pools), list(v_pools), positions, write_blocks, write_offsets, block_tables,
                       context_lens)
    for index, layer in enumerate(layers):
        x = layer(x, cos, sin, None, batch, layer_idx=index)  # the batch holds only this group's pools
    return x


def decode_logits(norm: RMSNorm, lm_head: Linear, x: torch.Tensor) -> torch.Tensor:
    """The final norm and the LM head (the largest matrix) at each row's new token: [rows, vocab]."""
    return lm_head(norm(x[:, -1]))


class CompiledRegions:
    """``decode_layers`` and ``decode_logits`` compiled, each once for the whole model (the CPU).

    The pools arrive with their block count and block size marked dynamic by the runner; the
    step's other tensors get their varying dimensions (rows, table width) marked here, when a
    program is built, so that every row count above one and every table width share one
    program (marking costs ~6 µs a tensor: not at every call).

    **Guards checked once per input shape, not at every call.** A function compiled by
    ``torch.compile`` checks its guards at every call: that the inputs still look like the ones
    the program was built for. For a group of 6 layers that is ~150 weight tensors and their
    modules; measured on the course machine, calling a group through dynamo took 0.3-0.45 ms
    more than running its compiled code (~1.5-2 ms of an 8-11 ms token with packed weights).
    So each program is built ahead of time (``aot_compile``) and called directly; its guards
    are checked once for each new *signature* (the shapes and dtypes of the step's tensors and
    pools) and remembered: a new signature that no program accepts gets a new program, as a
    failed guard would. The weights are the runner's business: it checks the model's structure
    before every step (``structure_fingerprint``) and calls ``forget`` when it changed.
    """

    # Inductor's generated code checks the size and stride of every input and of every result of
    # an op it calls out to (a debugging aid): ~200 checks per group of 6 layers with packed
    # weights, each a call from Python. The guards already check the inputs before the program
    # runs, and the packed-weight ops return what they declare (tested), so the regions skip
    # them: measured 0.8-3.2 ms less per token on the course machine (native weights).
    OPTIONS = {"size_asserts": False, "alignment_asserts": False}

    # The programs built in this process, shared by every runner (engines of one model, or of
    # models with the same structure, run the same programs: the weights are inputs).
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

    def group_size(self, n_layers: int) -> int:
        """How many layers each ``layers`` call runs (one compiled program serves every group)."""
        return layer_group_size(n_layers)

    def forget(self) -> None:
        """Check the guards again at the next call of each signature (the model changed)."""
        self._accepted.clear()

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


class KernelLayers(CompiledRegions):
    """The regions of a model whose every layer is packed (``quant.packs_whole_layer``) on a CPU
    with the vector kernels: all the layers run as one call of a C++ object that holds them
    (``kernels.packed_layers``). Where the model's ends are packed too (``quant.packs_ends``:
    the embedding table, the final norm and the LM head), the whole decode step is that one call,
    token ids to logits (``decode_step``); otherwise the final norm and LM head run as the
    compiled region they are for any model.

    Such a layer is already compiled code (C++), so a compiled program around six of them only
    adds Python: measured on the course machine, 0.33 ms per call of a 6-layer region beyond the
    kernels' own time -- 1.7 ms of a ~9 ms token. Calling ``packed_decoder_layer`` once per layer
    still cost ~25 us of dispatch a layer (its 42 weight tensors converted, checked and its
    intermediates allocated at every call): 0.75 ms a token. Here the tensors are handed over
    once, when the runner plans, and a step is one call (~10 us beyond the kernels). As for the
    compiled regions, the runner checks before every step that the model is the one it planned
    for (``structure_fingerprint``: the first layer, the norm and the head; ``still_current``:
    every tensor the object holds) and plans again if not.
    """

    def __init__(self, model: Transformer) -> None:
        super().__init__()
        attention = model.layers[0].self_attn
        self._blocks = tuple(model.layers)
        self._stack = kernels.packed_layers([layer_arguments(block) for block in model.layers],
                                            attention.n_kv_heads, attention.head_dim)
        self.whole_step = packs_ends(model)
        if self.whole_step:
            self._stack.set_ends(*ends_arguments(model))
        self._watched = _where_arguments_come_from(model, self.whole_step)
        self._assignments = Assignments.count
        # what the assignment count cannot see: the layer list's own dict (``del model.layers[i]``
        # rebuilds it without a hook) and the norms' eps (a plain attribute), checked every step
        self._model, self._layer_dict = model, model.layers._modules
        self._norms = [norm for block in model.layers for norm in (block.input_layernorm, block.post_attention_layernorm)]
        self._norms += [model.norm] if self.whole_step else []
        self._eps = [norm.eps for norm in self._norms]

    def group_size(self, n_layers: int) -> int:
        return n_layers  # all of them in one call

    def still_current(self) -> bool:
        """Whether every block, module and tensor the object was built from is still where it was
        (a matrix swapped into a later layer, which ``structure_fingerprint`` does not see, is
        caught here): one identity test each, in C, for SmolLM2's 30 layers 1,740 entries --
        made only when something was assigned to a module since the last check (``Assignments``)
        or the layer list was rebuilt; the norms' eps (plain numbers, which the object holds
        copies of) are compared every time. Tensors changed in place need no check: the object
        reads them at every step."""
        if (Assignments.count == self._assignments and self._model.layers._modules is self._layer_dict
                and list(map(_EPS, self._norms)) == self._eps):
            return True
        dicts, keys, objects = self._watched
        current = all(map(operator.is_, map(dict.get, dicts, keys), objects))
        if current:
            self._assignments = Assignments.count
        return current

    def layers(self, layers: tuple[Block, ...], x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               *step: torch.Tensor | tuple[torch.Tensor, ...]) -> torch.Tensor:
        if layers != self._blocks:
            raise RuntimeError(f"KernelLayers runs all {len(self._blocks)} layers it was built for in one call, "
                               f"got {len(layers)} layers")
        k_pools, v_pools, _positions, *slots_and_tables = step
        rows = x.shape[0]
        out = self._stack.forward(x.reshape(rows, -1), cos.reshape(rows, -1), sin.reshape(rows, -1), k_pools,
                                  v_pools, *slots_and_tables)
        return out.view(rows, 1, -1)

    def decode_step(self, model: Transformer, token_ids: torch.Tensor, positions: torch.Tensor,
                    write_blocks: torch.Tensor, write_offsets: torch.Tensor, block_tables: torch.Tensor,
                    context_lens: torch.Tensor, k_pools: list[torch.Tensor], v_pools: list[torch.Tensor],
                    logits_rows: torch.Tensor | None = None) -> torch.Tensor:
        """``decode_step`` (same arguments, same logits [rows, vocab]) as one C++ call: the table's
        rows, every layer, the final norm and the head. Only the rotary angles come from Python
        (``model.rotary``, the very cos and sin every other path uses). With ``logits_rows``, the
        logits of those rows only [len(logits_rows), vocab] (a prefill's last tokens)."""
        rows = token_ids.shape[0]
        cos, sin = model.rotary(positions[:, None], model.dtype)
        return self._stack.logits(token_ids.reshape(rows), cos.reshape(rows, -1), sin.reshape(rows, -1), k_pools,
                                  v_pools, write_blocks, write_offsets, block_tables, context_lens, logits_rows)


def _where_arguments_come_from(model: Transformer, ends: bool) -> tuple[list[dict], list[str], list[Any]]:
    """Each (dictionary, key, object) that ``layer_arguments`` read for every layer: the blocks
    in the model's list, their modules, the matrices' buffers and biases, the norms' weights and
    eps; with ``ends``, what ``ends_arguments`` read of the table, the final norm and the head.
    Unzipped into three lists, for ``KernelLayers.still_current``. (The model's layer list and
    its dict come first: replacing the list, or deleting a layer, changes them.)"""
    entries = [(model._modules, "layers", model.layers), (vars(model.layers), "_modules", model.layers._modules)]
    for index, block in enumerate(model.layers):
        entries.append((model.layers._modules, str(index), block))
        for owner in (block, block.self_attn, block.mlp):
            entries += [(owner._modules, name, child) for name, child in owner._modules.items()]
        for norm in (block.input_layernorm, block.post_attention_layernorm):
            entries += [(norm._parameters, "weight", norm.weight), (vars(norm), "eps", norm.eps)]
        for matrix in layer_matrices(block):
            entries += [(matrix._buffers, name, tensor) for name, tensor in matrix._buffers.items()]
            entries.append((matrix._parameters, "bias", matrix._parameters.get("bias")))
    if ends:
        entries += [(model._modules, name, model._modules[name]) for name in ("embed_tokens", "norm", "lm_head")]
        entries += [(model.embed_tokens._modules, "table", model.embed_tokens.table),
                    (model.norm._parameters, "weight", model.norm.weight), (vars(model.norm), "eps", model.norm.eps)]
        for matrix in (model.embed_tokens.table, model.lm_head):
            entries += [(matrix._buffers, name, tensor) for name, tensor in matrix._buffers.items()]
            entries.append((matrix._parameters, "bias", matrix._parameters.get("bias")))
    dicts, keys, objects = (list(part) for part in zip(*entries))
    return dicts, keys, objects


def _build(compiled: Any, args: tuple) -> Callable[..., torch.Tensor]:
    """A compiled function's program for ``args``, built now and called without its guards;
    where ahead-of-time building is unavailable (say, inductor's caches are disabled), the
    compiled function itself, which checks its guards at every call."""
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


def layer_structure(layer: torch.nn.Module) -> tuple:
    """What a compiled program assumes of a layer: its modules' types and plain attributes, and
    its tensors' dtypes, shapes, strides and devices (not their values). ``layer_idx``, the
    layer's place in the model, is left out: the step passes each layer its index in the group."""
    modules = tuple((name, type(module).__qualname__,
                     tuple(sorted((key, value) for key, value in vars(module).items()
                                  if isinstance(value, (bool, int, float, str)) and key != "layer_idx")))
                    for name, module in layer.named_modules())
    tensors = tuple((name, tensor.dtype, tuple(tensor.shape), tensor.stride(), tensor.device)
                    for name, tensor in [*layer.named_parameters(), *layer.named_buffers()])
    return modules + tensors


def structure_fingerprint(model: Transformer) -> tuple:
    """A cheap check, made before every compiled step, that the modules a program was built for
    are still there: the identity of the first layer's, the final norm's and the LM head's
    modules, and each tensor's dtype, shape and memory (~10 µs; ``layer_structure`` takes ~90).
    Quantizing in place, ``.to(dtype)`` or swapping a module changes it."""
    def walk(module: torch.nn.Module, out: list) -> list:
        out.append(id(module))
        for tensor in [*module._parameters.values(), *module._buffers.values()]:
            out.append(None if tensor is None else (tensor.dtype, tensor.shape, tensor.data_ptr()))
        for child in module._modules.values():
            if child is not None:
                walk(child, out)
        return out

    return tuple(walk(model.layers[0], walk(model.norm, walk(model.lm_head, []))))


def uniform(model: Transformer, cache: PagedKVCache) -> bool:
    """Whether every layer and every block pool looks like the first one (then the guards checked
    on one group of layers speak for every group)."""
    first = layer_structure(model.layers[0])
    pools = {(pool.dtype, tuple(pool.shape), pool.stride()) for pool in cache.k + cache.v}
    return len(pools) == 1 and all(layer_structure(layer) == first for layer in model.layers)


def _mark_step_dynamic(args: tuple) -> None:
    """Mark the dimensions of a region's step tensors that vary: the rows when there are more
    than one (a single row is its own program, the batch-1 fast path) and the block tables'
    width. (The pools, in tuples, were marked once by the runner.)"""
    for arg in args:
        if isinstance(arg, torch.Tensor):
            if arg.shape[0] > 1:
                torch._dynamo.mark_dynamic(arg, 0)
            if arg.dtype in (torch.int32, torch.int64) and arg.dim() == 2:  # the block tables
                torch._dynamo.mark_dynamic(arg, 1)


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
        if model.device.type == "cpu":
            kernels.available()  # build or load the hand-written kernels now, not while a step is traced
        self.compile_seconds: dict[str, float] = {}  # first call of each compiled variant, in seconds
        self.trace: list[tuple[str, int]] | None = None  # set to [] to record every step: (kind, rows)
        self._decode = decode_step
        self.regions: CompiledRegions | None = None
        self._fingerprint: tuple = ()
        if compile and self.on_cuda:  # the whole step as one CUDA graph: one launch per step
            self._decode = torch.compile(decode_step, fullgraph=True, mode="reduce-overhead", dynamic=False)
        elif compile:
            self._plan_cpu_programs()
        if compile and not self.on_cuda:
            # Any pool and block size: engines of one model share the programs. Marked once here
            # (the mark stays on the tensors; marking 60 pools at every step cost ~0.4 ms).
            for pool in cache.k + cache.v:
                torch._dynamo.mark_dynamic(pool, 0)
                if pool.shape[2] > 1:  # block_size 1 is its own program (size-1 dimensions specialize)
                    torch._dynamo.mark_dynamic(pool, 2)

    def _plan_cpu_programs(self) -> None:
        """Kernel layers for a model whose every layer is packed (``KernelLayers``); else regions
        for a model whose layers are alike (one program for every group of layers, one for the
        head); else the whole step, every guard kept, for one whose layers differ (a file mixing
        float and packed matrices). Planned again whenever the model's structure changes."""
        self._fingerprint = structure_fingerprint(self.model)
        float32_pools = all(pool.dtype == torch.float32 for pool in self.cache.k + self.cache.v)
        if kernels.vectorized() and float32_pools and all(packs_whole_layer(block) for block in self.model.layers):
            self.regions = KernelLayers(self.model)
        elif uniform(self.model, self.cache):
            self.regions = self.regions if type(self.regions) is CompiledRegions else CompiledRegions()
            self.regions.forget()
        else:
            self.regions = None
        if isinstance(self.regions, KernelLayers) and self.regions.whole_step:
            self._decode = self.regions.decode_step
        elif self.regions is not None:
            self._decode = functools.partial(decode_step, regions=self.regions)
        else:
            self._decode = torch.compile(decode_step, fullgraph=True, dynamic=False)

    @property
    def decode_kind(self) -> str:
        """How a decode step runs here, in words: "one C++ call" (every matrix packed, on a CPU
        with the vector kernels: nothing to compile), "compiled" or "eager"."""
        if isinstance(self.regions, KernelLayers) and self.regions.whole_step:
            return "one C++ call"
        return "compiled" if self.compiled else "eager"

    @torch.inference_mode()
    def prefill(self, seq_ids: Sequence[int], token_lists: Sequence[Sequence[int]]) -> torch.Tensor:
        """Write the tokens of each sequence (already holding room for them) into the cache in one
        packed forward (a short one, on the packed path, as the decode step: ``_prefill_step``);
        return the logits at each one's last token, [len(seq_ids), vocab]."""
        lengths = [len(tokens) for tokens in token_lists]
        if self.trace is not None:
            self.trace.append(("prefill", len(seq_ids)))
        keys = sum(n * self.cache.lengths[seq_id] + n * (n + 1) // 2 for seq_id, n in zip(seq_ids, lengths))
        batch = self.cache.batch(seq_ids, lengths)
        flat = torch.tensor([[t for tokens in token_lists for t in tokens]], device=self.model.device)
        if self._prefill_as_step(flat.shape[1], keys):
            return self._prefill_step(flat[0], batch, lengths)
        positions = batch.positions(flat.shape[1])
        logits = self.model.run(flat, positions, None, batch, logits_index=batch.logits_index)
        return logits[0]

    def _prefill_as_step(self, tokens: int, keys: int) -> bool:
        """Whether a prefill of ``tokens`` whose rows read ``keys`` keys in all runs as the one-call
        decode step (``_prefill_step``): on the packed whole-step path, within ``STEP_PREFILL_TOKENS``
        and ``STEP_PREFILL_KEYS``."""
        if tokens > STEP_PREFILL_TOKENS or keys > STEP_PREFILL_KEYS:
            return False
        if not isinstance(self.regions, KernelLayers) or not self.regions.whole_step:
            return False
        self._plan_again_if_changed()
        return isinstance(self.regions, KernelLayers) and self.regions.whole_step

    def _plan_again_if_changed(self) -> None:
        """Plan the CPU programs again if the model changed since the last step (quantized in
        place, say): ``structure_fingerprint``, and for kernel layers ``still_current``."""
        if self.compiled and not self.on_cuda and (structure_fingerprint(self.model) != self._fingerprint or (
                isinstance(self.regions, KernelLayers) and not self.regions.still_current())):
            self._plan_cpu_programs()

    def _prefill_step(self, token_ids: torch.Tensor, batch: PagedBatch, lengths: list[int]) -> torch.Tensor:
        """A short prefill as the decode step: each prompt token a row of its own, with its sequence's
        block table and its own context length (its position + 1). The step writes every row's key
        and value before any row attends, so token t sees the tokens before it and itself -- causal
        attention, read in place like a decode step's; only each prompt's last token goes through
        the final norm and the LM head (``logits_rows``). Same logits as the layer-by-layer
        prefill to float32 rounding (the attention and the norms sum in another order)."""
        assert isinstance(self.regions, KernelLayers)
        rows_of_tokens = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
        positions = batch.positions_flat
        logits = self.regions.decode_step(self.model, token_ids, positions, batch.write_blocks, batch.write_offsets,
                                          batch.block_tables[rows_of_tokens], positions + 1, self.cache.k, self.cache.v,
                                          logits_rows=batch.logits_index)
        batch.advance(len(token_ids))
        return logits

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
        if self.compiled and not self.on_cuda and self.regions is None:  # (the regions mark their own)
            # One program for every row count > 1 and every table width; a single row is its
            # own program (the compiler specializes size-1 dimensions, and rows=1 is the
            # batch-1 fast path). CUDA instead pads to buckets: a CUDA graph has fixed shapes.
            if rows > 1:
                for tensor in args[1:7]:
                    torch._dynamo.mark_dynamic(tensor, 0)
            torch._dynamo.mark_dynamic(batch.block_tables, 1)
        self._plan_again_if_changed()
        variant = "rows=1" if rows == 1 else "rows>1"
        start = time.perf_counter()
        logits = self._decode(*args)[:rows]
        if self.compiled and variant not in self.compile_seconds:
            self.compile_seconds[variant] = time.perf_counter() - start
        self.cache.manager.advance(seq_ids, [1] * rows)
        return logits
