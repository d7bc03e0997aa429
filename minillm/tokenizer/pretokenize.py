"""Pre-tokenization: cut text into chunks before BPE sees it.

BPE never merges across a chunk boundary, so the regex decides what *can* become a token:
GPT-2's pattern keeps a leading space with the word that follows (``" the"``), splits
contractions (``"'s"``), and keeps letters, digits and punctuation apart. Because every chunk
is encoded on its own, an encoder can cache the ids of each distinct chunk; in natural text a
few thousand chunks cover almost everything, which is what makes encoding fast.

The patterns come from the reference implementations (GPT-2's ``encoder.py``, Llama 3's and
Qwen2's ``tokenizer.json``) and need the ``regex`` module for ``\\p{L}`` (any letter) and
``\\p{N}`` (any number).

A pattern read from a file is code supplied with the model, so two things are guarded: text the
pattern does not match is kept as chunks of its own (as HF does, instead of being dropped), and
matching runs under a timeout, because a pattern such as ``(a|a)+$`` backtracks for
exponential time on a line of ``a``.
"""

from __future__ import annotations

import time
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

# The time one split() may take: real patterns need well under a microsecond a character. The
# patterns above match in linear time and run without a timeout (checking the clock halves the
# speed of matching); any other pattern, which can only come from a file, runs with one.
_LINEAR_PATTERNS = frozenset(GGUF_PRE_PATTERNS.values())
_REGEX_BASE_SECONDS = 0.5
_REGEX_SECONDS_PER_CHAR = 4e-6

# ``regex.compile`` unrolls the minimum count of a repeat: ``a{1000}`` becomes 1000 nodes of
# ~300 bytes, and nested repeats multiply, so ``(?:(?:(?:a{100}){100}){100}){100}`` (34
# characters) asks for 30 GB. Patterns are refused above this many unrolled atoms.
_MAX_UNROLLED_ATOMS = 100_000
_QUANTIFIER = regex.compile(r"\{([0-9]*)(?:,[0-9]*)?\}")


def _seconds_left(deadline: float | None) -> float | None:
    """The ``timeout=`` for a regex call (None: no timeout; 0 makes it time out at once)."""
    return None if deadline is None else max(deadline - time.monotonic(), 0.0)


def time_budget(n_chars: int) -> float:
    """Seconds that matching a file-supplied pattern against ``n_chars`` of text may take."""
    return _REGEX_BASE_SECONDS + _REGEX_SECONDS_PER_CHAR * n_chars


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
        if not isinstance(self.pattern, str):
            raise TypeError(f"the pre-tokenizer pattern must be a str, got {self.pattern!r}")
        atoms = _unrolled_atoms(self.pattern)
        if atoms > _MAX_UNROLLED_ATOMS:
            raise ValueError(
                f"the pre-tokenizer pattern {self.pattern[:100]!r} repeats too much: compiling it would unroll "
                f"about {atoms} atoms (the limit is {_MAX_UNROLLED_ATOMS})"
            )
        try:
            compiled = regex.compile(self.pattern)
        except regex.error as err:
            raise ValueError(f"the pre-tokenizer pattern {self.pattern!r} does not compile: {err}") from None
        object.__setattr__(self, "_compiled", compiled)

    def split(self, text: str) -> list[str]:
        """Cut ``text`` into chunks; ``"".join(chunks) == text`` always holds."""
        deadline = None if self.pattern in _LINEAR_PATTERNS else time.monotonic() + time_budget(len(text))
        pieces = _DIGIT.split(text) if self.individual_digits else [text]
        chunks: list[str] = []
        try:
            for piece in pieces:
                if piece:
                    chunks.extend(self._split_piece(piece, deadline))
        except TimeoutError:
            raise ValueError(
                f"the pre-tokenizer pattern {self.pattern!r} took over "
                f"{time_budget(len(text)):.2f} s on {len(text)} characters of text "
                "(a pattern that backtracks catastrophically; it comes with the tokenizer file)"
            ) from None
        return chunks

    def _split_piece(self, text: str, deadline: float | None) -> list[str]:
        """HF's ``Split`` with ``behavior: Isolated``: every match is a chunk, and so is every
        stretch of text between two matches. Real patterns match everything, so ``findall``
        gives the answer; only when its matches do not add up to the text are the gaps found."""
        matches = self._compiled.findall(text, timeout=_seconds_left(deadline))
        if sum(map(len, matches)) == len(text):
            return matches
        chunks: list[str] = []
        end = 0
        for match in self._compiled.finditer(text, timeout=_seconds_left(deadline)):
            if match.start() > end:
                chunks.append(text[end : match.start()])
            chunks.append(match.group())
            end = match.end()
        if end < len(text):
            chunks.append(text[end:])
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
        """Read the ``pre_tokenizer`` entry of an HF ``tokenizer.json`` (byte-level BPE only).

        Errors name the offending step as its JSON path (``pre_tokenizer.pretokenizers[0]``).
        """
        if not isinstance(spec, dict):
            raise ValueError(f"pre_tokenizer must be a byte-level pre-tokenizer object, got {spec!r}")
        if spec.get("type") == "Sequence":
            steps = spec.get("pretokenizers")
            if not isinstance(steps, list):
                raise ValueError(f"pre_tokenizer.pretokenizers must be a list, got {steps!r}")
            named = [(f"pre_tokenizer.pretokenizers[{n}]", step) for n, step in enumerate(steps)]
        else:
            named = [("pre_tokenizer", spec)]
        pattern: str | None = None
        pattern_field = "pre_tokenizer"  # where the pattern came from, for a compile error
        individual_digits = False
        saw_byte_level = False
        for where, step in named:
            if not isinstance(step, dict):
                raise ValueError(f"{where} {step!r} is not an object")
            kind = step.get("type")
            if kind == "ByteLevel":
                if step.get("add_prefix_space"):
                    raise ValueError(f"{where}: ByteLevel pre-tokenizer with add_prefix_space=true is not supported")
                saw_byte_level = True
                if step.get("use_regex", True):
                    pattern = _only_one(pattern, GPT2_PATTERN)
            elif kind == "Split":
                pattern = _only_one(pattern, _split_regex(where, step))
                pattern_field = f"{where}.pattern.Regex"
            elif kind == "Digits" and step.get("individual_digits"):
                individual_digits = True
            else:
                raise ValueError(f"{where}: pre-tokenizer step {kind!r} is not supported (byte-level BPE only)")
        if not saw_byte_level or pattern is None:
            raise ValueError(f"pre-tokenizer {spec} is not a byte-level BPE pre-tokenizer")
        try:
            return cls(pattern, individual_digits)
        except ValueError as err:
            raise ValueError(f"{pattern_field}: {err}") from None


def _split_regex(where: str, step: dict[str, Any]) -> str:
    """The regex of a ``Split`` step; only the behaviour ``split()`` implements is accepted."""
    spec = step.get("pattern")
    if not isinstance(spec, dict) or not isinstance(spec.get("Regex"), str):
        raise ValueError(f"{where}.pattern must be {{\"Regex\": \"...\"}} (a str regex), got {spec!r}")
    if step.get("behavior") != "Isolated" or step.get("invert"):
        raise ValueError(
            f"{where}: Split with behavior={step.get('behavior')!r}, invert={step.get('invert')!r} is not "
            "supported (minillm implements behavior='Isolated', invert=false)"
        )
    return spec["Regex"]


def _unrolled_atoms(pattern: str) -> int:
    """About how many atoms ``regex.compile`` builds for ``pattern``: each literal, escape,
    class or ``.`` counts 1, times the minimum count of every repeat around it (``{m}``,
    ``{m,n}``; ``*``, ``+`` and ``?`` need at most one copy). A scan, not a parser: ``(?:``
    and the like count as a few literals, which only overestimates a little."""
    groups = [0]  # atoms of each open group, innermost last
    last = 0  # atoms of the item a quantifier right here would repeat
    i = 0
    while i < len(pattern):
        char = pattern[i]
        if char == "\\":  # an escape; \p{L}, \N{...}, \x{...} carry their own braces
            i += 2
            if pattern[i - 1 : i] in ("p", "P", "N", "x") and pattern[i : i + 1] == "{":
                i = pattern.find("}", i) + 1 or len(pattern)
            last = 1
        elif char == "[":  # a class: one atom, whatever it lists
            i += 2 if pattern[i + 1 : i + 2] == "]" else 1
            while i < len(pattern) and pattern[i] != "]":
                i += 2 if pattern[i] == "\\" else 1
            i += 1
            last = 1
        elif char == "(":
            groups.append(0)
            i += 1
            continue
        elif char == ")" and len(groups) > 1:
            last = groups.pop()
            i += 1
        elif char == "{" and (quantifier := _QUANTIFIER.match(pattern, i)):
            groups[-1] += last * (max(int(quantifier.group(1) or 0), 1) - 1)
            i = quantifier.end()
            continue
        else:
            i += 1
            last = 0 if char in "|*+?" else 1
        groups[-1] += last
    return sum(groups)


def _only_one(current: str | None, new: str) -> str:
    if current is not None:
        raise ValueError("pre-tokenizers with two splitting regexes are not supported")
    return new
