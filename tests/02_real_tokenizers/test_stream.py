"""The streaming detokenizer: push ids one at a time, never emit half a character.

Laws: (1) for valid text, the text emitted so far is always a prefix of the text (so no U+FFFD
ever appears mid-stream); (2) for *any* id list, the pieces plus flush() equal decode(ids).
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers.tokenizer_cases import any_text, smol_safe_text

# GPT-2 splits the crab emoji (F0 9F A6 80) into three tokens.
CRAB_IDS = [8582, 99, 222]


def stream(tok, ids, skip_special_tokens=False):
    """All pieces, one per push, then the flush."""
    detok = tok.streaming_decoder(skip_special_tokens)
    return [detok.push(i) for i in ids] + [detok.flush()]


def assert_streams_prefixes(tok, text):
    ids = tok.encode(text)
    detok = tok.streaming_decoder()
    emitted = ""
    for i in ids:
        emitted += detok.push(i)
        assert text.startswith(emitted), f"after id {i} the stream shows {emitted!r}, not a prefix of the text"
    emitted += detok.flush()
    assert emitted == text == tok.decode(ids)


def test_crab_ids_by_hand(gpt2, gpt2_hf):
    assert gpt2.encode("🦀") == gpt2_hf.encode("🦀").ids == CRAB_IDS
    assert [gpt2.decode_bytes([i]) for i in CRAB_IDS] == [b"\xf0\x9f", b"\xa6", b"\x80"]


def test_emoji_split_across_tokens_waits_for_the_last_byte(gpt2):
    detok = gpt2.streaming_decoder()
    assert detok.push(CRAB_IDS[0]) == ""
    assert detok.pending_bytes == b"\xf0\x9f"
    assert detok.push(CRAB_IDS[1]) == ""
    assert detok.pending_bytes == b"\xf0\x9f\xa6"
    assert detok.push(CRAB_IDS[2]) == "🦀"
    assert detok.pending_bytes == b""
    assert detok.flush() == ""


def test_text_around_a_split_character_comes_out_as_soon_as_complete(gpt2):
    ids = gpt2.encode("a🦀b")
    pieces = stream(gpt2, ids)
    assert "".join(pieces) == "a🦀b"
    assert pieces[0] == "a"
    assert "\ufffd" not in "".join(pieces)


def test_cjk_split_into_single_bytes(smol):
    """SmolLM2 encodes 苹 (E8 8B B9) as three one-byte tokens: '', '', '苹'."""
    ids = smol.encode("苹")
    assert len(ids) == 3
    assert stream(smol, ids) == ["", "", "苹", ""]


def test_unfinished_character_at_the_end_flushes_as_replacement(gpt2, gpt2_hf):
    detok = gpt2.streaming_decoder()
    assert detok.push(CRAB_IDS[0]) == ""
    assert detok.flush() == "\ufffd" == gpt2.decode([CRAB_IDS[0]]) == gpt2_hf.decode([CRAB_IDS[0]])


def test_skip_special_tokens_in_stream(smol):
    ids = smol.encode("<|im_start|>assistant\nHi 苹<|im_end|>")
    pieces = stream(smol, ids, skip_special_tokens=True)
    assert "".join(pieces) == "assistant\nHi 苹" == smol.decode(ids, skip_special_tokens=True)
    assert "".join(stream(smol, ids)) == smol.decode(ids)


@settings(max_examples=150, deadline=None)
@given(any_text)
def test_gpt2_stream_is_always_a_prefix_of_the_text(gpt2, text):
    assert_streams_prefixes(gpt2, text)


@settings(max_examples=150, deadline=None)
@given(smol_safe_text)
def test_smollm2_stream_is_always_a_prefix_of_the_text(smol, text):
    assert_streams_prefixes(smol, text)


@pytest.fixture(params=["smollm2", "gpt2"])
def real_tok(request, smol, gpt2):
    return {"smollm2": smol, "gpt2": gpt2}[request.param]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_any_id_list_streams_to_decode(real_tok, data):
    """Even invalid UTF-8 (stray continuation bytes, specials cutting a character) streams to decode(ids)."""
    specials = sorted(real_tok.special_tokens.values())
    one_id = st.one_of(st.integers(0, len(real_tok) - 1), st.integers(0, 400), st.sampled_from(specials))
    ids = data.draw(st.lists(one_id, max_size=12))
    skip = data.draw(st.booleans())
    assert "".join(stream(real_tok, ids, skip)) == real_tok.decode(ids, skip_special_tokens=skip)


def test_pending_bytes_is_empty_between_whole_characters(smol):
    detok = smol.streaming_decoder()
    for i in smol.encode("Hello world"):
        detok.push(i)
        assert detok.pending_bytes == b""
