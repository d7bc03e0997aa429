"""Hostile patterns and schemas are refused with an error naming the limit they pass, before
the work grows with them: an NFA is sized before it is built, the subset construction stops at
its state limit, the parser and the schema builder bound their recursion, and the schema
builder stops at the first piece of regex over budget. Laws, not wall time: what must not run
is replaced by a function that fails, and memory is measured with tracemalloc."""

from __future__ import annotations

import random
import tracemalloc

import pytest

from minillm.structured import GrammarTooLarge, compile_regex, json_value_regex, schema_to_regex, token_index
from minillm.structured import index as index_module
from minillm.structured import nfa as nfa_module
from minillm.structured import regex as regex_module
from minillm.structured.dfa import MAX_DFA_STATES


def refused(build, limit: str, max_mb: float = 64.0) -> GrammarTooLarge:
    """Run ``build``, expect a GrammarTooLarge naming ``limit``, and bound the memory it took."""
    tracemalloc.start()
    try:
        with pytest.raises(GrammarTooLarge, match=limit) as caught:
            build()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < max_mb * 2**20, f"{peak / 2**20:.0f} MB"
    assert caught.value.limit_name == limit
    return caught.value


def _never(*args, **kwargs):
    raise AssertionError("this must not run")


@pytest.mark.parametrize("pattern", ["(a{1000}){1000}", "((a{100}){100}){100}", "(.{500}){500}", "(x?){9999}(y+){9999}(z*){9999}"])
def test_huge_nfas_are_refused_before_they_are_built(monkeypatch, pattern):
    monkeypatch.setattr(nfa_module, "_fragment", _never)
    error = refused(lambda: compile_regex(pattern), "MAX_NFA_STATES", max_mb=1)
    assert "MAX_NFA_STATES = 200,000" in str(error)


@pytest.mark.parametrize("pattern", ["(a|b)*a(a|b){20}", "[01]*1[01]{16}", ".{0,4000}", "(.|\n)*é(.|\n){12}"])
def test_exponential_dfas_stop_at_the_state_limit(pattern):
    error = refused(lambda: compile_regex(pattern), "MAX_DFA_STATES", max_mb=96)
    assert f"{MAX_DFA_STATES + 1:,}" in str(error)


@pytest.mark.parametrize("pattern", ["a{10001}", "a{2,10001}", "a{99999999999999999999}", "a{" + "9" * 5000 + "}"])
def test_counts_past_the_repeat_limit(pattern):
    refused(lambda: compile_regex(pattern), "MAX_REPEAT", max_mb=1)


def test_deep_nesting_is_refused_not_a_recursion_error():
    refused(lambda: compile_regex("(" * 10_000 + "a" + ")" * 10_000), "MAX_NESTING", max_mb=4)
    assert compile_regex("(" * 90 + "a" + ")" * 90).matches(b"a")


def test_long_patterns_are_refused_before_parsing(monkeypatch):
    monkeypatch.setattr(regex_module, "_Parser", _never)
    refused(lambda: compile_regex("a" * 300_000), "MAX_PATTERN_CHARS", max_mb=2)


def test_catastrophic_backtracking_patterns_are_just_small_dfas():
    """A backtracking engine takes 2^n steps on (x+x+)+y against x^n; a DFA reads each byte once."""
    dfa = compile_regex("(x+x+)+y")
    assert dfa.n_states <= 5 and not dfa.matches(b"x" * 10_000)
    assert compile_regex("(a|a)+$").matches(b"a" * 10_000)


# --------------------------------------------------------------------------- schemas
def test_enormous_enums_are_refused_naming_the_limit():
    rng = random.Random(0)
    huge = {"enum": [f"value-{i:06d}" for i in range(100_000)]}
    refused(lambda: schema_to_regex(huge), "MAX_PATTERN_CHARS", max_mb=64)
    many = {"enum": [f"v{i:05d}" for i in range(20_000)]}
    refused(lambda: compile_regex(schema_to_regex(many)), "MAX_NFA_STATES", max_mb=96)
    words = {"enum": ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(8)) for _ in range(5_000)]}
    refused(lambda: compile_regex(schema_to_regex(words)), "MAX_DFA_STATES", max_mb=160)
    small = {"enum": [f"v{i:03d}" for i in range(500)]}
    assert compile_regex(schema_to_regex(small)).matches(b'"v042"')


def test_deep_schemas_are_refused_not_a_recursion_error():
    schema: dict = {"type": "integer"}
    for _ in range(2_000):
        schema = {"type": "array", "items": schema}
    refused(lambda: schema_to_regex(schema), "MAX_SCHEMA_DEPTH", max_mb=8)


def test_references_that_fan_out_stop_at_the_budget():
    """Each definition refers to the next one from eight properties: 8^depth copies."""
    defs = {f"d{k}": {"type": "object", "properties": {f"p{i}": {"$ref": f"#/$defs/d{k + 1}"} for i in range(8)}}
            for k in range(12)}
    defs["d12"] = {"type": "integer"}
    refused(lambda: schema_to_regex({"$ref": "#/$defs/d0", "$defs": defs}), "MAX_PATTERN_CHARS", max_mb=64)
    recursive = {"$ref": "#/$defs/n", "$defs": {"n": {"type": "object", "properties": {
        f"k{i}": {"$ref": "#/$defs/n"} for i in range(30)}}}}
    refused(lambda: schema_to_regex(recursive, max_recursion_depth=4), "MAX_PATTERN_CHARS", max_mb=64)


def test_deep_free_values_are_refused():
    refused(lambda: json_value_regex(12), "MAX_PATTERN_CHARS", max_mb=64)


def test_long_strings_pass_the_dfa_limit_and_say_so():
    """maxLength counts characters, and each character a string may still hold is 9 DFA states:
    about 1,100 fits, 2,000 is past the limit (a length is better bounded by max_tokens)."""
    refused(lambda: compile_regex(schema_to_regex({"type": "string", "maxLength": 2_000})), "MAX_DFA_STATES", max_mb=160)
    refused(lambda: compile_regex(schema_to_regex({"type": "string", "maxLength": 5_000})), "MAX_NFA_STATES", max_mb=1)
    refused(lambda: compile_regex(schema_to_regex({"type": "string", "maxLength": 10**6})), "MAX_REPEAT", max_mb=1)
    assert compile_regex(schema_to_regex({"type": "string", "maxLength": 1_000})).matches(b'"' + b"x" * 1_000 + b'"')


# --------------------------------------------------------------------------- caches
def test_the_caches_are_bounded(monkeypatch, trained):
    monkeypatch.setattr(index_module, "MAX_CACHED_STATES", 4)
    index = token_index("[a-z]{0,40}", trained)
    assert index.explore_all() > 4
    assert len(index._cache) == 4  # (the state cache is private: its bound is the law checked here)
    for i in range(index_module.MAX_CACHED_INDEXES + 5):
        token_index(f"a{{{i}}}", trained)
    assert len(index_module._INDEXES) == index_module.MAX_CACHED_INDEXES
