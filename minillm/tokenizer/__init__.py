"""Stage 1 of the pipeline: text <-> token ids (byte-level BPE), taught in notebooks 01 and 02."""

from minillm.tokenizer.bpe import Tokenizer
from minillm.tokenizer.padding import BatchEncoding
from minillm.tokenizer.chat import CHATML_TEMPLATE
from minillm.tokenizer.pretokenize import GPT2_PATTERN, PreTokenizer
from minillm.tokenizer.stream import StreamingDetokenizer
from minillm.tokenizer.train import train_bpe

__all__ = [
    "CHATML_TEMPLATE",
    "GPT2_PATTERN",
    "BatchEncoding",
    "PreTokenizer",
    "StreamingDetokenizer",
    "Tokenizer",
    "train_bpe",
]
