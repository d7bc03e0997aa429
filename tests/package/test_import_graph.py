"""The package's import graph: no circles, no arrows up the layers, no torch where none belongs.

minillm is read bottom-up, in the order the course builds it, and its imports must allow that:
a module may use only what sits in its own layer or in the layers below it. ``LAYERS`` lists
the layers from the bottom, each with the first name after ``minillm.`` of the modules in it
(so ``minillm/serve.py`` and a package ``minillm/serve/`` both land in ``serve``):

* ``io``: ``errors``, ``safe_io``, ``gguf_io``, ``assets``, ``lazy``: reading files and finding them,
  needed by everything and needing nothing of minillm.
* ``tokenizer``: text <-> ids (notebooks 01-02); pure Python, no model.
* ``structured``: constrained decoding (notebook 13): regex and JSON Schema -> DFA over bytes ->
  the tokens each state allows, and the per-request state that masks the logits. It reads the
  tokenizer's vocabulary; the sampler will use it, so it sits below sampling (and needs nothing
  of the cache or the model in between).
* ``cache``: where the keys and values live, and which blocks hold them (notebooks 07-08,
  12). Below the model: the model writes into a cache, the cache knows nothing of the model.
* ``model``: the transformer and its weights (notebooks 03-06, 11).
* ``distributed``: tensor parallelism (notebook 15): the shard layout, a rank's model and its
  loader, the collectives, and the step broadcast from rank 0. It builds on the model and the
  cache, and the engine picks its backend like any other, so it sits between them.
* ``sampling``: logits -> the next id (notebook 09); it needs no model, but nothing below the
  engine needs it, so it sits where the pipeline uses it.
* ``engine``: requests, scheduling and the loop that runs the model (notebooks 10, 12), and
  ``generate``, the plain greedy loops the course runs before the engine exists: both drive
  model + cache + tokenizer.
* ``apps``: ``serve``, ``bench`` and ``demo``, built on the engine, and ``reference``, the HF
  transformers/tokenizers yardstick that benchmarks and tests compare against. ``reference``
  only reads ``assets``, but it belongs with the tools that measure minillm (``bench``
  imports it, so it cannot sit above them), and no part of the engine may lean on transformers.
* ``top``: what nothing else in minillm may import: ``__main__`` (the command line), the
  package ``__init__`` (``minillm.Engine`` and friends, a re-export of every layer) and
  ``exercises`` (the notebooks' checkers, which test every layer) and ``plots`` (the
  notebooks' drawing helpers).

Within one layer (say the modules of ``minillm.tokenizer``) any import is allowed as long as
it makes no circle. Every import counts: at the top of a module, inside a function (a lazy
import still depends on its target) and under ``if TYPE_CHECKING:`` (a type annotation
too): a lazy import that dodges a circle at run time is still a circle in the design.
Importing ``minillm.a.b`` also runs ``minillm/__init__.py`` and ``minillm/a/__init__.py``;
those implicit imports are left out of the circle and layer rules (a package's ``__init__``
re-exports its modules, so counting them would make every package a circle), and counted
where they matter: what importing a module loads.

torch, last: importing minillm must change nothing in torch (no global hooks), and the parts
that are plain Python (the tokenizer, the block manager, the scheduler) must load without it,
checked through the graph and by running their tests where torch cannot be imported.

Each failure lists the offending imports as ``file:line``: it is the to-do list.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import textwrap
from collections import deque
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "minillm"

# From the bottom up: layer -> the first names after "minillm." in it ("__init__" is minillm/__init__.py).
LAYERS = {
    "io": ("errors", "safe_io", "gguf_io", "assets", "lazy"),
    "tokenizer": ("tokenizer",),
    "structured": ("structured",),
    "cache": ("cache",),
    "model": ("model",),
    "distributed": ("distributed",),
    "sampling": ("sampling",),
    "engine": ("engine", "generate"),
    "apps": ("serve", "bench", "reference", "demo"),
    "top": ("__main__", "__init__", "exercises", "plots"),
}

# Modules that must load without torch: the package itself (``import minillm``), the tokenizer
# (notebooks 01-02 need no model), and the block manager and the scheduler, whose tests run where
# torch cannot be imported (TORCH_FREE_TESTS).
TORCH_FREE = ("minillm", "minillm.tokenizer", "minillm.cache.block_manager", "minillm.engine.scheduler")
TORCH_FREE_TESTS = ("08_paged_kv_cache/test_block_manager.py", "10_engine_on_gpu/test_scheduler.py")


# ------------------------------------------------------------------------------ the graph
@dataclass(frozen=True)
class Import:
    """One import statement's dependency: ``source`` imports ``target`` at ``where`` (file:line)."""

    source: str
    target: str  # a minillm module, or "torch"
    file: str
    line: int
    kind: str  # "top" (runs on import), "lazy" (inside a function) or "typing" (under TYPE_CHECKING)

    @property
    def where(self) -> str:
        return f"{self.file}:{self.line}"

    def __str__(self) -> str:
        how = {"top": "", "lazy": " (inside a function)", "typing": " (under TYPE_CHECKING)"}[self.kind]
        return f"{self.where}: {self.source} imports {self.target}{how}"


def in_order(found: list[Import]) -> list[Import]:
    """By file, then line."""
    return sorted(set(found), key=lambda edge: (edge.file, edge.line, edge.target))


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


@cache
def modules() -> dict[str, Path]:
    """Every minillm module: dotted name -> file (a package is its ``__init__.py``)."""
    return {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


class Collector(ast.NodeVisitor):
    """The imports of one file, each with the context it runs in."""

    def __init__(self, name: str, file: str) -> None:
        self.name, self.file = name, file
        # the package a relative import starts from: the module itself for an __init__.py
        self.package = name if file.endswith("__init__.py") else name.rpartition(".")[0]
        self.kind = "top"
        self.imports: list[Import] = []

    def _visit_in(self, kind: str, nodes: list[ast.stmt]) -> None:
        """Visit ``nodes`` in a context; the least eager wins (a function under TYPE_CHECKING is "typing")."""
        outer = self.kind
        self.kind = max(outer, kind, key=["top", "lazy", "typing"].index)
        for node in nodes:
            self.visit(node)
        self.kind = outer

    def visit_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        self._visit_in("lazy", node.body)

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_If(self, node: ast.If) -> None:
        if _is_type_checking(node.test):
            self._visit_in("typing", node.body)
            self._visit_in(self.kind, node.orelse)
        else:
            self.generic_visit(node)

    def _add(self, target: str, line: int) -> None:
        if target == "torch" or target.startswith("torch."):
            target = "torch"
        elif target != "minillm" and not target.startswith("minillm."):
            return
        else:  # the longest prefix that is a module: "minillm.model.ModelConfig" -> "minillm.model"
            while target not in modules():
                target = target.rpartition(".")[0]
        if target != self.name:
            self.imports.append(Import(self.name, target, self.file, line, self.kind))

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self._add(alias.name, node.lineno)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.level:  # from . import x, from ..cache import y
            base = self.package.split(".")[: len(self.package.split(".")) - node.level + 1]
            origin = ".".join(base + ([node.module] if node.module else []))
        else:
            origin = node.module or ""
        for alias in node.names:  # `from minillm.model import kernels` imports the submodule
            submodule = f"{origin}.{alias.name}"
            self._add(submodule if submodule in modules() else origin, node.lineno)


@cache
def imports() -> tuple[Import, ...]:
    """Every import in minillm of a minillm module or of torch."""
    found: list[Import] = []
    for name, path in modules().items():
        collector = Collector(name, path.relative_to(ROOT).as_posix())
        collector.visit(ast.parse(path.read_text(encoding="utf-8"), filename=str(path)))
        found += collector.imports
    return tuple(dict.fromkeys(found))  # `from m import a, b` is one import of m


def edges() -> list[Import]:
    """The imports between minillm modules."""
    return [edge for edge in imports() if edge.target != "torch"]


def group(name: str) -> str:
    """The first name after ``minillm.`` (``__init__`` for the package itself)."""
    return name.split(".")[1] if "." in name else "__init__"


def layer_of(name: str) -> str | None:
    return next((layer for layer, groups in LAYERS.items() if group(name) in groups), None)


def circles(graph_edges: list[tuple[str, str, Import]]) -> list[list[Import]]:
    """The imports that lie on a circle, grouped by the set of nodes that reach each other.

    ``a -> b`` lies on a circle exactly when ``b`` leads back to ``a``; breaking every circle of
    a group means removing some of its imports, so each group is one item of the to-do list.
    """
    successors: dict[str, set[str]] = {}
    for a, b, _ in graph_edges:
        successors.setdefault(a, set()).add(b)

    def reachable(start: str) -> set[str]:
        seen, todo = {start}, [start]
        while todo:
            for nxt in successors.get(todo.pop(), ()):
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        return seen

    reach = {node: reachable(node) for node in successors}
    groups: dict[frozenset[str], list[Import]] = {}
    for a, b, edge in graph_edges:
        if a in reach.get(b, ()):
            members = frozenset(node for node in reach[a] if a in reach.get(node, ()))
            groups.setdefault(members, []).append(edge)
    return [in_order(group) for _, group in sorted(groups.items(), key=lambda item: sorted(item[0]))]


def fail_with(title: str, groups: list[list[str]]) -> None:
    """Fail with ``title`` and the groups of lines under it (a to-do list), if there are any."""
    if groups:
        pytest.fail(title + "\n" + "\n\n".join("\n".join(f"  {line}" for line in lines) for lines in groups),
                    pytrace=False)


# ------------------------------------------------------------------------------ the rules
_EXAMPLE = """
from __future__ import annotations
import torch.nn.functional as F
from typing import TYPE_CHECKING
from minillm.tokenizer import bpe, Tokenizer
from . import chat
from .stream import StreamingDetokenizer
if TYPE_CHECKING:
    from minillm.sampling import SamplingParams
else:
    import minillm.errors
def later():
    from .. import assets
    if TYPE_CHECKING:
        import minillm.gguf_io
class Eager:
    from minillm.safe_io import read_json
"""


def test_the_collector_sees_every_kind_of_import():
    """On a made-up ``minillm/tokenizer/example.py``: a submodule named in ``from package import
    name``, relative imports, TYPE_CHECKING (and its ``else``), a function, a class body, torch."""
    collector = Collector("minillm.tokenizer.example", "minillm/tokenizer/example.py")
    collector.visit(ast.parse(_EXAMPLE))
    assert [(edge.line, edge.target, edge.kind) for edge in collector.imports] == [
        (3, "torch", "top"),
        (5, "minillm.tokenizer.bpe", "top"),
        (5, "minillm.tokenizer", "top"),
        (6, "minillm.tokenizer.chat", "top"),
        (7, "minillm.tokenizer.stream", "top"),
        (9, "minillm.sampling", "typing"),
        (11, "minillm.errors", "top"),
        (13, "minillm.assets", "lazy"),
        (15, "minillm.gguf_io", "typing"),
        (17, "minillm.safe_io", "top"),
    ]


def test_every_module_is_in_a_layer():
    unplaced = sorted(f"{path.relative_to(ROOT)} ({group(name)!r})" for name, path in modules().items()
                      if layer_of(name) is None)
    assert not unplaced, "add these to LAYERS in tests/package/test_import_graph.py:\n  " + "\n  ".join(unplaced)


def test_no_circle_between_modules():
    found = circles([(edge.source, edge.target, edge) for edge in edges()])
    fail_with(
        "circular imports between modules; each group is a circle, break it by moving what both sides "
        "need into a module below them:",
        [[str(edge) for edge in component] for component in found],
    )


def test_no_circle_between_subpackages():
    """``minillm.tokenizer`` <-> ``minillm.model`` is a circle even if no two modules import each other."""
    between = [(group(edge.source), group(edge.target), edge) for edge in edges()
               if group(edge.source) != group(edge.target)]
    found = circles(between)
    fail_with(
        "circular imports between parts of minillm (the imports that cross between them):",
        [[str(edge) for edge in component] for component in found],
    )


def test_no_import_goes_up_the_layers():
    order = list(LAYERS)
    upward = in_order([edge for edge in edges()
                       if layer_of(edge.source) and layer_of(edge.target)
                       and order.index(layer_of(edge.target)) > order.index(layer_of(edge.source))])
    fail_with(
        f"imports that go up the layers ({' < '.join(order)}):",
        [[f"{edge}  ({layer_of(edge.source)} -> {layer_of(edge.target)})" for edge in upward]] if upward else [],
    )


# ------------------------------------------------------------------------------ torch
def _loads(name: str) -> dict[str, tuple[str, str] | None]:
    """The minillm modules that importing ``name`` runs, each with how it was reached: (the
    module that reached it, the step) for all but ``name`` itself."""
    top_imports: dict[str, list[Import]] = {}
    for edge in edges():
        if edge.kind == "top":
            top_imports.setdefault(edge.source, []).append(edge)
    reached: dict[str, tuple[str, str] | None] = {name: None}
    queue = deque([name])
    while queue:
        module = queue.popleft()
        parts = module.split(".")
        packages = [".".join(parts[:n]) for n in range(1, len(parts))]  # run before the module itself
        steps = [(package, f"importing {module} first runs its package {package}") for package in packages]
        steps += [(edge.target, str(edge)) for edge in top_imports.get(module, [])]
        for target, step in steps:
            if target not in reached:
                reached[target] = (module, step)
                queue.append(target)
    return reached


def _chain(reached: dict[str, tuple[str, str] | None], module: str) -> list[str]:
    steps = []
    while reached[module] is not None:
        module, step = reached[module]
        steps.append(step)
    return steps[::-1]


@pytest.mark.parametrize("name", TORCH_FREE)
def test_torch_free_modules_load_no_torch(name):
    """Through the graph: the modules importing ``name`` runs (its own top-level imports, theirs,
    and the package ``__init__``s above each) import no torch at their top level."""
    if name not in modules():
        pytest.skip(f"{name} does not exist yet")
    reached = _loads(name)
    first_torch_import = {}  # one per module is enough to name it
    for edge in imports():
        if edge.target == "torch" and edge.kind == "top" and edge.source in reached:
            first_torch_import.setdefault(edge.source, edge)
    torch_imports = list(first_torch_import.values())
    fail_with(
        f"importing {name} imports torch; each chain below is one way it gets there:",
        [[*_chain(reached, edge.source), str(edge)] for edge in torch_imports],
    )


_NO_TORCH = """
import sys

class NoTorch:
    \"\"\"Refuses torch, as on a machine without it (tests/package/test_import_graph.py).\"\"\"

    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ModuleNotFoundError(f"No module named {name!r} (blocked: this test must run without torch)")
        return None

sys.meta_path.insert(0, NoTorch())
"""


@pytest.mark.parametrize("test_file", TORCH_FREE_TESTS)
def test_scheduling_tests_run_without_torch(test_file, tmp_path):
    """The block manager and the scheduler are plain Python: their tests pass where torch
    cannot even be imported."""
    if not (ROOT / "tests" / test_file).exists():
        pytest.skip(f"tests/{test_file} does not exist yet")
    (tmp_path / "sitecustomize.py").write_text(_NO_TORCH, encoding="utf-8")
    path = os.pathsep.join([str(tmp_path), str(ROOT), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONPATH": path}
    env.pop("PYTEST_XDIST_WORKER", None)
    env.pop("PYTEST_XDIST_WORKER_COUNT", None)
    probe = subprocess.run([sys.executable, "-c", "import torch"], env=env, capture_output=True, text=True, check=False)
    assert probe.returncode != 0 and "blocked" in probe.stderr, "the torch blocker does not work:\n" + probe.stderr
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:xdist", "-p", "no:cacheprovider", f"tests/{test_file}"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, check=False,
    )
    output = result.stdout[-6000:] + result.stderr[-3000:]
    assert result.returncode == 0, f"tests/{test_file} fails without torch:\n{output}"


_HOOKS = textwrap.dedent("""
    import importlib, sys
    import minillm, torch
    for name in minillm.__all__:
        getattr(minillm, name)
    for name in sys.argv[1:]:
        importlib.import_module(name)
    from torch.nn.modules import module
    for registry in ("_global_module_registration_hooks", "_global_parameter_registration_hooks",
                     "_global_buffer_registration_hooks", "_global_forward_pre_hooks", "_global_forward_hooks",
                     "_global_forward_hooks_with_kwargs", "_global_forward_hooks_always_called",
                     "_global_backward_pre_hooks", "_global_backward_hooks"):
        for hook in getattr(module, registry).values():
            print(f"{registry}: {getattr(hook, '__module__', '?')}.{getattr(hook, '__qualname__', hook)}")
""")


def test_importing_minillm_changes_nothing_in_torch():
    """``import minillm, torch``, every name of ``minillm.__all__`` and every minillm module
    leave torch's global hook registries empty: importing a library must not change how every
    ``nn.Module`` in the process behaves."""
    names = [name for name in modules() if name != "minillm.__main__"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run([sys.executable, "-c", _HOOKS, *names], cwd=ROOT, env=env, capture_output=True,
                            text=True, timeout=600, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    fail_with("importing minillm registers global torch hooks (registry: the hook):",
              [result.stdout.splitlines()] if result.stdout else [])
