"""How a step runs: one *backend* per engine, chosen once, when the engine is built.

Every backend runs the same two calls on a ``PagedStep`` (the step input the runner built):
``prefill(token_ids, step)`` — prompts packed end to end, logits at each one's last token —
and ``decode(token_ids, step)`` — one new token per row, logits per row. The scheduler and the
sampler never know which one runs.

* ``eager`` (``eager.py``): the notebooks' readable PyTorch, module by module. The parity reference.
* ``compiled`` (``compiled.py``): the decode step through ``torch.compile``. On a CPU, groups of
  layers are compiled once and shared by every group; on CUDA the whole step is replayed as a
  CUDA graph, one per bucket of rows and table width.
* ``packed-cpu`` (``packed_cpu.py``): a model whose every matrix is packed (the native GGUF,
  ``weights="q8_0"``...) on a CPU with the vector kernels: the whole decode step, token ids to
  logits, is one call of a C++ object holding the layers. Nothing to compile.

``choose_backend`` picks the fastest that applies, or checks the one asked for and says why
it cannot run.
"""

from __future__ import annotations

import shutil
import sys
from typing import Protocol

import torch

from minillm.cache.paged import PagedKVCache, PagedStep
from minillm.engine.backends.compiled import CompiledBackend
from minillm.engine.backends.eager import EagerBackend
from minillm.engine.backends.packed_cpu import PackedCPUBackend, why_not_packed
from minillm.model import kernels
from minillm.model.llama import Transformer

BACKENDS = ("eager", "compiled", "packed-cpu")


class Backend(Protocol):
    name: str
    compiles: bool  # whether first calls of a new shape build code (their time is reported apart)

    def prefill(self, token_ids: torch.Tensor, step: PagedStep) -> torch.Tensor:
        """Logits [len(step.logits_index), vocab] for the packed prompts ``token_ids`` [tokens]."""
        ...

    def decode(self, token_ids: torch.Tensor, step: PagedStep) -> torch.Tensor:
        """Logits [rows, vocab] for one new token per row, ``token_ids`` [rows]."""
        ...

    def padded_rows(self, rows: int) -> int:
        """How many rows the step must have for ``rows`` real ones (more only for CUDA graphs)."""
        ...

    def padded_width(self, width: int) -> int:
        """How many blocks wide the block tables must be for ``width`` (more only for CUDA graphs)."""
        ...


def why_not_compiled(device: torch.device) -> str:
    """Why ``torch.compile`` cannot build code here ("" when it can)."""
    if device.type == "cpu" and not any(shutil.which(cxx) for cxx in ("g++", "c++", "clang++")):
        return "no C++ compiler found (torch.compile writes C++ for the CPU)"
    if sys.platform == "win32":
        return "torch.compile is not supported on Windows here"
    return ""


def choose_backend(model: Transformer, cache: PagedKVCache, name: str | None = None) -> Backend:
    """The backend ``name`` for ``model`` on ``cache``, or (None) the fastest that applies:
    ``packed-cpu``, else ``compiled``, else ``eager`` (saying why on stderr)."""
    if name is not None and name not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {name!r}")
    if model.device.type == "cpu":
        kernels.available()  # build or load the hand-written kernels now, not in the middle of a step
    not_packed, not_compiled = why_not_packed(model, cache), why_not_compiled(model.device)
    if name is None:
        if not not_packed:
            name = "packed-cpu"
        elif not not_compiled:
            name = "compiled"
        else:
            print(f"minillm: {not_compiled}; running eagerly", file=sys.stderr)
            name = "eager"
    if name == "packed-cpu":
        if not_packed:
            raise ValueError(f"the packed-cpu backend cannot run this model: {not_packed}")
        return PackedCPUBackend(model, cache)
    if name == "compiled":
        if not_compiled:
            raise ValueError(f"the compiled backend cannot run here: {not_compiled}")
        return CompiledBackend(model, cache)
    return EagerBackend(model)
