"""Package exports imported on first use (PEP 562), so importing a package loads only what is used.

``import minillm.cache.block_manager`` runs ``minillm/__init__.py`` and ``minillm/cache/__init__.py``
first; if those imported everything, the torch-free bookkeeping would load torch, the model and
the server. A package lists ``name -> submodule`` instead, and each name is imported when first
read.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def lazy_exports(package: str, exports: dict[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``__getattr__`` and ``__dir__`` for ``package``, whose ``exports`` map a public name to the
    submodule (relative to ``package``) that defines it."""

    def __getattr__(name: str) -> Any:
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(f"{package}.{exports[name]}"), name)

    def __dir__() -> list[str]:
        return sorted(exports)

    return __getattr__, __dir__
