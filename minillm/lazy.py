"""Package exports imported on first use (PEP 562), so importing a package loads only what is used.

``import minillm.cache.block_manager`` runs ``minillm/__init__.py`` and ``minillm/cache/__init__.py``
first; if those imported everything, the torch-free bookkeeping would load torch, the model and
the server. A package lists ``name -> submodule`` instead, and each name is imported when first
read.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Callable
from typing import Any


def lazy_exports(package: str, exports: dict[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``__getattr__`` and ``__dir__`` for ``package``, whose ``exports`` map a public name to the
    submodule (relative to ``package``) that defines it. A submodule read as an attribute
    (``minillm.sampling``) is imported too. Each name, once imported, is kept in the package."""

    def __getattr__(name: str) -> Any:
        if name in exports:
            value = getattr(importlib.import_module(f"{package}.{exports[name]}"), name)
        elif not name.startswith("__") and importlib.util.find_spec(f"{package}.{name}") is not None:
            value = importlib.import_module(f"{package}.{name}")
        else:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        setattr(sys.modules[package], name, value)
        return value

    def __dir__() -> list[str]:
        return sorted(exports)

    return __getattr__, __dir__
