"""Notebook 11's exercises: a right answer passes, each classic wrong answer is named."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from minillm.exercises import nb11
from minillm.model import kernels
from minillm.model.quant import QuantizedLinear, dequantize, quantize, to_gguf_blocks

# --- the right answers, written as a learner would ---------------------------------------------------


def _unpack_right(qs):
    return torch.cat([qs & 15, qs >> 4], dim=-1)


def _unpack_by_hand(qs):
    # the same, spelled differently: a 0x0F mask and a floor division
    return torch.cat([qs & 0x0F, qs // 16], dim=-1)


def _pack_right(q):
    return q[..., :16] | (q[..., 16:] << 4)


def _pack_by_arithmetic(q):
    # the nibbles never overlap, so + is the same as |
    return q[..., :16] + q[..., 16:] * 16


def _matvec_right(x, qs, d):
    return (qs.float() * x.reshape(-1, 32)).sum(-1).mul(d.float()).sum(-1)


def _matvec_scale_x_first(x, qs, d):
    # the package's order: scale x per block, then one reduction over (blocks, 32)
    return (qs.float() * (d.float()[..., None] * x.reshape(-1, 32))).sum((-1, -2))


def _matvec_dequantize_then_matmul(x, qs, d):
    # allowed: the matrix is built from the blocks by hand, then multiplied (not F.linear)
    return (qs.float() * d.float()[..., None]).reshape(qs.shape[0], -1) @ x


def _offset_right(x, qs, d, m):
    xb = x.reshape(-1, 32)
    q = torch.cat([qs & 15, qs >> 4], dim=-1).float()
    return (d.float() * (q * xb).sum(-1) + m.float() * xb.sum(-1)).sum(-1)


def _offset_by_einsum(x, qs, d, m):
    # the same sums, spelled with einsum and the block sums of x named once
    xb = x.reshape(-1, 32)
    q = torch.cat([qs & 15, qs >> 4], dim=-1).float()
    return torch.einsum("ob,obj,bj->o", d.float(), q, xb) + m.float() @ xb.sum(-1)


def _quantize_q4_1_right(w):
    blocks = w.reshape(w.shape[0], -1, 32)
    low = blocks.amin(-1, keepdim=True)
    d = (blocks.amax(-1, keepdim=True) - low) / 15
    inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    q = torch.trunc((blocks - low) * inv + 0.5).clamp(0, 15).to(torch.uint8)
    return _pack_right(q), d[..., 0].half(), low[..., 0].half()


@pytest.mark.parametrize(
    "check, right",
    [
        (nb11.check_unpack_nibbles, _unpack_right),
        (nb11.check_unpack_nibbles, _unpack_by_hand),
        (nb11.check_pack_nibbles, _pack_right),
        (nb11.check_pack_nibbles, _pack_by_arithmetic),
        (nb11.check_q8_0_matvec, _matvec_right),
        (nb11.check_q8_0_matvec, _matvec_scale_x_first),
        (nb11.check_q8_0_matvec, _matvec_dequantize_then_matmul),
        (nb11.check_q4_1_offset_matvec, _offset_right),
        (nb11.check_q4_1_offset_matvec, _offset_by_einsum),
        (nb11.check_quantize_q4_1, _quantize_q4_1_right),
    ],
    ids=["unpack", "unpack-floordiv", "pack", "pack-plus", "matvec", "matvec-scale-x", "matvec-matmul", "offset",
         "offset-einsum", "q4_1"],
)
def test_right_answers_pass(capsys, check, right):
    assert check(right) is True
    assert "✅" in capsys.readouterr().out


@pytest.mark.parametrize(
    "check",
    [nb11.check_unpack_nibbles, nb11.check_pack_nibbles, nb11.check_q8_0_matvec, nb11.check_q4_1_offset_matvec,
     nb11.check_quantize_q4_1],
)
def test_an_untouched_stub_says_not_attempted(capsys, check):
    def stub(*args):
        raise NotImplementedError

    assert check(stub) is False
    assert "⏳" in capsys.readouterr().out


# --- the mistakes, written as a learner would ---------------------------------------------------------


def _unpack_interleaved(qs):
    return torch.stack([qs & 15, qs >> 4], dim=-1).flatten(-2)


def _unpack_no_mask(qs):
    return torch.cat([qs, qs >> 4], dim=-1)


def _unpack_high_first(qs):
    return torch.cat([qs >> 4, qs & 15], dim=-1)


def _unpack_as_int8(qs):
    b = qs.to(torch.int8)
    return torch.cat([b & 15, b >> 4], dim=-1)


@pytest.mark.parametrize(
    "wrong, says",
    [
        (_unpack_interleaved, "adjacent pairs"),
        (_unpack_no_mask, "the mask is missing"),
        (_unpack_high_first, "swapped"),
        (_unpack_as_int8, "read as int8"),
    ],
    ids=["adjacent", "no-mask", "swapped", "signed"],
)
def test_unpack_mistakes_are_named(capsys, wrong, says):
    assert nb11.check_unpack_nibbles(wrong) is False
    assert says in capsys.readouterr().out


def _pack_pairs(q):
    pairs = q.reshape(*q.shape[:-1], 16, 2)
    return pairs[..., 0] | (pairs[..., 1] << 4)


def _pack_high_first(q):
    return (q[..., :16] << 4) | q[..., 16:]


@pytest.mark.parametrize(
    "wrong, says",
    [(_pack_pairs, "adjacent pairs"), (_pack_high_first, "swapped")],
    ids=["adjacent", "swapped"],
)
def test_pack_mistakes_are_named(capsys, wrong, says):
    assert nb11.check_pack_nibbles(wrong) is False
    assert says in capsys.readouterr().out


def _matvec_without_scale(x, qs, d):
    return qs.float().reshape(qs.shape[0], -1) @ x


def _matvec_row_scale(x, qs, d):
    return (qs.float().reshape(qs.shape[0], -1) @ x) * d[:, 0].float()


def _matvec_half_weights(x, qs, d):
    return ((qs * d[..., None]).float().reshape(qs.shape[0], -1) * x).sum(-1)


def _matvec_integer_dot(x, qs, d):
    # llama.cpp's scheme with int8 products: x quantized per block to int8, multiplied in int8
    xb = x.reshape(-1, 32)
    dx = xb.abs().amax(-1) / 127
    xq = torch.round(xb / dx[:, None]).to(torch.int8)
    return ((qs * xq).sum(-1).float() * d.float() * dx).sum(-1)


def test_int8_products_fail_and_the_listed_overflow_really_wraps(capsys):
    # a learner's own int8 scheme rounds x differently from the listed one, so it is not named, but it fails
    assert nb11.check_q8_0_matvec(_matvec_integer_dot) is False
    capsys.readouterr()
    a = torch.tensor([100], dtype=torch.int8)
    assert (a * a).dtype == torch.int8 and int((a * a)[0]) == 16  # 10000 mod 256, as the message says


def test_matvec_through_f_linear_breaks_the_rule(capsys):
    def through_linear(x, qs, d):
        return F.linear(x, dequantize("q8_0", qs, d))

    assert nb11.check_q8_0_matvec(through_linear) is False
    out = capsys.readouterr().out
    assert "the values are right, but it calls `linear`" in out


def _offset_forgotten(x, qs, d, m):
    q = torch.cat([qs & 15, qs >> 4], dim=-1).float()
    return (d.float() * (q * x.reshape(-1, 32)).sum(-1)).sum(-1)


def _offset_whole_row(x, qs, d, m):
    q = torch.cat([qs & 15, qs >> 4], dim=-1).float()
    return (d.float() * (q * x.reshape(-1, 32)).sum(-1)).sum(-1) + m.float().sum(-1) * x.sum()


def _offset_high_first(x, qs, d, m):
    xb = x.reshape(-1, 32)
    q = torch.cat([qs >> 4, qs & 15], dim=-1).float()
    return (d.float() * (q * xb).sum(-1) + m.float() * xb.sum(-1)).sum(-1)


@pytest.mark.parametrize(
    "check, wrong, says",
    [
        (nb11.check_q8_0_matvec, _matvec_without_scale, "the scales are missing"),
        (nb11.check_q8_0_matvec, _matvec_row_scale, "one scale per row"),
        (nb11.check_q8_0_matvec, _matvec_half_weights, "rounded to float16"),
        (nb11.check_q4_1_offset_matvec, _offset_forgotten, "the offset is missing"),
        (nb11.check_q4_1_offset_matvec, _offset_whole_row, "the sum of the whole x"),
        (nb11.check_q4_1_offset_matvec, _offset_high_first, "swapped"),
    ],
    ids=["q8_0-no-scale", "q8_0-row-scale", "q8_0-float16", "offset-none", "offset-whole-row", "offset-swapped"],
)
def test_product_mistakes_are_named(capsys, check, wrong, says):
    assert check(wrong) is False
    assert says in capsys.readouterr().out


def _offset_through_weights(x, qs, d, m):
    # right values, but through the dequantized matrix: one d·q + m per weight
    q = torch.cat([qs & 15, qs >> 4], dim=-1).float()
    w = d.float()[..., None] * q + m.float()[..., None]
    return (w * x.reshape(-1, 32)).sum((-1, -2))


def _offset_through_package(x, qs, d, m):
    return dequantize("q4_1", qs, d, m) @ x


def _offset_through_linear(x, qs, d, m):
    return F.linear(x, dequantize("q4_1", qs, d, m))


@pytest.mark.parametrize(
    "through, says",
    [
        (_offset_through_weights, "builds the dequantized weights"),
        (_offset_through_package, "builds the dequantized weights"),
        (_offset_through_linear, "it calls `linear`"),
    ],
    ids=["by-hand", "dequantize", "f-linear"],
)
def test_offset_through_a_weight_matrix_breaks_the_rules(capsys, through, says):
    assert nb11.check_q4_1_offset_matvec(through) is False
    out = capsys.readouterr().out
    assert "the values are right, but" in out and says in out


def test_offset_through_the_package_kernel_breaks_the_rule(capsys):
    if not kernels.available():
        pytest.skip(f"the packed-weight kernels are not built here: {kernels.why_unavailable()}")

    def through_kernel(x, qs, d, m):
        return QuantizedLinear("q4_1", qs, d, m)(x[None])[0]

    def through_raw_kernel(x, qs, d, m):
        return kernels.linear("q4_1", x[None], qs, d, m)[0]

    def through_group_kernel(x, qs, d, m):
        layer = QuantizedLinear("q4_1", qs, d, m)
        return QuantizedLinear.many(x[None], [layer, layer])[0][0]  # (a group: the op for several matrices)

    for attempt, op in ((through_kernel, "q4_linear"), (through_raw_kernel, "q4_linear"),
                        (through_group_kernel, "packed_linears")):
        assert nb11.check_q4_1_offset_matvec(attempt) is False
        assert f"it calls `{op}`" in capsys.readouterr().out


# The three tests that read ``nb11._*_cases()`` check the checkers' expected answers themselves:
# the cases are the module's private builders, and the checkers (their only public use) say pass or
# fail, not whether what they expect is right.
def test_the_offset_expected_answers_are_the_float64_product_and_the_kernel_meets_them():
    # the expected values are the exact product, rounded once; the package's kernel is within the check's tolerance
    for (x, qs, d, m), want in nb11._offset_cases():
        exact = dequantize("q4_1", qs, d, m, torch.float64) @ x.double()
        assert torch.equal(want, exact.float())
        assert want.abs().max() < 10  # the tolerance is set for outputs of a few units
        if kernels.available():
            got = kernels.linear("q4_1", x[None].contiguous(), qs, d, m)[0]
            assert (got.double() - exact).abs().max() <= nb11.OFFSET_ATOL


def _q4_1_torch_round(w):
    blocks = w.reshape(w.shape[0], -1, 32)
    low = blocks.amin(-1, keepdim=True)
    d = (blocks.amax(-1, keepdim=True) - low) / 15
    inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    q = torch.round((blocks - low) * inv).clamp(0, 15).to(torch.uint8)
    return _pack_right(q), d[..., 0].half(), low[..., 0].half()


def test_q4_1_half_to_even_is_named(capsys):
    assert nb11.check_quantize_q4_1(_q4_1_torch_round) is False
    assert "rounds halves to *even*" in capsys.readouterr().out


def test_the_q4_1_tie_case_is_made_of_real_ties():
    w = nb11.Q4_1_TIES
    d = (w.max() - w.min()) / 15
    assert d.item() == 2.0**-4
    v = (w - w.min()) * (1 / d)
    halves = (v - v.trunc()) == 0.5
    assert int(halves.sum()) == 10
    assert not torch.equal(torch.round(v[halves]), torch.trunc(v[halves] + 0.5))


def test_the_expected_q4_1_bytes_are_gguf_bytes():
    # the check's expected answers come from the package; the package writes llama.cpp's bytes
    for (w,), (qs, d, m) in nb11._q4_1_cases():
        ours = to_gguf_blocks("q4_1", qs, d, m)
        theirs = gguf.quants.quantize(w.numpy(), gguf.GGMLQuantizationType.Q4_1)
        assert np.array_equal(ours, theirs)


def test_pack_and_unpack_expected_answers_are_inverses():
    for (q,), packed in nb11._pack_cases():
        assert torch.equal(_unpack_right(packed), q)
    for (qs,), values in nb11._unpack_cases():
        assert torch.equal(_pack_right(values), qs)


@pytest.mark.parametrize(
    "check, mistakes",
    [
        (nb11.check_unpack_nibbles, nb11.UNPACK_MISTAKES),
        (nb11.check_pack_nibbles, nb11.PACK_MISTAKES),
        (nb11.check_q8_0_matvec, nb11.MATVEC_MISTAKES),
        (nb11.check_q4_1_offset_matvec, nb11.OFFSET_MISTAKES),
        (nb11.check_quantize_q4_1, nb11.Q4_1_MISTAKES),
    ],
    ids=["unpack_nibbles", "pack_nibbles", "q8_0_matvec", "q4_1_offset_matvec", "quantize_q4_1"],
)
def test_every_listed_mistake_is_named_by_its_own_message(capsys, check, mistakes):
    for mistake in mistakes:
        assert check(mistake.wrong) is False
        assert mistake.message in capsys.readouterr().out, mistake.message


def test_hints_come_in_three_tiers(capsys):
    nb11.check_q8_0_matvec(_matvec_without_scale, hint=3)
    out = capsys.readouterr().out
    assert "Hint 1/3" in out and "Hint 3/3" in out

