"""Pre-tokenization: cut text into chunks before BPE sees it.

BPE never merges across a chunk boundary, so the regex decides what *can* become a token:
GPT-2's pattern keeps a leading space with the word that follows (``" the"``), splits
contractions (``"'s"``), and keeps letters, digits and punctuation apart. Because every chunk
is encoded on its own, an encoder can cache the ids of each distinct chunk; in natural text a
few thousand chunks cover almost everything, which is what makes encoding fast.

The patterns come from the reference implementations (GPT-2's ``encoder.py``, Llama 3's and
Qwen2's ``tokenizer.json``) and need the ``regex`` module for ``\\p{L}`` (any letter) and
``\\p{N}`` (any number).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import regex

GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
LLAMA3_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"""
    r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
QWEN2_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"""
    r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

# llama.cpp names the pre-tokenizer of a GGUF file in ``tokenizer.ggml.pre``.
GGUF_PRE_PATTERNS = {
    "gpt2": GPT2_PATTERN,
    "default": GPT2_PATTERN,
    "smollm": GPT2_PATTERN,
    "llama-bpe": LLAMA3_PATTERN,
    "llama3": LLAMA3_PATTERN,
    "qwen2": QWEN2_PATTERN,
}

_DIGIT = regex.compile(r"(\p{N})")


@dataclass(frozen=True)
class PreTokenizer:
    """Splits text into the chunks that BPE encodes independently.

    ``individual_digits`` first isolates every digit (HF's ``Digits`` pre-tokenizer, used by
    the original SmolLM2 checkpoints), then ``pattern`` cuts each piece into chunks.
    """

    pattern: str = GPT2_PATTERN
    individual_digits: bool = False
    _compiled: Any = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_compiled", regex.compile(self.pattern))

    def split(self, text: str) -> list[str]:
        """Cut ``text`` into chunks; ``"".join(chunks) == text`` always holds."""
        if not self.individual_digits:
            return self._compiled.findall(text)
        chunks: list[str] = []
        for piece in _DIGIT.split(text):
            if piece:
                chunks.extend(self._compiled.findall(piece))
        return chunks

    def to_hf(self) -> dict[str, Any]:
        """The equivalent ``pre_tokenizer`` entry of an HF ``tokenizer.json``."""
        byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True}
        steps: list[dict[str, Any]] = []
        if self.individual_digits:
            steps.append({"type": "Digits", "individual_digits": True})
        if self.pattern == GPT2_PATTERN:
            steps.append({**byte_level, "use_regex": True})
        else:
            steps.append(
                {
                    "type": "Split",
                    "pattern": {"Regex": self.pattern},
                    "behavior": "Isolated",
                    "invert": False,
                }
            )
            steps.append({**byte_level, "use_regex": False})
        if len(steps) == 1:
            return steps[0]
        return {"type": "Sequence", "pretokenizers": steps}

    @classmethod
    def from_hf(cls, spec: dict[str, Any] | None) -> PreTokenizer:
        """Read the ``pre_tokenizer`` entry of an HF ``tokenizer.json`` (byte-level BPE only)."""
        if not isinstance(spec, dict):
            raise ValueError(f"pre_tokenizer must be a byte-level pre-tokenizer object, got {spec!r}")
        steps = spec.get("pretokenizers", []) if spec.get("type") == "Sequence" else [spec]
        pattern: str | None = None
        individual_digits = False
        saw_byte_level = False
        for step in steps:
            if not isinstance(step, dict):
                raise ValueError(f"pre-tokenizer step {step!r} is not an object")
            kind = step.get("type")
            if kind == "ByteLevel":
                if step.get("add_prefix_space"):
                    raise ValueError("ByteLevel pre-tokenizer with add_prefix_space=true is not supported")
                saw_byte_level = True
                if step.get("use_regex", True):
                    pattern = _only_one(pattern, GPT2_PATTERN)
            elif kind == "Split" and "Regex" in step.get("pattern", {}):
                if step.get("behavior") != "Isolated" or step.get("invert"):
                    raise ValueError(f"Split pre-tokenizer {step} is not supported (need Isolated)")
                pattern = _only_one(pattern, step["pattern"]["Regex"])
            elif kind == "Digits" and step.get("individual_digits"):
                individual_digits = True
            else:
                raise ValueError(f"pre-tokenizer step {kind!r} is not supported (byte-level BPE only)")
        if not saw_byte_level or pattern is None:
            raise ValueError(f"pre-tokenizer {spec} is not a byte-level BPE pre-tokenizer")
        return cls(pattern, individual_digits)


def _only_one(current: str | None, new: str) -> str:
    if current is not None:
        raise ValueError("pre-tokenizers with two splitting regexes are not supported")
    return new
