"""Stage 1 of the pipeline: text <-> token ids (byte-level BPE), taught in notebooks 01 and 02."""

from minillm.tokenizer.bpe import BatchEncoding, Tokenizer
from minillm.tokenizer.chat import CHATML_TEMPLATE
from minillm.tokenizer.pretokenize import GPT2_PATTERN, PreTokenizer
from minillm.tokenizer.stream import StreamingDetokenizer
from minillm.tokenizer.train import train_bpe

__all__ = [
    "BatchEncoding",
    "CHATML_TEMPLATE",
    "GPT2_PATTERN",
    "PreTokenizer",
    "StreamingDetokenizer",
    "Tokenizer",
    "train_bpe",
]
