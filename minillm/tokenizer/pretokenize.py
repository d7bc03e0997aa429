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

from minillm.tokenizer.checks import short, short_repr

try:  # the pure-Python parser behind regex.compile (see compiled_size)
    from regex import _regex_core as _core

    _core_names = ("Source", "Info", "_parse_pattern", "_UnscopedFlagSet", "RegexBase", "GreedyRepeat", "CallGroup")
    if not all(hasattr(_core, name) for name in (*_core_names, "VERBOSE", "VERSION1", "DEFAULT_VERSION")):
        _core = None  # pragma: no cover (a regex release that reorganised its internals)
except ImportError:  # pragma: no cover
    _core = None

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
# 100-600 bytes, and nested repeats multiply, so ``(?:(?:(?:a{100}){100}){100}){100}`` (34
# characters) asks for 30 GB. ``compiled_size`` counts the nodes before anything is compiled, and
# patterns are refused above this many (about 60 MB). Parsing itself takes ~3 us a character, so
# a pattern is refused above a length too (real ones are a few hundred characters).
_MAX_COMPILED_NODES = 100_000
_MAX_PATTERN_CHARS = 20_000
# Nodes that cost the compiled pattern several times an ordinary one (measured: ``\X`` 1.2 kB, a
# repeat nested in a repeat 0.6 kB, a character 0.26 kB).
_NODE_WEIGHTS = {"Grapheme": 5, "GreedyRepeat": 2, "LazyRepeat": 2, "PossessiveRepeat": 2}


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
            raise TypeError(f"the pre-tokenizer pattern must be a str, got {short_repr(self.pattern)}")
        if self.pattern not in _LINEAR_PATTERNS:
            check_compiled_size(self.pattern)
        try:
            compiled = regex.compile(self.pattern)
        except Exception as err:  # noqa: BLE001 (regex.error, or KeyError for an unknown \\L<list>)
            raise ValueError(f"the pre-tokenizer pattern {short(self.pattern)} does not compile: {err}") from None
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
                f"the pre-tokenizer pattern {short(self.pattern)} took over "
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
            raise ValueError(f"pre_tokenizer must be a byte-level pre-tokenizer object, got {short_repr(spec)}")
        if spec.get("type") == "Sequence":
            steps = spec.get("pretokenizers")
            if not isinstance(steps, list):
                raise ValueError(f"pre_tokenizer.pretokenizers must be a list, got {short_repr(steps)}")
            named = [(f"pre_tokenizer.pretokenizers[{n}]", step) for n, step in enumerate(steps)]
        else:
            named = [("pre_tokenizer", spec)]
        pattern: str | None = None
        pattern_field = "pre_tokenizer"  # where the pattern came from, for a compile error
        individual_digits = False
        saw_byte_level = False
        for where, step in named:
            if not isinstance(step, dict):
                raise ValueError(f"{where} {short_repr(step)} is not an object")
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
                raise ValueError(f"{where}: pre-tokenizer step {short_repr(kind)} is not supported (byte-level BPE only)")
        if not saw_byte_level or pattern is None:
            raise ValueError(f"pre-tokenizer {short_repr(spec)} is not a byte-level BPE pre-tokenizer")
        try:
            return cls(pattern, individual_digits)
        except ValueError as err:
            raise ValueError(f"{pattern_field}: {err}") from None


def _split_regex(where: str, step: dict[str, Any]) -> str:
    """The regex of a ``Split`` step; only the behaviour ``split()`` implements is accepted."""
    spec = step.get("pattern")
    if not isinstance(spec, dict) or not isinstance(spec.get("Regex"), str):
        raise ValueError(f"{where}.pattern must be {{\"Regex\": \"...\"}} (a str regex), got {short_repr(spec)}")
    if step.get("behavior") != "Isolated" or step.get("invert"):
        raise ValueError(
            f"{where}: Split with behavior={short_repr(step.get('behavior'))}, invert={short_repr(step.get('invert'))} is not "
            "supported (minillm implements behavior='Isolated', invert=false)"
        )
    return spec["Regex"]


def check_compiled_size(pattern: str) -> None:
    """Refuse ``pattern`` if ``regex.compile`` would build more than ``_MAX_COMPILED_NODES`` nodes."""
    if len(pattern) > _MAX_PATTERN_CHARS:
        raise ValueError(
            f"the pre-tokenizer pattern {short(pattern)} is {len(pattern)} characters long "
            f"(the limit is {_MAX_PATTERN_CHARS})"
        )
    nodes = compiled_size(pattern)
    if nodes > _MAX_COMPILED_NODES:
        raise ValueError(
            f"the pre-tokenizer pattern {short(pattern)} repeats too much: compiling it would build about "
            f"{nodes} nodes (the limit is {_MAX_COMPILED_NODES})"
        )


def compiled_size(pattern: str) -> int:
    """About how many nodes ``regex.compile(pattern)`` builds, counted before anything is compiled.

    The pattern is parsed by the ``regex`` module's own parser, the pure-Python first half of
    ``regex.compile`` (``_regex_core``), exactly as ``regex.compile`` calls it: comments
    ``(?#...)``, verbose mode (``(?x)`` anywhere in the pattern switches it on for all of it,
    and ``regex`` then parses again), escapes, classes, version-1 set operations and fuzzy
    constraints are read as the engine reads them, so no spelling can hide a group or a repeat.
    Parsing is linear and builds a tree with one node per item; the C half is what unrolls
    repeats, so the tree's nodes are counted, every repeat multiplying its body by its minimum
    count (``{m}``, ``{m,n}``, ``+``; the copies up to the maximum are not built). A group
    called by ``(?1)`` or ``(?R)`` may be compiled again for a lookbehind or a fuzzy match, so
    each distinct call target adds four copies of everything.

    Why this and not a test compile in a child process under a memory limit: a child costs a
    process start per load, its memory limit does not hold on macOS or Windows, and a refusal
    from it could only say "out of memory". The count is exact about syntax and explains what
    it refused. ``_regex_core`` is internal to ``regex``: if a new version renames what is used
    here, every pattern but the built-in ones is refused, loudly, until this is updated.
    """
    try:
        tree, calls = _parse_like_regex(pattern)
    except regex.error:
        return 0  # regex.compile fails in the same parser, before building anything
    except RecursionError:
        raise ValueError(f"the pre-tokenizer pattern {short(pattern)} nests groups too deeply") from None
    except ValueError as err:  # a repeat count of thousands of digits: int() refuses it
        raise ValueError(f"the pre-tokenizer pattern {short(pattern)} does not compile: {err}") from None
    sizes: dict[int, int] = {}

    def size(node: Any) -> int:
        known = sizes.get(id(node))
        if known is not None:
            return known
        body = sum(size(child) for child in _children(node))
        own = _NODE_WEIGHTS.get(type(node).__name__, 1)
        total = own + body * max(node.min_count, 1) if isinstance(node, _core.GreedyRepeat) else own + body
        sizes[id(node)] = total
        return total

    try:
        nodes = size(tree)
    except RecursionError:
        raise ValueError(f"the pre-tokenizer pattern {short(pattern)} nests groups too deeply") from None
    return nodes * (1 + 4 * calls)


def _parse_like_regex(pattern: str) -> tuple[Any, int]:
    """The parse tree ``regex.compile`` builds for ``pattern`` (with no flags), and how many
    distinct groups it calls. The loop is ``regex._main._compile``'s: a flag set globally in
    the middle of the pattern (``(?x)``) makes it parse again from the start with that flag."""
    if _core is None:
        raise ValueError(
            f"regex {regex.__version__} changed the internals that minillm uses to check the size of a pattern "
            "before compiling it; only the built-in GPT-2, Llama 3 and Qwen2 patterns can be used"
        )
    _core.DEFAULT_VERSION = regex.DEFAULT_VERSION  # as regex.compile does before parsing
    flags = 0
    while True:
        source = _core.Source(pattern)
        info = _core.Info(flags, source.char_type, {})
        source.ignore_space = bool(info.flags & _core.VERBOSE)
        source.use_unicode_space(bool(info.flags & _core.VERSION1))
        try:
            tree = _core._parse_pattern(source, info)
            break
        except _core._UnscopedFlagSet:
            flags = info.global_flags
    calls = set()
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, _core.CallGroup):
            calls.add(node.group)
        stack.extend(_children(node))
    return tree, len(calls)


def _children(node: Any) -> list[Any]:
    """The nodes a parse-tree node holds, whatever its kind: its attributes that are nodes, or
    lists or tuples of nodes (a sequence's items, a branch's branches, a set's members)."""
    found = []
    for value in vars(node).values():
        if isinstance(value, _core.RegexBase):
            found.append(value)
        elif isinstance(value, (list, tuple)):
            found.extend(item for item in value if isinstance(item, _core.RegexBase))
    return found


def _only_one(current: str | None, new: str) -> str:
    if current is not None:
        raise ValueError("pre-tokenizers with two splitting regexes are not supported")
    return new
