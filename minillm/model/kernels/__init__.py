"""Hand-written CPU kernels, compiled on this machine at first use.

* ``quant.cpp`` multiplies by Q8_0 / Q4_0 / Q4_1 blocks without expanding them (notebook 11
  explains why PyTorch's own kernels could not: they spend more instructions turning 4 bits
  into a float than the bytes save).
* ``linear.cpp`` multiplies the few rows of a batched decode step by a float32 weight matrix,
  each weight read once for all the rows (the libraries' GEMMs are tuned for large matrices).
* ``paged_attention.cpp`` runs a decode step's attention through the block tables, reading each
  cached block once where it lies (notebook 10: what it changes at long contexts).
* ``decoder_layer.cpp`` runs a whole decoder layer of a decode step with packed weights in one
  call (norms, products, RoPE, the KV write, attention, SwiGLU, residuals), and ``PackedLayers``
  runs every layer, the embedding table and the LM head in one call per step: the step of a
  packed model on the CPU, without Python glue between the kernels (notebook 11).

They are built into one library the way ``torch.compile`` builds its C++: on this machine, for
this CPU (``-march=native``), once — the library is kept in ``$MINILLM_CACHE/kernels`` under a
name that hashes the sources, the compiler flags, the torch version and the CPU, so a change to
any of them builds afresh. Nothing is downloaded and no prebuilt binary is trusted.

When the build cannot happen (no C++ compiler, a compiler error, ``MINILLM_KERNELS=0``) the
reason is kept in ``why_unavailable()`` and the callers (``QuantizedLinear``,
``paged_decode_attention``) use their PyTorch formulations instead: slower, the same numbers up
to float32 rounding.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Optional

import torch

from minillm.assets import cache_dir

QUANT_SOURCE = Path(__file__).with_name("quant.cpp")
ATTENTION_SOURCE = Path(__file__).with_name("paged_attention.cpp")
LINEAR_SOURCE = Path(__file__).with_name("linear.cpp")
LAYER_SOURCE = Path(__file__).with_name("decoder_layer.cpp")
SOURCES = (QUANT_SOURCE, ATTENTION_SOURCE, LINEAR_SOURCE, LAYER_SOURCE)
HEADERS = (Path(__file__).with_name("simd.h"), Path(__file__).with_name("kernels.h"))
BUILD_SECONDS = 300  # a build takes well under a minute; a compiler that hangs must not hang the caller

_loaded: Optional[bool] = None  # None: not tried yet in this process
_why = ""
_vectorized = False  # built with the AVX-512 or AVX2 versions (set when the library loads)


def available() -> bool:
    """Whether the kernels are loaded (building them the first time it is asked)."""
    global _loaded, _why, _vectorized
    if _loaded is None and torch.compiler.is_compiling():
        return False  # never build inside a traced program: the caller runs eagerly first (ModelRunner does)
    if _loaded is None:
        try:
            library = _build()
            torch.ops.load_library(str(library))
            _register_shapes()
            _vectorized = bool(torch.ops.minillm.vectorized())
            _loaded = True
        except (OSError, RuntimeError, subprocess.SubprocessError) as err:
            _loaded, _why = False, str(err)
    return _loaded


def vectorized() -> bool:
    """Whether the float32 kernels of the decode step (``f32_linear``, ``paged_decode_attention``)
    are the vector versions (AVX-512 or AVX2). Their portable versions are correct but slower than
    PyTorch's own paths, so callers use them only when this is True. (The packed-weight products
    are called either way; their portable loop is much slower than the vector code.)"""
    return available() and _vectorized


def why_unavailable() -> str:
    """Why ``available()`` is False ("" when it is True or was not asked yet)."""
    return _why


def linear(fmt: str, x: torch.Tensor, qs: torch.Tensor, d: torch.Tensor, m: Optional[torch.Tensor],
           cols: Optional[torch.Tensor] = None, w_cols: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``x`` [rows, in] float32 times the blocks' matrix transposed: [rows, out]; plus, when given,
    the input columns ``cols`` [k] kept in float32 beside the blocks, ``w_cols`` [k, out]."""
    if fmt == "q8_0":
        return torch.ops.minillm.q8_0_linear(x, qs, d, cols, w_cols)
    return torch.ops.minillm.q4_linear(x, qs, d, m if fmt == "q4_1" else None, cols, w_cols)


def linears(x: torch.Tensor, qs: list[torch.Tensor], d: list[torch.Tensor], m: list[Optional[torch.Tensor]],
            cols: Optional[list[Optional[torch.Tensor]]] = None,
            w_cols: Optional[list[Optional[torch.Tensor]]] = None) -> list[torch.Tensor]:
    """``x`` [rows, in] times several packed matrices that read it (a layer's q, k and v): one
    ``[rows, out_i]`` per matrix, the cores splitting all their rows in one pass. Each matrix is
    ``qs[i], d[i], m[i]`` as in ``linear``; its format follows from them (int8 ``qs``: Q8_0;
    uint8 with ``m``: Q4_1; without: Q4_0). ``cols[i]`` / ``w_cols[i]``: the input columns a
    matrix keeps in float32 beside its blocks and their weights (``quant.quantize_with_outliers``),
    added in the same pass."""
    none: list[Optional[torch.Tensor]] = [None] * len(qs)
    return torch.ops.minillm.packed_linears(x, qs, d, m, none if cols is None else cols,
                                            none if w_cols is None else w_cols)


def f32_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x`` [rows, in] float32 times ``weight`` [out, in] transposed: [rows, out]."""
    return torch.ops.minillm.f32_linear(x, weight)


def paged_decode_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, block_tables: torch.Tensor,
                           context_lens: torch.Tensor) -> torch.Tensor:
    """One query per row [rows, n_heads, head_dim] over its keys in float32 pools, read through
    ``block_tables`` [rows, width] (int64) up to ``context_lens`` [rows] (int64)."""
    return torch.ops.minillm.paged_decode_attention(q, k_pool, v_pool, block_tables, context_lens)


def packed_decoder_layer(x: torch.Tensor, layer: tuple, cos: torch.Tensor, sin: torch.Tensor, k_pool: torch.Tensor,
                         v_pool: torch.Tensor, write_blocks: torch.Tensor, write_offsets: torch.Tensor,
                         block_tables: torch.Tensor, context_lens: torch.Tensor) -> torch.Tensor:
    """One decoder layer for one new token per row, x [rows, hidden] float32 -> [rows, hidden];
    the new keys and values are written into ``k_pool``, ``v_pool`` at ``write_blocks``,
    ``write_offsets``. ``layer``: ``backends.packed_cpu.layer_arguments(block)`` (the two norms' weights, eps,
    then the seven matrices' ``qs, d, m, cols, w_cols`` and biases, one list each, in the order
    q, k, v, o, gate, up, down); ``cos``, ``sin`` [rows, head_dim]."""
    return torch.ops.minillm.packed_decoder_layer(x, *layer, cos, sin, k_pool, v_pool, write_blocks, write_offsets,
                                                  block_tables, context_lens)


def packed_layers(layers: list[tuple], n_kv_heads: int, head_dim: int) -> Any:
    """Every layer of a packed model handed to C++ once (``layers``: each one's
    ``backends.packed_cpu.layer_arguments``), checked now: an object whose ``forward(x, cos, sin, k_pools,
    v_pools, write_blocks, write_offsets, block_tables, context_lens)`` runs one decode step
    through all of them, layer i on ``k_pools[i]``, ``v_pools[i]`` -- one call per step where
    ``packed_decoder_layer`` is one per layer. After ``set_ends(*backends.packed_cpu.ends_arguments(model))``
    (the table, the final norm and the head), ``logits(token_ids, cos, sin, k_pools, ...)`` is
    the whole decode step, token ids [rows] to logits [rows, vocab]."""
    input_norms, post_norms, eps, qs, d, m, cols, w_cols, bias = zip(*layers)
    flat = [[tensor for matrices in part for tensor in matrices] for part in (qs, d, m, cols, w_cols, bias)]
    return torch.classes.minillm.PackedLayers(n_kv_heads, head_dim, list(input_norms), list(post_norms),
                                              [float(e) for e in eps], *flat)


def _register_shapes() -> None:
    """What the ops return, for ``torch.compile`` to trace them without running them."""

    def fake_linear(x: torch.Tensor, qs: torch.Tensor, *blocks: Optional[torch.Tensor]) -> torch.Tensor:
        return x.new_empty(x.shape[0], qs.shape[0])

    def fake_attention(q: torch.Tensor, *pools_and_tables: torch.Tensor) -> torch.Tensor:
        return torch.empty_like(q, memory_format=torch.contiguous_format)

    torch.library.register_fake("minillm::q8_0_linear", fake_linear)
    torch.library.register_fake("minillm::q4_linear", fake_linear)
    torch.library.register_fake("minillm::packed_linears",
                                lambda x, qs, d, m, cols, w_cols: [x.new_empty(x.shape[0], q.shape[0]) for q in qs])
    torch.library.register_fake("minillm::paged_decode_attention", fake_attention)
    torch.library.register_fake("minillm::packed_decoder_layer", lambda x, *rest: torch.empty_like(x))
    torch.library.register_fake("minillm::f32_linear", lambda x, weight: x.new_empty(x.shape[0], weight.shape[0]))


def _compiler() -> str:
    for name in (os.environ.get("CXX", ""), "g++", "c++", "clang++"):
        if name and shutil.which(name):
            return name
    raise RuntimeError("no C++ compiler found (g++, c++ or clang++): the kernels cannot be built")


def _command(compiler: str, output: Path) -> list[str]:
    from torch.utils import cpp_extension  # the include and library folders of the installed torch

    includes = [f"-I{folder}" for folder in cpp_extension.include_paths()]
    libraries = cpp_extension.library_paths()
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    return [compiler, "-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++20", "-w",
            f"-D_GLIBCXX_USE_CXX11_ABI={abi}", *includes, *map(str, SOURCES), "-o", str(output),
            *[f"-L{folder}" for folder in libraries], *[f"-Wl,-rpath,{folder}" for folder in libraries],
            "-lc10", "-ltorch_cpu"]


def _cpu() -> str:
    """What ``-march=native`` compiles for: the CPU's model and feature flags."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor()
    lines = [line for line in text.splitlines() if line.startswith(("model name", "flags", "Features"))]
    return "\n".join(sorted(set(lines)))


def _build() -> Path:
    if os.environ.get("MINILLM_KERNELS", "1") == "0":
        raise RuntimeError("MINILLM_KERNELS=0: the hand-written kernels are switched off")
    if sys.platform == "win32":
        raise RuntimeError("the hand-written kernels are built with a Unix compiler; not on Windows")
    compiler = _compiler()
    sources = [str(source) for source in SOURCES]
    flags = [part for part in _command(compiler, Path("x")) if part not in sources]  # the text counts, not where it is
    texts = [source.read_text() for source in SOURCES + HEADERS]
    key = hashlib.sha256("\n".join([*texts, " ".join(flags), torch.__version__, sys.version,
                                    _cpu()]).encode()).hexdigest()[:16]
    folder = cache_dir() / "kernels"
    library = folder / f"minillm-{key}.so"
    if library.is_file():
        return library
    folder.mkdir(parents=True, exist_ok=True)
    # Build under a temporary name and rename: two processes building at once both finish
    # with a whole library, and none ever loads a half-written one.
    with tempfile.TemporaryDirectory(dir=folder) as scratch:
        partial = Path(scratch) / library.name
        done = subprocess.run(_command(compiler, partial), capture_output=True, text=True, timeout=BUILD_SECONDS)
        if done.returncode != 0:
            names = ", ".join(source.name for source in SOURCES)
            raise RuntimeError(f"building {names} with {compiler} failed:\n{done.stderr[-2000:]}")
        os.replace(partial, library)
    return library
