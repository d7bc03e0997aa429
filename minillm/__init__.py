"""minillm: an LLM inference engine built from scratch, one notebook at a time.

The pipeline, in the order the course builds it::

    text --Tokenizer.encode--> ids --Model--> logits --Sampler--> next id --Detokenizer--> text

Every name below is imported on first use: ``import minillm`` loads nothing heavy, and has no
side effects on torch.
"""

from minillm.lazy import lazy_exports

__getattr__, __dir__ = lazy_exports(__name__, {
    "BatchEncoding": "tokenizer",
    "Completion": "engine",
    "Engine": "engine",
    "FileFormatError": "errors",
    "MinillmError": "errors",
    "ModelConfig": "model",
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
