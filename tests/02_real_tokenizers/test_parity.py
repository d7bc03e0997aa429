"""Exact id parity with HF for the two real vocabularies minillm reads.

SmolLM2 (minillm reading the GGUF) is compared with transformers reading the same GGUF;
GPT-2 (minillm reading encoder.json + vocab.bpe) with HF ``tokenizers`` built from the same
files. Both references are independent readings of the files, so agreement means minillm's
loader, pre-tokenizer, BPE and special-token handling are all right.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minillm.tokenizer.bytes_unicode import bytes_to_unicode

from helpers.tokenizer_cases import EDGE_TEXT, any_text, hf_ids

# Short cases, one by one, so a failure names the case.
SHORT_CASES = {
    "empty": "",
    "one space": " ",
    "space run": "     ",
    "space run then word": "     word",
    "tabs": "\t\ta\t",
    "newlines": "\n\n\n",
    "crlf": "a\r\nb\r\n",
    "spaces before newline": "a   \n   b",
    "digits": "1234567890",
    "spaced digits": " 12 345",
    "contraction": "don't",
    "uppercase contraction": "DON'T",
    "possessive run": "'s's's",
    "cjk": "苹果手机很好用",
    "family zwj": "👨‍👩‍👧‍👦",
    "rainbow flag": "🏳️‍🌈",
    "skin tone": "👋🏽",
    "combining acute": "e\u0301",
    "nul": "\x00",
    "controls": "\x00\x01\x1f\x7f",
    "nbsp": "a\u00a0b",
    "em space": "a\u2003b",
    "ideographic space": "a\u3000b",
    "zero width space": "a\u200bb",
    "im_start": "<|im_start|>",
    "im_end": "<|im_end|>",
    "endoftext": "<|endoftext|>",
    "chatml turn": "<|im_start|>user\nHi<|im_end|>\n",
    "adjacent specials": "<|endoftext|><|endoftext|>",
    "broken special": "<|im_start|",
    "broken special 2": "<|im_end",
    "special inside word": "abc<|im_end|>def",
    "spaces around special": "  <|im_start|>  ",
    "latin1": "\u00ff\u0100 caf\u00e9",
}


@pytest.fixture(params=["smollm2", "gpt2"])
def pair(request, smol, smol_hf_raw, gpt2, gpt2_hf):
    """(minillm tokenizer, HF reference) for each real vocabulary."""
    return {"smollm2": (smol, smol_hf_raw), "gpt2": (gpt2, gpt2_hf)}[request.param]


def test_smollm2_shape_matches_the_design(smol):
    """The GGUF holds a 49152-token byte-level BPE with 48900 merges and ChatML specials."""
    assert len(smol) == 49152
    assert len(smol.merges) == 48900
    assert smol.special_tokens["<|im_start|>"] == 1
    assert smol.special_tokens["<|im_end|>"] == 2


def test_whole_corpus_ids_equal_hf(pair, corpus_text):
    ours, hf = pair
    ids = ours.encode(corpus_text)
    assert ids == hf_ids(hf, corpus_text)


def test_edge_text_ids_equal_hf(pair):
    ours, hf = pair
    assert ours.encode(EDGE_TEXT) == hf_ids(hf, EDGE_TEXT)


@pytest.mark.parametrize("text", SHORT_CASES.values(), ids=SHORT_CASES.keys())
def test_short_edge_case_ids_equal_hf(pair, text):
    ours, hf = pair
    assert ours.encode(text) == hf_ids(hf, text)


def test_add_special_tokens_true_matches_hf(pair):
    """Neither SmolLM2 nor GPT-2 adds BOS/EOS: add_special_tokens=True agrees with HF's post-processor."""
    ours, hf = pair
    text = "Hello there <|im_end|>"
    assert ours.encode(text, add_special_tokens=True) == hf_ids(hf, text, add_special_tokens=True)


def test_special_token_string_is_one_id(smol, gpt2):
    assert smol.encode("<|im_start|>user")[0] == 1
    assert smol.encode("x<|im_end|>y")[1] == 2
    assert gpt2.encode("<|endoftext|>") == [50256]


def test_edge_text_decodes_back_exactly_with_gpt2(gpt2):
    """GPT-2's vocabulary has all 256 bytes, so even NUL and half-specials round-trip."""
    assert gpt2.decode(gpt2.encode(EDGE_TEXT)) == EDGE_TEXT


# --------------------------------------------------------------------------- decode parity
DECODE_CASES = {
    "plain words": [19556, 905],
    "chatml": [1, 4093, 198, 26843, 2, 198],
    "special in the middle": [19556, 0, 905, 2],
    "only specials": [1, 2, 0],
    "half an emoji": [10813],
    "emoji split by a special": [10813, 2, 116, 218],
    "single bytes": [179, 229, 134],
    "empty": [],
}


@pytest.mark.parametrize("skip", [False, True], ids=["keep-specials", "skip-specials"])
@pytest.mark.parametrize("ids", DECODE_CASES.values(), ids=DECODE_CASES.keys())
def test_smollm2_decode_equals_hf(smol, smol_hf_raw, ids, skip):
    assert smol.decode(ids, skip_special_tokens=skip) == smol_hf_raw.decode(ids, skip_special_tokens=skip)


@pytest.mark.parametrize("skip", [False, True], ids=["keep-specials", "skip-specials"])
@pytest.mark.parametrize(
    "ids",
    [[15496, 995], [50256], [15496, 50256, 995], [8582, 99, 222], [8582, 50256, 99], [8582]],
    ids=["words", "eot", "eot-inside", "crab", "crab-cut-by-eot", "half-crab"],
)
def test_gpt2_decode_equals_hf(gpt2, gpt2_hf, ids, skip):
    assert gpt2.decode(ids, skip_special_tokens=skip) == gpt2_hf.decode(ids, skip_special_tokens=skip)


def test_skip_special_tokens_removes_only_specials(smol):
    """Hand case: the ChatML wrapper disappears, the text stays."""
    ids = smol.encode("<|im_start|>user\nHi<|im_end|>\n")
    assert smol.decode(ids) == "<|im_start|>user\nHi<|im_end|>\n"
    assert smol.decode(ids, skip_special_tokens=True) == "user\nHi\n"


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_random_id_lists_decode_like_hf(pair, data):
    """Any id list (partial characters, specials anywhere) decodes exactly like HF, both skip modes."""
    ours, hf = pair
    special_ids = sorted(ours.special_tokens.values())
    one_id = st.one_of(
        st.integers(0, len(ours) - 1), st.integers(0, 400), st.sampled_from(special_ids)
    )
    ids = data.draw(st.lists(one_id, max_size=12))
    skip = data.draw(st.booleans())
    assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)


# --------------------------------------------------------------------------- property: ids == HF ids


@settings(max_examples=200, deadline=None)
@given(any_text)
def test_gpt2_ids_equal_hf_on_arbitrary_text(gpt2, gpt2_hf, text):
    assert gpt2.encode(text) == hf_ids(gpt2_hf, text)


@settings(max_examples=150, deadline=None)
@given(any_text)
def test_smollm2_ids_equal_hf_on_arbitrary_text(smol, smol_hf_raw, text):
    """Includes characters whose bytes SmolLM2 lacks: both sides must drop them identically."""
    assert smol.encode(text) == hf_ids(smol_hf_raw, text)


# --------------------------------------------------------------------------- SmolLM2's missing bytes
def test_smollm2_missing_bytes_are_exactly_the_bytes_hf_has_no_token_for(smol, smol_hf_raw):
    byte_char = bytes_to_unicode()
    hf_missing = [b for b in range(256) if smol_hf_raw.token_to_id(byte_char[b]) is None]
    assert len(smol.missing_bytes) == 21
    assert smol.missing_bytes == hf_missing


@pytest.mark.parametrize(
    "text, survivor",
    [("a\x04b", "ab"), ("\x06\x13\x14\x16\x1d", ""), ("x\x04\x00y", "x\x00y")],
    ids=["one-missing", "all-missing-controls", "missing-next-to-nul"],
)
def test_smollm2_drops_missing_bytes_like_hf(smol, smol_hf_raw, text, survivor):
    """A byte without a token is dropped (no unk token): same ids as HF, and decode shows the loss."""
    ids = smol.encode(text)
    assert ids == hf_ids(smol_hf_raw, text)
    assert smol.decode(ids) == survivor


def test_smollm2_drops_lead_byte_of_plane_4_character_like_hf(smol, smol_hf_raw):
    """U+40000 is F1 80 80 80 and 0xF1 is missing: both drop it, leaving three stray continuation bytes."""
    text = "a\U00040000b"
    ids = smol.encode(text)
    assert ids == hf_ids(smol_hf_raw, text)
    assert smol.decode(ids) == smol_hf_raw.decode(ids) == "a\ufffd\ufffd\ufffdb"
