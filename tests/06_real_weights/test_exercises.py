"""Notebook 06's exercises: a right answer passes, each classic wrong answer is named."""

from __future__ import annotations

import pytest
import torch

from minillm.exercises import nb06


# --- dequantize Q4_1 -------------------------------------------------------------------------------


def _q4_1_right(raw):
    blocks = raw.reshape(-1, 20)
    d = blocks[:, 0:2].view(torch.float16).float()
    m = blocks[:, 2:4].view(torch.float16).float()
    packed = blocks[:, 4:]
    q = torch.cat([packed & 0x0F, packed >> 4], dim=1).float()
    return (d * q + m).reshape(raw.shape[0], -1)


def test_q4_1_right_answer_passes(capsys):
    assert nb06.check_dequantize_q4_1(_q4_1_right) is True


def test_q4_1_is_checked_bit_for_bit(capsys):
    # one float32 step off in a single weight fails: close is not enough for a dequantizer
    def one_ulp_off(raw):
        w = _q4_1_right(raw)
        w[0, 0] = torch.nextafter(w[0, 0], torch.tensor(float("inf")))
        return w

    assert nb06.check_dequantize_q4_1(one_ulp_off) is False
    assert "1 of 32 entries differ" in capsys.readouterr().out


def test_q4_1_float64_arithmetic_is_still_exact(capsys):
    # d (11 significant bits) times q (4 bits) is exact in float32, so d·q + m rounds once either way
    def in_float64(raw):
        blocks = raw.reshape(-1, 20)
        d, m = blocks[:, 0:2].view(torch.float16).double(), blocks[:, 2:4].view(torch.float16).double()
        q = torch.cat([blocks[:, 4:] & 0x0F, blocks[:, 4:] >> 4], dim=1).double()
        return (d * q + m).float().reshape(raw.shape[0], -1)

    assert nb06.check_dequantize_q4_1(in_float64) is True


def _nibbles_high_first(raw):
    blocks = raw.reshape(-1, 20)
    d, m = blocks[:, 0:2].view(torch.float16).float(), blocks[:, 2:4].view(torch.float16).float()
    q = torch.cat([blocks[:, 4:] >> 4, blocks[:, 4:] & 0x0F], dim=1).float()
    return (d * q + m).reshape(raw.shape[0], -1)


def _no_minimum(raw):
    blocks = raw.reshape(-1, 20)
    d = blocks[:, 0:2].view(torch.float16).float()
    q = torch.cat([blocks[:, 4:] & 0x0F, blocks[:, 4:] >> 4], dim=1).float()
    return (d * q).reshape(raw.shape[0], -1)


def _scales_as_integers(raw):
    blocks = raw.reshape(-1, 20)
    d, m = blocks[:, 0:2].view(torch.int16).float(), blocks[:, 2:4].view(torch.int16).float()
    q = torch.cat([blocks[:, 4:] & 0x0F, blocks[:, 4:] >> 4], dim=1).float()
    return (d * q + m).reshape(raw.shape[0], -1)


def _signed_like_q4_0(raw):
    blocks = raw.reshape(-1, 20)
    d = blocks[:, 0:2].view(torch.float16).float()
    q = torch.cat([blocks[:, 4:] & 0x0F, blocks[:, 4:] >> 4], dim=1).float()
    return (d * (q - 8)).reshape(raw.shape[0], -1)


@pytest.mark.parametrize(
    "wrong, says",
    [
        (_nibbles_high_first, "*low* nibble"),
        (_no_minimum, "the minimum m is missing"),
        (_scales_as_integers, "don't read them as integers"),
        (_signed_like_q4_0, "that is Q4_0's rule"),
    ],
    ids=["nibble-order", "no-min", "wrong-dtype", "signed-q4_0"],
)
def test_q4_1_mistakes_are_named(capsys, wrong, says):
    assert nb06.check_dequantize_q4_1(wrong) is False
    assert says in capsys.readouterr().out


# --- quantize Q8_0 ---------------------------------------------------------------------------------


def _roundf(v):
    a = v.abs()
    return torch.sign(v) * (a.floor() + (2 * (a - a.floor())).floor())


def _q8_0_right(x):
    d = x.abs().max() / 127
    inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    q = _roundf(x * inv).to(torch.int8)
    return torch.cat([d.reshape(1).half().view(torch.uint8), q.view(torch.uint8)])


def _q8_0_rounding(rounding):
    def quantize(x):
        d = x.abs().max() / 127
        inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
        return torch.cat([d.reshape(1).half().view(torch.uint8), rounding(x * inv).to(torch.int8).view(torch.uint8)])

    return quantize


def test_q8_0_right_answer_passes(capsys):
    assert nb06.check_quantize_q8_0(_q8_0_right) is True


@pytest.mark.parametrize(
    "wrong, says",
    [
        (_q8_0_rounding(torch.round), "rounds halves to *even*"),
        (_q8_0_rounding(lambda v: v.sign() * (v.abs() + 0.5).floor()), "0.49999997 + 0.5 is exactly 1.0"),
    ],
    ids=["half-to-even", "floor-plus-half"],
)
def test_q8_0_mistakes_are_named(capsys, wrong, says):
    assert nb06.check_quantize_q8_0(wrong) is False
    assert says in capsys.readouterr().out


def test_the_tie_cases_are_real_ties():
    # the cases the rounding mistakes rest on: x·(1/d) is exactly k + 1/2, and exactly the float below 1/2
    x = torch.from_numpy(nb06.TIES)
    v = x * (1 / (x.abs().max() / 127))
    assert (v[1:10] - v[1:10].trunc()).abs().eq(0.5).all()
    assert float(nb06.BELOW_HALF[1]) == 0.5 - 2**-25


# --- un-permute ------------------------------------------------------------------------------------


def _unpermute_right(w, n_heads):
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def test_unpermute_right_answer_passes(capsys):
    assert nb06.check_unpermute_rows(_unpermute_right) is True


def test_unpermute_inverts_the_converter():
    w = torch.arange(48).reshape(24, 2)
    assert torch.equal(_unpermute_right(nb06.permute(w, 3), 3), w)


@pytest.mark.parametrize(
    "check, mistakes",
    [
        (nb06.check_dequantize_q4_1, nb06.Q4_1_MISTAKES),
        (nb06.check_quantize_q8_0, nb06.Q8_0_MISTAKES),
        (nb06.check_unpermute_rows, nb06.UNPERMUTE_MISTAKES),
    ],
    ids=["dequantize_q4_1", "quantize_q8_0", "unpermute_rows"],
)
def test_every_listed_mistake_is_named_by_its_own_message(capsys, check, mistakes):
    for mistake in mistakes:
        assert check(mistake.wrong) is False
        assert mistake.message in capsys.readouterr().out, mistake.message
