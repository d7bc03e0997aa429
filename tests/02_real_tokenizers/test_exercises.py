"""Notebook 02's exercises: a right answer passes, each classic wrong answer fails with its message."""

from __future__ import annotations

import pytest
import torch

from minillm.exercises import nb02
from minillm.tokenizer.bytes_unicode import bytes_to_unicode


def _token_to_bytes(token):
    keep = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    shifted = [b for b in range(256) if b not in keep]
    char_to_byte = {chr(b): b for b in keep} | {chr(256 + n): b for n, b in enumerate(shifted)}
    return bytes(char_to_byte[c] for c in token)


def _missing_single_bytes(tokens):
    present = set(tokens)
    return [b for b in range(256) if bytes_to_unicode()[b] not in present]


def _left_pad(rows, pad_id):
    width = max(len(row) for row in rows)
    ids, mask, pos = [], [], []
    for row in rows:
        p = width - len(row)
        ids.append([pad_id] * p + list(row))
        mask.append([0] * p + [1] * len(row))
        pos.append([0] * p + list(range(len(row))))
    return tuple(torch.tensor(x, dtype=torch.long) for x in (ids, mask, pos))


def _render_chatml(messages, add_generation_prompt):
    if messages and messages[0]["role"] != "system":
        messages = [{"role": "system", "content": nb02.DEFAULT_SYSTEM}, *messages]
    text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    return text + ("<|im_start|>assistant\n" if add_generation_prompt else "")


@pytest.mark.parametrize(
    "check, answer",
    [
        (nb02.check_token_to_bytes, _token_to_bytes),
        (nb02.check_missing_single_bytes, _missing_single_bytes),
        (nb02.check_left_pad, _left_pad),
        (nb02.check_render_chatml, _render_chatml),
    ],
    ids=["token_to_bytes", "missing_single_bytes", "left_pad", "render_chatml"],
)
def test_right_answers_pass(capsys, check, answer):
    assert check(answer) is True
    assert "❌" not in capsys.readouterr().out


def _left_pad_mask_from_ids(rows, pad_id):
    ids, _, pos = _left_pad(rows, pad_id)
    return ids, (ids != pad_id).long(), pos


def _left_pad_positions_with_pads(rows, pad_id):
    ids, mask, _ = _left_pad(rows, pad_id)
    return ids, mask, torch.arange(ids.shape[1]).repeat(ids.shape[0], 1)


def _right_pad(rows, pad_id):
    width = max(len(row) for row in rows)
    ids = [list(row) + [pad_id] * (width - len(row)) for row in rows]
    mask = [[1] * len(row) + [0] * (width - len(row)) for row in rows]
    pos = [list(range(len(row))) + [0] * (width - len(row)) for row in rows]
    return tuple(torch.tensor(x) for x in (ids, mask, pos))


@pytest.mark.parametrize(
    "wrong, says",
    [
        (_left_pad_mask_from_ids, "your mask is `input_ids != pad_id`"),
        (_left_pad_positions_with_pads, "your positions count the pads"),
        (_right_pad, "you padded on the right"),
        *[(m.wrong, m.message[:40]) for m in nb02.PAD_MISTAKES],
    ],
    ids=["mask-from-ids", "positions-count-pads", "right-padding", *[m.wrong.__name__ for m in nb02.PAD_MISTAKES]],
)
def test_left_pad_mistakes_are_named(capsys, wrong, says):
    assert nb02.check_left_pad(wrong) is False
    assert says in capsys.readouterr().out


def test_left_pad_says_tensors_not_lists(capsys):
    assert nb02.check_left_pad(lambda rows, pad_id: tuple(t.tolist() for t in _left_pad(rows, pad_id))) is False
    assert "expected a torch.Tensor, got a list" in capsys.readouterr().out


@pytest.mark.parametrize(
    "check, mistakes",
    [
        (nb02.check_token_to_bytes, nb02.TOKEN_MISTAKES),
        (nb02.check_missing_single_bytes, nb02.MISSING_MISTAKES),
        (nb02.check_render_chatml, nb02.CHAT_MISTAKES),
    ],
    ids=["token_to_bytes", "missing_single_bytes", "render_chatml"],
)
def test_other_mistakes_are_named(capsys, check, mistakes):
    for mistake in mistakes:
        assert check(mistake.wrong) is False
        assert mistake.message in capsys.readouterr().out
