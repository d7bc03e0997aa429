"""Regular expressions -> a tree of four node kinds (notebook 13, step 1a).

A model does not write characters, it writes tokens, and a token is a run of *bytes*: ``'é'``
is two bytes in UTF-8 and a byte-level BPE may well cut it in half (one token ends with
``0xC3``, the next starts with ``0xA9``). So the automaton that constrains generation must read
bytes, not characters. Getting there takes three steps, one module each: this one **parses**
the pattern, ``nfa.py`` compiles the tree into a Thompson NFA over bytes, ``dfa.py``
determinizes it.

The tree has four node kinds: ``Chars`` (one character out of a set of code points: a literal,
``.``, ``\\d``, ``[a-z]``, ``[^"]``...), ``Concat``, ``Alt`` (``|``) and ``Repeat`` (``*``,
``+``, ``?``, ``{n}``, ``{n,}``, ``{n,m}``). Groups, capturing or not (``(...)``,
``(?:...)``, ``(?P<name>...)``), only group; lazy quantifiers (``*?``) match the same
*language* as greedy ones, and the language is all a constraint needs.

What is refused, and why: a backreference (``\\1``) describes a language no finite automaton
recognises; lookarounds (``(?=...)``), ``\\b`` and inline flags (``(?i)``) could be compiled
(an intersection of automata, a case fold) but are rare in constraints and easy to get subtly
wrong. ``^`` and ``$`` are accepted only at the very ends: a constraint always matches the
whole output. Each refusal is a ``RegexError`` naming the construct and its position.

The classes ``\\d``, ``\\w``, ``\\s`` are **ASCII** (``[0-9]``, ``[A-Za-z0-9_]``,
``[ \\t\\n\\r\\f\\v]``), as in JSON Schema's ECMA-262 patterns and Python's ``re.ASCII``: a
phone-number constraint should not admit Arabic-Indic digits. ``.`` is any character but
``\\n``, as in Python and Rust.

Hostile patterns are bounded before any work grows with them: ``MAX_PATTERN_CHARS`` before
parsing, ``MAX_NESTING`` levels of groups (the parser recurses once per level), counts above
``MAX_REPEAT``; each is a ``GrammarTooLarge`` naming the limit.
"""

from __future__ import annotations

from dataclasses import dataclass

MAX_PATTERN_CHARS = 200_000  # longer patterns are refused before parsing
MAX_NESTING = 100  # groups inside groups (the parser recurses once per level)
MAX_REPEAT = 10_000  # the largest n in {n} / {n,m}

MAX_CODE_POINT = 0x10FFFF
SURROGATES = (0xD800, 0xDFFF)  # not characters: UTF-8 cannot encode them


class RegexError(ValueError):
    """The pattern is malformed or uses a construct outside the supported subset."""

    def __init__(self, message: str, pattern: str, pos: int) -> None:
        super().__init__(f"{message} at position {pos} of the pattern {_excerpt(pattern, pos)}")
        self.pos = pos


class GrammarTooLarge(ValueError):
    """A pattern or schema whose automaton would pass one of the named size limits."""

    def __init__(self, what: str, size: int, limit_name: str, limit: int) -> None:
        super().__init__(f"{what} needs {size:,} (or more) > {limit_name} = {limit:,}; simplify it "
                         "(fewer or smaller counted repetitions, alternatives or nested quantifiers)")
        self.limit_name, self.limit = limit_name, limit


def _excerpt(pattern: str, pos: int) -> str:
    start = max(0, pos - 20)
    return repr(("..." if start else "") + pattern[start : pos + 20] + ("..." if pos + 20 < len(pattern) else ""))


# ------------------------------------------------------------------------------ the tree
Ranges = tuple[tuple[int, int], ...]  # sorted, disjoint, inclusive code point ranges


@dataclass(frozen=True)
class Chars:
    """One character out of a set of code points (never a surrogate)."""

    ranges: Ranges


@dataclass(frozen=True)
class Concat:
    items: tuple  # of nodes; () is the empty string


@dataclass(frozen=True)
class Alt:
    items: tuple


@dataclass(frozen=True)
class Repeat:
    item: object
    min: int
    max: int | None  # None: unbounded


Node = Chars | Concat | Alt | Repeat


def normalize(ranges) -> Ranges:
    """Sort and merge ranges, and cut the surrogates out."""
    out: list[list[int]] = []
    for lo, hi in sorted(ranges):
        if out and lo <= out[-1][1] + 1:
            out[-1][1] = max(out[-1][1], hi)
        else:
            out.append([lo, hi])
    cut = []
    for lo, hi in out:
        if lo < SURROGATES[0] <= hi or lo <= SURROGATES[1] < hi or SURROGATES[0] <= lo <= hi <= SURROGATES[1]:
            cut += [(a, b) for a, b in ((lo, SURROGATES[0] - 1), (SURROGATES[1] + 1, hi)) if a <= b]
        else:
            cut.append((lo, hi))
    return tuple((lo, hi) for lo, hi in cut if lo <= hi)


def complement(ranges: Ranges) -> Ranges:
    out, nxt = [], 0
    for lo, hi in ranges:
        if lo > nxt:
            out.append((nxt, lo - 1))
        nxt = hi + 1
    if nxt <= MAX_CODE_POINT:
        out.append((nxt, MAX_CODE_POINT))
    return normalize(out)


DIGIT = ((0x30, 0x39),)
WORD = normalize([(0x30, 0x39), (0x41, 0x5A), (0x5F, 0x5F), (0x61, 0x7A)])
SPACE = ((0x09, 0x0D), (0x20, 0x20))
CLASS_ESCAPES = {"d": DIGIT, "w": WORD, "s": SPACE,
                 "D": complement(DIGIT), "W": complement(WORD), "S": complement(SPACE)}
ANY_BUT_NEWLINE = complement(((0x0A, 0x0A),))
CHAR_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "f": "\f", "v": "\v", "a": "\a"}
REFUSED_ESCAPES = {"b": "the word boundary \\b", "B": "the non-boundary \\B", "A": "the anchor \\A",
                   "Z": "the anchor \\Z", "z": "the anchor \\z", "G": "the anchor \\G",
                   "p": "the Unicode property class \\p{...}", "P": "the Unicode property class \\P{...}",
                   "k": "the named backreference \\k<...>", "g": "the backreference \\g", "N": "the named character \\N{...}"}


# ------------------------------------------------------------------------------ the parser
class _Parser:
    """Recursive descent: alternation -> concatenation -> quantified atom -> atom."""

    def __init__(self, pattern: str) -> None:
        self.p, self.i, self.depth = pattern, 0, 0

    def error(self, message: str, pos: int | None = None) -> RegexError:
        return RegexError(message, self.p, self.i if pos is None else pos)

    def peek(self, k: int = 0) -> str:
        return self.p[self.i + k] if self.i + k < len(self.p) else ""

    def parse(self) -> Node:
        end = len(self.p)
        if self.p.startswith("^"):
            self.i = 1
        if self.p.endswith("$") and not _escaped(self.p, end - 1) and end - 1 >= self.i:
            self.p = self.p[: end - 1]  # (positions before it are unchanged)
        node = self.alternation()
        if self.i < len(self.p):  # only an unmatched ')' stops the top level early
            raise self.error("unbalanced ')'")
        return node

    def alternation(self) -> Node:
        items = [self.concat()]
        while self.peek() == "|":
            self.i += 1
            items.append(self.concat())
        return items[0] if len(items) == 1 else Alt(tuple(items))

    def concat(self) -> Node:
        items = []
        while self.peek() not in ("", "|", ")"):
            items.append(self.quantified())
        return items[0] if len(items) == 1 else Concat(tuple(items))

    def quantified(self) -> Node:
        node = self.atom()
        quantifier = self.quantifier()
        if quantifier is None:
            return node
        if self.peek() == "?":  # lazy: the same language
            self.i += 1
        elif self.peek() == "+":
            raise self.error("possessive quantifiers (like *+) are not supported")
        if self.quantifier(peek_only=True):
            raise self.error("a quantifier directly after a quantifier (multiple repeat); add a group")
        return Repeat(node, *quantifier)

    def quantifier(self, peek_only: bool = False) -> tuple[int, int | None] | None:
        c = self.peek()
        simple = {"*": (0, None), "+": (1, None), "?": (0, 1)}
        if c in simple:
            if not peek_only:
                self.i += 1
            return simple[c]
        if c != "{":
            return None
        close = self.p.find("}", self.i)
        body = self.p[self.i + 1 : close] if close > 0 else ""
        lo_text, comma, hi_text = body.partition(",")
        if close < 0 or not (lo_text.isdigit() or (comma and not lo_text)) or not (hi_text.isdigit() or not hi_text) \
                or not (lo_text.isascii() and hi_text.isascii()):
            raise self.error("'{' that does not start a quantifier {n}, {n,}, {n,m}; write \\{ for a literal brace")
        if peek_only:
            return (0, None)
        if max(len(lo_text), len(hi_text)) > 9:  # (int() of a 5,000-digit string would be refused by Python)
            raise GrammarTooLarge(f"the repetition {{{body[:20]}...}}", 10**9, "MAX_REPEAT", MAX_REPEAT)
        lo = int(lo_text) if lo_text else 0
        hi = None if comma and not hi_text else int(hi_text) if comma else lo
        if max(lo, hi or 0) > MAX_REPEAT:
            raise GrammarTooLarge(f"the repetition {{{body}}}", max(lo, hi or 0), "MAX_REPEAT", MAX_REPEAT)
        if hi is not None and hi < lo:
            raise self.error(f"the quantifier {{{body}}} has max < min")
        self.i = close + 1
        return lo, hi

    def atom(self) -> Node:
        c, start = self.peek(), self.i
        self.i += 1
        if c == "(":
            return self.group(start)
        if c == "[":
            return Chars(self.char_class(start))
        if c == ".":
            return Chars(ANY_BUT_NEWLINE)
        if c == "\\":
            found = self.escape(in_class=False)
            return Chars(found) if isinstance(found, tuple) else _literal(found)
        if c in "*+?{":
            raise self.error("nothing to repeat", start)
        if c == "^":
            raise self.error("'^' is only supported at the start of the pattern", start)
        if c == "$":
            raise self.error("'$' is only supported at the end of the pattern", start)
        if c == "]" or c == "}":
            raise self.error(f"unescaped '{c}'; write \\{c} for the literal", start)
        if SURROGATES[0] <= ord(c) <= SURROGATES[1]:
            raise self.error(f"the lone surrogate {c!r} (UTF-8 cannot encode it)", start)
        return _literal(c)

    def group(self, start: int) -> Node:
        if self.peek() == "?":
            kind = self.p[self.i : self.i + 3]
            if kind.startswith("?:"):
                self.i += 2
            elif kind.startswith(("?P<", "?<")) and kind not in ("?<=", "?<!"):
                close = self.p.find(">", self.i)
                if close < 0:
                    raise self.error("unterminated group name", start)
                self.i = close + 1
            else:
                names = {"?=": "the lookahead (?=...)", "?!": "the negative lookahead (?!...)",
                         "?<=": "the lookbehind (?<=...)", "?<!": "the negative lookbehind (?<!...)",
                         "?P=": "the backreference (?P=name)", "?>": "the atomic group (?>...)",
                         "?#": "the comment (?#...)", "?(": "the conditional (?(...)...)"}
                what = names.get(kind) or names.get(kind[:2]) or "the inline flags (?...) (or another (? extension)"
                raise self.error(f"{what} is not supported", start)
        self.depth += 1
        if self.depth > MAX_NESTING:
            raise GrammarTooLarge("the pattern's nesting of groups", self.depth, "MAX_NESTING", MAX_NESTING)
        node = self.alternation()
        self.depth -= 1
        if self.peek() != ")":
            raise self.error("missing ')' for the group opened", start)
        self.i += 1
        return node

    def escape(self, in_class: bool) -> str | Ranges:
        """After a backslash: a character (str) or a class (ranges)."""
        c, start = self.peek(), self.i - 1
        self.i += 1
        if c == "":
            raise self.error("a pattern cannot end with a backslash", start)
        if c in CLASS_ESCAPES:
            return CLASS_ESCAPES[c]
        if c in CHAR_ESCAPES:
            return CHAR_ESCAPES[c]
        if c in "xuU":
            return self.hex_escape(c, start)
        if c.isdigit():
            raise self.error(f"the backreference (or octal escape) \\{c} is not supported", start)
        if c in REFUSED_ESCAPES:
            raise self.error(f"{REFUSED_ESCAPES[c]} is not supported" + (" (inside a class)" if in_class else ""), start)
        if c.isascii() and c.isalpha():
            raise self.error(f"unknown escape \\{c}", start)
        return c  # an escaped punctuation mark (or any non-letter) is itself

    def hex_escape(self, kind: str, start: int) -> str:
        if self.peek() == "{" and kind in "xu":
            close = self.p.find("}", self.i)
            digits, self.i = (self.p[self.i + 1 : close], close + 1) if close > 0 else ("", self.i)
        else:
            width = {"x": 2, "u": 4, "U": 8}[kind]
            digits, self.i = self.p[self.i : self.i + width], self.i + width
            digits = digits if len(digits) == width else ""
        if not digits or len(digits) > 8 or any(d not in "0123456789abcdefABCDEF" for d in digits):
            raise self.error(f"a malformed \\{kind} escape", start)
        value = int(digits, 16)
        if value > MAX_CODE_POINT or SURROGATES[0] <= value <= SURROGATES[1]:
            raise self.error(f"\\{kind}{digits} is not a Unicode scalar value (UTF-8 cannot encode it)", start)
        return chr(value)

    def char_class(self, start: int) -> Ranges:
        negate = self.peek() == "^"
        self.i += negate
        ranges: list[tuple[int, int]] = []
        first = True
        while True:
            c, at = self.peek(), self.i
            if c == "":
                raise self.error("missing ']' for the class opened", start)
            if c == "]" and not first:
                self.i += 1
                break
            first = False
            if c == "[":
                raise self.error("an unescaped '[' inside a class (nested classes and [:posix:] classes are "
                                 "not supported); write \\[ for the literal", at)
            if self.p[at : at + 2] in ("&&", "~~", "||"):
                raise self.error(f"the class set operation '{self.p[at:at + 2]}' is not supported", at)
            low = self.class_item()
            if self.peek() == "-" and self.peek(1) not in ("]", ""):
                self.i += 1
                high = self.class_item()
                if isinstance(low, tuple) or isinstance(high, tuple):
                    raise self.error("a range whose end is a class (like \\d-z)", at)
                if ord(high) < ord(low):
                    raise self.error(f"the range {low!r}-{high!r} is reversed", at)
                ranges.append((ord(low), ord(high)))
            elif isinstance(low, tuple):
                ranges += low
            else:
                ranges.append((ord(low), ord(low)))
        found = normalize(ranges)
        return complement(found) if negate else found

    def class_item(self) -> str | Ranges:
        c = self.peek()
        self.i += 1
        return self.escape(in_class=True) if c == "\\" else c


def _escaped(pattern: str, pos: int) -> bool:
    """Whether ``pattern[pos]`` is preceded by an odd number of backslashes."""
    n = 0
    while pos - n - 1 >= 0 and pattern[pos - n - 1] == "\\":
        n += 1
    return n % 2 == 1


def _literal(char: str) -> Chars:
    return Chars(((ord(char), ord(char)),))


def parse(pattern: str) -> Node:
    """The tree of ``pattern`` (a ``RegexError`` for what it cannot hold, see the module docstring)."""
    if not isinstance(pattern, str):
        raise TypeError(f"a pattern must be a str, got {type(pattern).__name__}")
    if len(pattern) > MAX_PATTERN_CHARS:
        raise GrammarTooLarge("the pattern's length", len(pattern), "MAX_PATTERN_CHARS", MAX_PATTERN_CHARS)
    return _Parser(pattern).parse()


def escape(text: str) -> str:
    """``text`` as a pattern matching exactly itself."""
    return "".join("\\" + c if c in r"\.^$|?*+()[]{}-/" else c for c in text)
