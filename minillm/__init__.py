"""minillm: an LLM inference engine built from scratch, one notebook at a time.

The pipeline, in the order the course builds it::

    text --Tokenizer.encode--> ids --Model--> logits --Sampler--> next id --Detokenizer--> text
"""

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
__version__ = "0.1.0"
