"""encode_batch: padding side, attention_mask and position_ids, checked by hand and against transformers.

SmolLM2: "The capital of France" -> [504, 3575, 282, 4649], "Hi there" -> [26843, 665];
its pad token is <|im_end|> (id 2).
"""

from __future__ import annotations

import pytest
import torch

TEXTS = ["The capital of France", "Hi there"]
LONG, SHORT = [504, 3575, 282, 4649], [26843, 665]
PAD = 2


def test_the_hand_values_are_right(smol, smol_hf_raw):
    assert smol.encode(TEXTS[0]) == smol_hf_raw.encode(TEXTS[0], add_special_tokens=False).ids == LONG
    assert smol.encode(TEXTS[1]) == smol_hf_raw.encode(TEXTS[1], add_special_tokens=False).ids == SHORT
    assert smol.pad_id == PAD


def test_left_padding_by_hand(smol):
    batch = smol.encode_batch(TEXTS, padding_side="left")
    assert batch.input_ids.tolist() == [LONG, [PAD, PAD, *SHORT]]
    assert batch.attention_mask.tolist() == [[1, 1, 1, 1], [0, 0, 1, 1]]
    # positions count real tokens only: the short row's real tokens are at positions 0, 1
    assert batch.position_ids.tolist() == [[0, 1, 2, 3], [0, 0, 0, 1]]


def test_right_padding_by_hand(smol):
    batch = smol.encode_batch(TEXTS, padding_side="right")
    assert batch.input_ids.tolist() == [LONG, [*SHORT, PAD, PAD]]
    assert batch.attention_mask.tolist() == [[1, 1, 1, 1], [1, 1, 0, 0]]
    assert batch.position_ids.tolist() == [[0, 1, 2, 3], [0, 1, 0, 0]]


def test_default_padding_side_is_left(smol):
    assert smol.encode_batch(TEXTS).input_ids.tolist() == [LONG, [PAD, PAD, *SHORT]]


@pytest.mark.parametrize("side", ["left", "right"])
def test_padding_matches_transformers(smol, smol_hf, side):
    texts = ["The capital of France", "Hi", "苹果手机很好用 👋🏽 <|im_end|>", ""]
    ours = smol.encode_batch(texts, padding_side=side)
    theirs = smol_hf(texts, padding=True, padding_side=side, add_special_tokens=False)
    assert ours.input_ids.tolist() == theirs["input_ids"]
    assert ours.attention_mask.tolist() == theirs["attention_mask"]


@pytest.mark.parametrize("side", ["left", "right"])
def test_real_tokens_get_positions_zero_to_n_minus_one(smol, side):
    """In every row the masked-in slots hold that text's ids, at positions 0..n-1."""
    texts = ["a", "a much longer sentence than the others", "two words", "苹果"]
    batch = smol.encode_batch(texts, padding_side=side)
    for r, text in enumerate(texts):
        real = batch.attention_mask[r].bool()
        assert batch.input_ids[r][real].tolist() == smol.encode(text)
        assert batch.position_ids[r][real].tolist() == list(range(len(smol.encode(text))))
        assert batch.position_ids[r][~real].tolist() == [0] * int((~real).sum())


def test_batch_is_long_tensors_with_dict_access(smol):
    batch = smol.encode_batch(TEXTS)
    for key in ("input_ids", "attention_mask", "position_ids"):
        assert batch[key].dtype == torch.long
        assert batch[key].shape == (2, 4)


def test_gpt2_pads_with_endoftext_when_it_has_no_pad_token(gpt2):
    batch = gpt2.encode_batch(["Hello world", "Hi"], padding_side="right")
    assert batch.input_ids.tolist() == [[15496, 995], [17250, 50256]]


def test_bad_padding_side_is_a_value_error_naming_it(smol):
    with pytest.raises(ValueError, match=r"padding_side.*'middle'"):
        smol.encode_batch(TEXTS, padding_side="middle")


def test_a_single_str_is_a_type_error(smol):
    with pytest.raises(TypeError, match=r"list of str"):
        smol.encode_batch("The capital of France")


def test_empty_batch_is_a_value_error(smol):
    with pytest.raises(ValueError, match=r"at least one"):
        smol.encode_batch([])


def test_non_str_item_is_a_type_error(smol):
    with pytest.raises(TypeError, match=r"str"):
        smol.encode_batch(["fine", 42])
