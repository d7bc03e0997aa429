"""Split regexes from a tokenizer file that would blow up when compiled (issue 32, class 1).

``regex.compile`` unrolls the minimum count of every repeat, so a pattern of 40 characters can ask
for gigabytes. The size is counted from the ``regex`` module's own parse of the pattern, so no
spelling hides a group or a repeat from it: comments, verbose mode, parentheses inside classes or
escaped, named groups, lookarounds, set operations, fuzzy constraints. Each blow-up below is
refused in milliseconds with a few MB allocated; the same shapes at small counts load, and so do
patterns right at the limit and the patterns of real tokenizers.
"""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer as HFTokenizer

from minillm import FileFormatError, Tokenizer
from minillm.tokenizer import PreTokenizer, pretokenize

from helpers.tokenizer_cases import EDGE_TEXT, hf_ids
from helpers.tokenizer_files import cheaply, refuses, split_spec, write_spec

FIELD = "pre_tokenizer.pretokenizers[0].pattern.Regex"
LIMIT = f"the limit is {pretokenize._MAX_COMPILED_NODES}"

# Each would build from two million to four billion nodes (0.5 GB to 1 TB); the first ones hide
# their groups from a scan that counts parentheses in the text.
BLOWUPS = {
    "nested repeats": "(?:(?:(?:a{100}){100}){100}){100}",
    "comments hiding groups": "(?:(?:(?:a{100}(?#()){100}(?#()){100}(?#()){100}",
    "comments holding a backslash": r"(?:(?:(?:a{100}(?#\()){100}(?#[)){100}(?#\()){100}",
    "verbose comments": "(?x)(?:(?:(?:a{100}#(\n){100}#(\n){100}#(\n){100}",
    "verbose scoped": "(?x:(?:(?:(?:a{100}#(\n){100}#(\n){100}#(\n){100})",
    "verbose spaced counts": "(?x)(?:(?:(?:a{1 0 0}){1 0 0}){1 0 0}){1 0 0}",
    "parentheses in classes": "(?:(?:(?:[(]{100}[)]){100}[()]){100}[(]){100}",
    "class opening with ]": "(?:(?:(?:[]()]{100}){100}){100}){100}",
    "escaped parentheses": r"(?:(?:(?:\({100}\)){100}\(){100}\)){100}",
    "named groups": "(?P<a>(?<b>(?P<c>a{100}){100}){100}){100}",
    "lookarounds": "(?=(?:(?:a{100}){100}){100})(?<!(?:(?:b{100}){100}){100})",
    "ranges and open repeats": "(?:(?:(?:a{100,200}){100,}){100,300}){100}",
    "a plus around big repeats": "(?:(?:a{1000}){1000})+",
    "version 1 set operations": "(?V1)(?:(?:(?:[[a-z]--[q]]{100}){100}){100}){100}",
    "fuzzy constraints": "(?:(?:(?:(?:ab){e<=1}){100}){100}){100}",
    "possessive and lazy": "(?:(?:(?:a{100}+){100}?){100}+){100}",
    "one huge repeat": "a{4294967294}",
    "two big repeats": "(?:a{65535}){65535}",
}


def shrunk(pattern: str) -> str:
    """The same shape with every count made small: what the counting must not refuse."""
    for big, small in [("{100}", "{2}"), ("{1 0 0}", "{2}"), ("100,", "2,"), (",200", ",3"), (",300", ",3"),
                       ("1000", "2"), ("4294967294", "3"), ("65535", "3")]:
        pattern = pattern.replace(big, small)
    return pattern


@pytest.mark.parametrize("pattern", BLOWUPS.values(), ids=BLOWUPS.keys())
def test_a_split_regex_that_would_unroll_to_gigabytes_is_refused_before_compiling(tmp_path, trained_spec, pattern):
    path = write_spec(tmp_path, split_spec(trained_spec, pattern))
    cheaply(lambda: refuses(path, FIELD, "repeats too much", LIMIT), max_bytes=50 << 20)


@pytest.mark.parametrize("pattern", BLOWUPS.values(), ids=BLOWUPS.keys())
def test_the_same_shapes_with_small_counts_load_and_split(tmp_path, trained_spec, pattern):
    tok = Tokenizer.from_file(write_spec(tmp_path, split_spec(trained_spec, shrunk(pattern))))
    text = "aaaa ab((()) qq\n" * 3
    assert "".join(tok.pretokenizer.split(text)) == text
    assert tok.decode(tok.encode(text)) == text


def test_the_direct_constructor_refuses_too(tmp_path):
    with pytest.raises(ValueError, match=rf"repeats too much.*{LIMIT}"):
        PreTokenizer(BLOWUPS["comments hiding groups"])


def test_a_pattern_at_the_limit_loads_and_one_node_more_is_refused(tmp_path, trained_spec):
    """Each more count of ``a{n}`` is one more node."""
    limit = pretokenize._MAX_COMPILED_NODES
    n = limit - pretokenize.compiled_size("a{2}|[^a]+|a+") + 2
    at_limit = f"a{{{n}}}|[^a]+|a+"
    assert pretokenize.compiled_size(at_limit) == limit
    tok = Tokenizer.from_file(write_spec(tmp_path, split_spec(trained_spec, at_limit)))
    assert tok.decode(tok.encode("abc" * 10)) == "abc" * 10
    refuses(write_spec(tmp_path, split_spec(trained_spec, f"a{{{n + 1}}}|[^a]+|a+")), FIELD, LIMIT)


# Real pre-tokenizer patterns: the three minillm knows by name, and two of other tokenizers'
# Split steps (GPT-4o's o200k, and a DeepSeek-V3-style one with parentheses inside a class).
O200K = (
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"""
    r"""|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"""
    r"""|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
DEEPSEEK_STYLE = (
    r"""[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"""
    r"""| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
REAL_PATTERNS = {
    "gpt2": pretokenize.GPT2_PATTERN,
    "llama3": pretokenize.LLAMA3_PATTERN,
    "qwen2": pretokenize.QWEN2_PATTERN,
    "o200k": O200K,
    "deepseek-style": DEEPSEEK_STYLE,
}


@pytest.mark.parametrize("pattern", REAL_PATTERNS.values(), ids=REAL_PATTERNS.keys())
def test_real_patterns_are_far_below_the_limit_and_load_like_hf(tmp_path, trained_spec, pattern):
    assert pretokenize.compiled_size(pattern) < 1000
    path = write_spec(tmp_path, split_spec(trained_spec, pattern))
    tok, hf = Tokenizer.from_file(path), HFTokenizer.from_file(str(path))
    assert tok.encode(EDGE_TEXT) == hf_ids(hf, EDGE_TEXT)


def test_the_count_follows_the_regex_parser():
    """Spot checks of what is counted: a repeat multiplies its body by its minimum count, the
    copies up to the maximum cost nothing, and what the parser drops (comments, verbose-mode
    whitespace) costs nothing either."""
    size = pretokenize.compiled_size
    assert size("(?:ab){10}") == size("(?:ab){10,1000}") == size("(?:ab){10,}")
    assert size("(?:ab){10}") - size("(?:ab){2}") == 8 * 3  # the body is a sequence and two characters
    assert size("(?:ab)*") == size("(?:ab)?") == size("(?:ab)+") == size("(?:ab)") + 2  # a repeat node
    assert size("a(?#((((((((((((((((((((((((((((()b") == size("ab")
    assert size("(?x)a # (((((((((((((((\n b") == size("(?x)ab") == size("ab")
    assert size("[(((((]") == size("[((]") + 3 and size(r"\(") == size("a")  # a class: one node a member


def test_a_repeat_count_of_thousands_of_digits_is_a_clear_error(tmp_path, trained_spec):
    """``int()`` refuses 4300+ digits with a ValueError the caller cannot place; it names the field now."""
    path = write_spec(tmp_path, split_spec(trained_spec, "a{" + "9" * 5000 + "}"))
    cheaply(lambda: refuses(path, FIELD, "does not compile"))


def test_groups_nested_too_deeply_for_the_parser_are_a_clear_error(tmp_path, trained_spec):
    """regex's parser recurses once per group: 5000 of them raised a bare RecursionError."""
    path = write_spec(tmp_path, split_spec(trained_spec, "(" * 5000 + "a" + ")" * 5000))
    cheaply(lambda: refuses(path, FIELD, "nests groups too deeply"))


def test_a_pattern_too_long_to_parse_quickly_is_refused_by_its_length(tmp_path, trained_spec):
    path = write_spec(tmp_path, split_spec(trained_spec, "a|" * 50_000 + "b"))
    cheaply(lambda: refuses(path, FIELD, "100001 characters long", f"limit is {pretokenize._MAX_PATTERN_CHARS}"))


def test_a_named_list_the_file_cannot_supply_is_a_clear_error(tmp_path, trained_spec):
    refuses(write_spec(tmp_path, split_spec(trained_spec, r"\L<words>")), FIELD, "does not compile")


def test_the_regex_internals_the_count_relies_on_are_there():
    """The count uses the regex module's parser (``_regex_core``). A regex release that renames it
    would make minillm refuse every pattern it does not know by name; this test says so first."""
    assert pretokenize._core is not None
    assert pretokenize.compiled_size("(?:a{7}){3}") == 1 + 2 + 3 * (1 + 2 + 7)


def test_a_huge_split_regex_error_stays_short(tmp_path, trained_spec):
    message = refuses(write_spec(tmp_path, split_spec(trained_spec, "(?:a{100}){100}" * 1000)), FIELD)
    assert len(message) < 600
    with pytest.raises(FileFormatError):
        Tokenizer.from_file(write_spec(tmp_path, split_spec(trained_spec, "(" * 3000)))
