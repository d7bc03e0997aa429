"""Parity with outlines-core (the reference): on the same regex and the same vocabulary
(SmolLM2's and GPT-2's), minillm's index allows every token outlines-core's ``Index`` allows, at
every state of seeded random walks; the only tokens it allows beyond them are the ones
outlines-core 0.2 refuses for reasons of its regex engine, not of the language (see
``helpers.structured.compare_walks``), each checked against the ``regex`` module's partial
matching. JSON schemas go through outlines-core's regex and through minillm's own, and the
language of outlines-core's regex is contained in minillm's (the shortest string in the
difference says where minillm is more permissive: a space before an array's comma, ``\\u``
escapes, exponents without a sign, C1 characters in strings)."""

from __future__ import annotations

import json

import pytest
import regex
from helpers.structured import compare_walks, for_rust, outlines_vocabulary

from minillm.structured import TokenIndex, compile_regex, find_difference, schema_to_regex, vocab_trie

outlines_core = pytest.importorskip("outlines_core")
from outlines_core.json_schema import build_regex_from_schema

REGEXES = [
    r"\(\d{3}\) \d{3}-\d{4}",  # a phone number
    r"\d{3}-\d{4}",
    r"\d{4}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])",  # a date
    r"[A-Za-z_][A-Za-z0-9_]{0,15}",  # an identifier
    r"(red|green|blue|yellow)",  # an enum
    r"(cat|category)s?",  # an enum whose first choice is a prefix of another
    r"-?\d+(\.\d+)?([eE][+-]?\d+)?",  # a float
    r"[a-z0-9._]+@[a-z0-9]+\.(com|org|net)",  # an email, lite
    r'"([^"\\]|\\["\\nt])*"',  # a quoted string with escapes
    r"[α-ω]+",  # a Unicode class
    r"((ab|cd){1,3}x)+",  # nested groups with quantifiers
    r"(\w+ ){2,4}\w+\.",  # a short sentence
    r"[^\n]{1,12}\n",
    r"(\+\d{1,3} )?\d{3} \d{3} \d{4}",
]

SCHEMAS = {
    "person": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string"}}, "kind": {"enum": ["a", "b", 1]}},
        "required": ["name"]},
    "all_optional": {"type": "object", "properties": {
        "a": {"type": "integer"}, "b": {"type": "string"}, "c": {"type": "boolean"}}},
    "bounded_array": {"type": "array", "items": {"type": "number"}, "minItems": 1, "maxItems": 3},
    "nested_ref": {"type": "object", "properties": {"user": {"$ref": "#/$defs/User"}, "ok": {"type": "boolean"}},
                   "required": ["user", "ok"],
                   "$defs": {"User": {"type": "object", "required": ["id"], "properties": {
                       "id": {"type": "integer"}, "nick": {"type": ["string", "null"]}}}}},
    "any_of": {"anyOf": [{"type": "string", "minLength": 1, "maxLength": 3}, {"type": "number"}, {"type": "null"}]},
    "middle_required": {"type": "object", "required": ["b"], "properties": {
        "a": {"type": "integer"}, "b": {"enum": ["x", "y"]}, "c": {"const": True}}},
}


@pytest.fixture(scope="module")
def vocabularies(smol, gpt2):
    return {"smol": (smol, outlines_vocabulary(smol)), "gpt2": (gpt2, outlines_vocabulary(gpt2))}


def check(pattern: str, tokenizer, reference_vocabulary, walks: int = 20):
    """Both indexes on ``pattern``; the walks' report, after asserting the parity laws."""
    ours = TokenIndex(compile_regex(pattern), vocab_trie(tokenizer), [tokenizer.eos_id])
    theirs = outlines_core.Index(for_rust(pattern), reference_vocabulary)
    report = compare_walks(ours, theirs, tokenizer, walks=walks)
    assert report.only_theirs == [], f"tokens outlines-core allows and minillm refuses: {report.only_theirs[:10]}"
    assert report.unexplained == [], f"tokens only minillm allows, not explained: {report.unexplained[:5]}"
    print(f"\n{pattern[:60]!r}: {report.checks} states checked ({len(report.states)} distinct), "
          f"{report.equal} equal sets, {report.only_ours} tokens only minillm allows (explained)")
    return report


@pytest.mark.parametrize("vocab", ["smol", "gpt2"])
@pytest.mark.parametrize("pattern", REGEXES)
def test_regex_index_parity(vocabularies, vocab, pattern):
    tokenizer, reference = vocabularies[vocab]
    report = check(pattern, tokenizer, reference)
    assert report.checks >= 20 and len(report.states) >= 2
    # The extras against an independent matcher: the output after each is still a viable prefix.
    oracle = regex.compile(pattern, regex.ASCII)
    for text in report.extra_texts:
        assert oracle.fullmatch(text, partial=True), (pattern, text)


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_schema_index_parity_on_outlines_regex(vocabularies, name):
    """outlines-core's regex for the schema, both indexes, SmolLM2's vocabulary."""
    tokenizer, reference = vocabularies["smol"]
    report = check(build_regex_from_schema(json.dumps(SCHEMAS[name])), tokenizer, reference)
    assert len(report.states) >= 5


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_schema_index_parity_on_minillm_regex(vocabularies, name):
    """minillm's regex for the schema, both indexes (outlines-core compiles it too)."""
    tokenizer, reference = vocabularies["smol"]
    report = check(schema_to_regex(SCHEMAS[name]), tokenizer, reference)
    assert len(report.states) >= 5


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_outlines_language_is_contained_in_minillms(name):
    """Every JSON text outlines-core's regex allows, minillm's allows too (with outlines-core's
    recursion depth where the schema recurses)."""
    theirs = compile_regex(build_regex_from_schema(json.dumps(SCHEMAS[name])))
    ours = compile_regex(schema_to_regex(SCHEMAS[name]))
    assert find_difference(theirs, ours, one_way=True) is None
    extra = find_difference(ours, theirs, one_way=True)
    print(f"\n{name}: a shortest text only minillm allows: {extra!r}")
    if extra is not None:
        assert json.loads(extra) is not None or extra == b"null"


def test_outlines_language_is_contained_with_compact_whitespace():
    schema = SCHEMAS["person"]
    theirs = compile_regex(build_regex_from_schema(json.dumps(schema), whitespace_pattern=""))
    ours = compile_regex(schema_to_regex(schema, whitespace=""))
    assert find_difference(theirs, ours, one_way=True) is None
