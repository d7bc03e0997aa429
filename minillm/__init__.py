"""minillm: an LLM inference engine built from scratch, one notebook at a time.

The pipeline, in the order the course builds it::

    text --Tokenizer.encode--> ids --Model--> logits --Sampler--> next id --Detokenizer--> text

The names below are imported on first use (``minillm.Engine`` imports ``minillm.engine`` then),
not when ``import minillm`` runs. Python runs this file before any submodule, so an eager import
here would load torch and the whole engine for ``import minillm.tokenizer`` too: the tokenizer,
the block manager and the scheduler are plain Python and load without torch, and
``python -m minillm --help`` answers at once. ``import minillm`` has no side effects on torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from minillm.lazy import lazy_exports

if TYPE_CHECKING:  # the same names, for type checkers and editors
    from minillm.engine import Completion, DraftModel, Engine, PromptLookup
    from minillm.errors import FileFormatError, MinillmError
    from minillm.model import ModelConfig, Transformer, load_model, validate
    from minillm.sampling import SamplingParams
    from minillm.tokenizer import BatchEncoding, StreamingDetokenizer, Tokenizer, train_bpe

__getattr__, __dir__ = lazy_exports(__name__, {
    "BatchEncoding": "tokenizer",
    "Completion": "engine",
    "DraftModel": "engine",
    "Engine": "engine",
    "FileFormatError": "errors",
    "MinillmError": "errors",
    "ModelConfig": "model",
    "PromptLookup": "engine",
    "SamplingParams": "sampling",
    "StreamingDetokenizer": "tokenizer",
    "Tokenizer": "tokenizer",
    "Transformer": "model",
    "load_model": "model",
    "train_bpe": "tokenizer",
    "validate": "model",
})
__all__ = __dir__()
__version__ = "0.1.0"
