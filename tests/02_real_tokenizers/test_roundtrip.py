"""The round-trip law: decode(encode(s)) == s, for any Unicode string.

Byte-level BPE can encode any string, so nothing is lost as long as the vocabulary holds all
256 bytes (GPT-2 and every tokenizer minillm trains). SmolLM2 lacks 21 bytes, so there the
law holds only for text whose UTF-8 avoids them.
"""

from __future__ import annotations

from hypothesis import given, settings

from helpers.tokenizer_cases import SMOL_MISSING_CONTROLS, any_text, smol_safe_text


@settings(max_examples=200, deadline=None)
@given(any_text)
def test_gpt2_round_trip(gpt2, text):
    assert gpt2.decode(gpt2.encode(text)) == text


@settings(max_examples=200, deadline=None)
@given(any_text)
def test_trained_tokenizer_round_trip(trained, text):
    assert trained.decode(trained.encode(text)) == text


def test_trained_tokenizer_has_every_byte(trained, gpt2):
    """The precondition of the law: no byte is missing."""
    assert trained.missing_bytes == []
    assert gpt2.missing_bytes == []


def test_smol_safe_strategy_matches_the_missing_bytes(smol):
    """The strategy's exclusions are exactly the characters that would need a missing byte."""
    assert {ord(c) for c in SMOL_MISSING_CONTROLS} == {b for b in smol.missing_bytes if b < 0x80}
    assert {b for b in smol.missing_bytes if b >= 0x80} == {0xC0, 0xC1, 0xF1, 0xF2, *range(0xF5, 0x100)}


@settings(max_examples=150, deadline=None)
@given(smol_safe_text)
def test_smollm2_round_trip_on_text_avoiding_missing_bytes(smol, text):
    assert smol.decode(smol.encode(text)) == text
