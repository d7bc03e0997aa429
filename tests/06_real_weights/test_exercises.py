"""Notebook 06's exercises: a right answer passes, each classic wrong answer is named."""

from __future__ import annotations

import pytest
import torch

import torch.nn.functional as F

from minillm.exercises import nb06


# --- the next-token loss ---------------------------------------------------------------------------


def _nll_right(logits, ids, mask=None):
    logp = torch.log_softmax(logits, dim=-1)[:, :-1]
    nll = -logp.gather(-1, ids[:, 1:, None])[..., 0]
    keep = torch.ones_like(nll, dtype=torch.bool) if mask is None else mask[:, 1:].bool()
    return nll[keep].mean()


def test_nll_right_answer_passes(capsys):
    assert nb06.check_next_token_nll(_nll_right) is True


def test_nll_computed_in_float32_passes(capsys):
    # the reference is float64; a float32 computation is right to float32's rounding
    assert nb06.check_next_token_nll(lambda logits, ids, mask=None: _nll_right(logits.float(), ids, mask)) is True


def test_nll_solution_is_cross_entropy_on_real_shapes():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 9, 50, generator=g, dtype=torch.float64)
    ids = torch.randint(0, 50, (2, 9), generator=g)
    want = F.cross_entropy(logits[:, :-1].reshape(-1, 50), ids[:, 1:].reshape(-1))
    assert torch.allclose(nb06.next_token_nll_solution(logits, ids), want, rtol=1e-12, atol=0)


def test_nll_calling_cross_entropy_fails(capsys):
    def via_cross_entropy(logits, ids, mask=None):
        targets = ids[:, 1:] if mask is None else ids[:, 1:].masked_fill(mask[:, 1:] == 0, -100)
        return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), targets.reshape(-1))

    assert nb06.check_next_token_nll(via_cross_entropy) is False
    assert "it calls `cross_entropy`" in capsys.readouterr().out


def _nll_same_token(logits, ids, mask=None):
    return -torch.log_softmax(logits, -1).gather(-1, ids[..., None]).mean()


def _nll_bits(logits, ids, mask=None):
    return _nll_right(logits, ids, mask) / 0.6931471805599453


def _nll_with_padding(logits, ids, mask=None):
    return _nll_right(logits, ids)


def _nll_rolled(logits, ids, mask=None):
    logp = torch.log_softmax(logits, -1)
    return -logp.gather(-1, ids.roll(-1, dims=1)[..., None]).mean()


def _nll_softmax_over_seq(logits, ids, mask=None):
    logp = torch.log_softmax(logits, dim=1)[:, :-1]  # over the positions, not the vocabulary
    nll = -logp.gather(-1, ids[:, 1:, None])[..., 0]
    keep = torch.ones_like(nll, dtype=torch.bool) if mask is None else mask[:, 1:].bool()
    return nll[keep].mean()


@pytest.mark.parametrize(
    "wrong, says",
    [
        (_nll_same_token, "no shift"),
        (_nll_bits, "that is log2"),
        (_nll_with_padding, "the padded positions were counted"),
        (_nll_rolled, "the last position was scored too"),
        (_nll_softmax_over_seq, "the softmax ran over the sequence axis"),
    ],
    ids=["same-token", "log2", "padding", "last-position", "wrong-axis"],
)
def test_nll_mistakes_are_named(capsys, wrong, says):
    assert nb06.check_next_token_nll(wrong) is False
    assert says in capsys.readouterr().out


def test_nll_unfinished_stub_is_reported(capsys):
    def stub(logits, ids, mask=None):
        raise NotImplementedError

    assert nb06.check_next_token_nll(stub) is False
    assert "not attempted yet" in capsys.readouterr().out


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


def test_q4_1_solution_passes(capsys):
    assert nb06.check_dequantize_q4_1(nb06.dequantize_q4_1_solution) is True


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
    assert nb06.check_quantize_q8_0(nb06.quantize_q8_0_solution) is True


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


@pytest.mark.parametrize(
    "check, mistakes",
    [
        (nb06.check_dequantize_q4_1, nb06.Q4_1_MISTAKES),
        (nb06.check_quantize_q8_0, nb06.Q8_0_MISTAKES),
        (nb06.check_next_token_nll, nb06.NLL_MISTAKES),
    ],
    ids=["dequantize_q4_1", "quantize_q8_0", "next_token_nll"],
)
def test_every_listed_mistake_is_named_by_its_own_message(capsys, check, mistakes):
    for mistake in mistakes:
        assert check(mistake.wrong) is False
        assert mistake.message in capsys.readouterr().out, mistake.message
