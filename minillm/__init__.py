"""minillm: an LLM inference engine built from scratch, one notebook at a time.

The pipeline, in the order the course builds it::

    text --Tokenizer.encode--> ids --Model--> logits --Sampler--> next id --Detokenizer--> text

The names below are imported on first use (``minillm.Engine`` imports ``minillm.engine`` then),
not when ``import minillm`` runs. Python runs this file before any submodule, so an eager import
here would load torch and the whole engine for ``import minillm.tokenizer`` too: the tokenizer,
the block manager and the scheduler are plain Python and load without torch, and
``python -m minillm --help`` answers at once.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the same names, for type checkers and editors
    from minillm.engine import Completion, Engine
    from minillm.errors import FileFormatError, MinillmError
    from minillm.model import ModelConfig, Transformer, load_model, validate
    from minillm.sampling import SamplingParams
    from minillm.tokenizer import BatchEncoding, StreamingDetokenizer, Tokenizer, train_bpe

__all__ = [
    "BatchEncoding",
    "Completion",
    "Engine",
    "FileFormatError",
    "MinillmError",
    "ModelConfig",
    "SamplingParams",
    "StreamingDetokenizer",
    "Tokenizer",
    "Transformer",
    "load_model",
    "train_bpe",
    "validate",
]
# public name -> the module it comes from (as imported above)
_EXPORTS = {
    "BatchEncoding": "minillm.tokenizer",
    "Completion": "minillm.engine",
    "Engine": "minillm.engine",
    "FileFormatError": "minillm.errors",
    "MinillmError": "minillm.errors",
    "ModelConfig": "minillm.model",
    "SamplingParams": "minillm.sampling",
    "StreamingDetokenizer": "minillm.tokenizer",
    "Tokenizer": "minillm.tokenizer",
    "Transformer": "minillm.model",
    "load_model": "minillm.model",
    "train_bpe": "minillm.tokenizer",
    "validate": "minillm.model",
}
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    """Import a public name, or a submodule (``minillm.sampling``), the first time it is asked for."""
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
    elif not name.startswith("__") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
        value = importlib.import_module(f"{__name__}.{name}")
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
