"""Regex -> tree -> NFA over bytes -> minimal DFA (notebook 13, steps 1-2): the DFA accepts
exactly what Python's ``re.fullmatch`` (ASCII classes) accepts, on hand-picked and on random
patterns; UTF-8 range splitting encodes exactly the code points of the range; minimization
keeps the language; and every construct outside the subset is refused naming it and its place."""

from __future__ import annotations

import random
import re

import pytest
import regex
from hypothesis import given, settings
from hypothesis import strategies as st

from minillm.structured import DEAD, RegexError, compile_regex, escape, find_difference, parse
from minillm.structured.dfa import determinize, nfa_to_dfa, trim
from minillm.structured.nfa import compile_nfa, utf8_sequences

HYPOTHESIS = settings(max_examples=150, deadline=None)

# Patterns of the kinds users write, with strings to try beside random ones.
PATTERNS = [
    (r"\(\d{3}\) \d{3}-\d{4}", ["(555) 123-4567", "(555)123-4567", "(55) 123-4567"]),
    (r"\d{4}-\d{2}-\d{2}", ["2024-01-31", "2024-1-31", "20240131"]),
    (r"[A-Za-z_][A-Za-z0-9_]*", ["x", "_private", "9lives", "snake_case_9"]),
    (r"(red|green|blue)", ["red", "green", "blu", "redgreen"]),
    (r"-?(0|[1-9]\d*)(\.\d+)?([eE][+-]?\d+)?", ["0", "-12.5e+3", "01", "1.", "1e5"]),
    (r"[a-z0-9._%+-]+@[a-z0-9-]+\.[a-z]{2,}", ["a.b@c.io", "a@b", "@c.io"]),
    (r'"([^"\\]|\\.)*"', ['"a\\"b"', '"unterminated', '"é"']),
    (r"[α-ω]+", ["αβγ", "ω", "a", "Ω"]),
    (r"\d{3}-\d{4}", ["555-1234", "5551234"]),
    (r"((ab|cd){1,3}x)+", ["abx", "abcdabxcdx", "abcdabcdx"]),
    (r"(?:yes|no)(?P<bang>!)?", ["yes!", "no", "maybe"]),
    (r"^\w+\s\w+$", ["hello world", "hello  world"]),
    (r"[^\n]{0,5}\n", ["abc\n", "abcdef\n", "\n"]),
    (r".+?é", ["é", "aé", "日本é"]),
    (r"[\]\-a]+|\[\.\^", ["]-a", "[.^"]),
    (r"\x41\u00e9\U0001F600", ["Aé😀"]),
    (r"a{2}b{1,}c{,2}d{0,1}", ["aab", "aabbbcc", "aabd", "ab"]),
    (r"(a|)*b", ["b", "aab"]),
]
ALPHABET = "abcdxyz019-._@ \n\"\\()[]éαωΩ日😀"


def oracle(pattern: str, text: str) -> bool:
    return re.fullmatch(pattern, text, re.ASCII) is not None


@pytest.mark.parametrize("pattern, texts", PATTERNS, ids=[p for p, _ in PATTERNS])
def test_the_dfa_accepts_what_python_re_accepts(pattern, texts):
    dfa = compile_regex(pattern)
    rng = random.Random(pattern)
    pool = list(set(ALPHABET) | set(pattern) - set("^$"))
    tries = texts + ["".join(rng.choice(pool) for _ in range(rng.randint(0, 10))) for _ in range(2000)]
    for text in tries:
        assert dfa.matches(text.encode()) == oracle(pattern, text), (pattern, text)
    for text in texts:  # every prefix: still completable? (the ``regex`` module's partial matching)
        for k in range(len(text) + 1):
            viable = regex.fullmatch(pattern, text[:k], regex.ASCII, partial=True) is not None
            assert dfa.is_prefix(text[:k].encode()) == viable, (pattern, text[:k])


def test_a_character_is_its_utf8_bytes_and_a_token_may_cut_it():
    dfa = compile_regex("[α-ω]+")  # U+03B1..U+03C9: CE B1..CF 89
    half = dfa.walk("α".encode()[:1])
    assert half != DEAD and not dfa.accepting[half]  # the first byte of α: viable, not a match
    assert dfa.accepting[dfa.walk("α".encode()[1:], half)]
    assert dfa.walk(b"\xce\x80") == DEAD  # U+0380 is below α
    assert not dfa.matches(b"\xed\xa0\x80")  # an encoded surrogate is never accepted


def test_the_textbook_minimal_dfa():
    """(a|b)*abb: four live states (Aho, Sethi, Ullman's example), plus the dead one."""
    dfa = compile_regex("(a|b)*abb")
    assert dfa.n_states == 5
    assert dfa.start == 1 and dfa.table[DEAD].tolist() == [DEAD] * dfa.table.shape[1]


def test_byte_classes_make_the_table_narrow():
    dfa = compile_regex("[a-z]+@[a-z]+")
    # classes are byte intervals: 00-3F, @, 41-60, a-z, 7B-FF (bytes no edge tells apart share one)
    assert dfa.table.shape[1] == 5
    assert len({int(dfa.byte_class[b]) for b in b"abcxyz"}) == 1


def test_find_difference_is_a_shortest_witness():
    assert find_difference(compile_regex("a*"), compile_regex("a{0,3}")) == b"aaaa"
    assert find_difference(compile_regex("(a|b)*abb"), compile_regex("[ab]*abb")) is None
    assert find_difference(compile_regex("a|b"), compile_regex("a"), one_way=True) == b"b"
    assert find_difference(compile_regex("a"), compile_regex("a|b"), one_way=True) is None


# --------------------------------------------------------------------------- UTF-8 ranges
def _encodings(sequences) -> set[bytes]:
    out = {b""}
    for seq in sequences:
        pieces = {b""}
        for lo, hi in seq:
            pieces = {p + bytes([b]) for p in pieces for b in range(lo, hi + 1)}
        out |= pieces
    return out - {b""}


@given(st.integers(0, 0x10FFFF), st.integers(0, 3000))
@HYPOTHESIS
def test_utf8_sequences_encode_exactly_the_range(lo, width):
    hi = min(lo + width, 0x10FFFF)
    if lo <= 0xDFFF and hi >= 0xD800:  # callers cut surrogates out first (regex.normalize)
        lo, hi = (lo, 0xD7FF) if lo < 0xD800 else (0xE000, max(hi, 0xE000))
    sequences = utf8_sequences(lo, hi)
    assert _encodings(sequences) == {chr(c).encode() for c in range(lo, hi + 1)}
    assert len(sequences) <= 9  # a few pieces, never one per code point


def test_the_full_unicode_range_is_seven_sequences():
    assert len(utf8_sequences(0, 0xD7FF) + utf8_sequences(0xE000, 0x10FFFF)) <= 9
    assert utf8_sequences(0x80, 0x7FF) == [((0xC2, 0xDF), (0x80, 0xBF))]


# --------------------------------------------------------------------------- random patterns
def _atoms():
    chars = st.sampled_from(list("abc") + ["é", "α", r"\d", r"\w", r"\s", ".", "[a-c]", "[^a]", "[α-ω]", r"\."])
    return chars


def _patterns():
    return st.recursive(
        _atoms(),
        lambda inner: st.one_of(
            st.lists(inner, min_size=2, max_size=3).map("".join),
            st.lists(inner, min_size=2, max_size=3).map(lambda xs: "(" + "|".join(xs) + ")"),
            st.tuples(inner, st.sampled_from(["*", "+", "?", "{2}", "{1,3}", "{0,2}", "{2,}", "*?"])).map(
                lambda t: "(?:" + t[0] + ")" + t[1]),
        ),
        max_leaves=8,
    )


@given(_patterns(), st.randoms(use_true_random=False))
@HYPOTHESIS
def test_random_patterns_agree_with_python_re(pattern, rng):
    """The minimal DFA, the DFA before minimization and ``re.fullmatch`` agree on random text
    (half of it built from pieces the pattern can match, so matches are not rare)."""
    full = nfa_to_dfa(compile_nfa(parse(pattern)))
    raw = trim(determinize(compile_nfa(parse(pattern))))
    assert find_difference(full, raw) is None
    assert full.n_states <= raw.n_states
    pieces = ["a", "b", "c", "é", "α", "1", " ", "x", ".", "\n", "ω", "ab", "aa"]
    for _ in range(60):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 6)))
        assert full.matches(text.encode()) == oracle(pattern, text), (pattern, text)


@given(st.text(min_size=0, max_size=12))
@HYPOTHESIS
def test_escape_matches_exactly_the_text(text):
    text = "".join(c for c in text if not 0xD800 <= ord(c) <= 0xDFFF)
    dfa = compile_regex(escape(text))
    assert dfa.matches(text.encode())
    assert not dfa.matches(text.encode() + b"x")


# --------------------------------------------------------------------------- refusals
REFUSED = [
    (r"(a)\1", r"backreference .*\\1.* at position 3"),
    (r"(?=a)b", r"lookahead .* at position 0"),
    (r"a(?!b)", r"negative lookahead .* at position 1"),
    (r"(?<=a)b", r"lookbehind .* at position 0"),
    (r"(?<!a)b", r"negative lookbehind .* at position 0"),
    (r"(?P=n)", r"backreference \(\?P=name\)"),
    (r"\bword", r"word boundary \\b .* at position 0"),
    (r"(?i)abc", r"inline flags"),
    (r"(?>a)", r"atomic group"),
    (r"a*+", r"possessive"),
    (r"a**", r"multiple repeat"),
    (r"*a", r"nothing to repeat at position 0"),
    (r"a|?", r"nothing to repeat at position 2"),
    (r"a{", r"'\{' that does not start a quantifier"),
    (r"a{3,1}", r"max < min"),
    (r"[a", r"missing '\]'"),
    (r"(a", r"missing '\)'"),
    (r"a)", r"unbalanced '\)' at position 1"),
    (r"a^b", r"'\^' is only supported at the start"),
    (r"a$b", r"'\$' is only supported at the end"),
    (r"[[:alpha:]]", r"unescaped '\[' inside a class"),
    (r"[a&&b]", r"set operation '&&'"),
    (r"[z-a]", r"reversed"),
    (r"[\d-z]", r"range whose end is a class"),
    (r"\p{L}", r"Unicode property class"),
    (r"\q", r"unknown escape \\q"),
    (r"\ud800", r"not a Unicode scalar value"),
    (r"\x4", r"malformed \\x escape"),
    ("abc\\", r"cannot end with a backslash"),
    ("\ud800", r"lone surrogate"),
]


@pytest.mark.parametrize("pattern, message", REFUSED, ids=[p for p, _ in REFUSED])
def test_unsupported_syntax_is_refused_naming_the_construct_and_position(pattern, message):
    with pytest.raises(RegexError, match=message):
        compile_regex(pattern)


def test_rust_style_braced_escapes():
    assert compile_regex(r"\x{1F601}\u{e9}").matches("😁é".encode())


def test_anchors_at_the_ends_and_escaped_dollars_are_fine():
    assert compile_regex("^ab$").matches(b"ab")
    assert compile_regex(r"a\$").matches(b"a$")
    assert compile_regex("$").matches(b"")


def test_a_pattern_that_matches_nothing_is_refused():
    with pytest.raises(ValueError, match="matches no string"):
        compile_regex(r"[^\x00-\U0010FFFF]")
