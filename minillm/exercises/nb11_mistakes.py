"""The classic wrong answers to notebook 11's exercises, written out as a learner would write them.

Each function differs from a right answer in one place: nibbles in the wrong order, a scale
forgotten or shared by a whole row, float16 or int8 arithmetic where float32 was needed, an
offset against the wrong sum, a quantizer that rounds halves to even. ``minillm.exercises.nb11``
pairs each with the message that names it; ``tests/11_quantization/test_exercises.py`` feeds
every one to its check.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from minillm.model.quant import pack_nibbles, quantize, unpack_nibbles


def blocks_of(x: torch.Tensor) -> torch.Tensor:
    """One row of activations cut into the weights' blocks: [blocks, 32], block b = x[32b : 32b + 32]."""
    return x.reshape(-1, 32)


# --- exercise 1: unpack nibbles ----------------------------------------------------------------------


def unpack_adjacent(qs: torch.Tensor) -> torch.Tensor:
    return torch.stack([qs & 15, qs >> 4], dim=-1).reshape(*qs.shape[:-1], 32)


def unpack_swapped(qs: torch.Tensor) -> torch.Tensor:
    return torch.cat([qs >> 4, qs & 15], dim=-1)


def unpack_unmasked(qs: torch.Tensor) -> torch.Tensor:
    return torch.cat([qs, qs >> 4], dim=-1)


def unpack_signed(qs: torch.Tensor) -> torch.Tensor:
    signed = qs.view(torch.int8)
    return torch.cat([signed & 15, signed >> 4], dim=-1)


def unpack_first_axis(qs: torch.Tensor) -> torch.Tensor:
    return torch.cat([qs & 15, qs >> 4], dim=0).reshape(*qs.shape[:-1], 32)


# --- exercise 2: pack nibbles ------------------------------------------------------------------------


def pack_adjacent(q: torch.Tensor) -> torch.Tensor:
    return q[..., 0::2] | (q[..., 1::2] << 4)


def pack_swapped(q: torch.Tensor) -> torch.Tensor:
    return q[..., 16:] | (q[..., :16] << 4)


def pack_unshifted(q: torch.Tensor) -> torch.Tensor:
    return q[..., :16] | q[..., 16:]


def pack_shift_8(q: torch.Tensor) -> torch.Tensor:
    return q[..., :16] | (q[..., 16:] << 8)  # a uint8 shifted by 8 is 0: the high nibbles vanish


# --- exercise 3: the Q8_0 product --------------------------------------------------------------------


def matvec_no_scale(x: torch.Tensor, qs: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    return (qs.float() * blocks_of(x)).sum((-1, -2))


def matvec_first_scale(x: torch.Tensor, qs: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    return (qs.float() * blocks_of(x)).sum((-1, -2)) * d[:, 0].float()


def matvec_mean_scale(x: torch.Tensor, qs: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    return (qs.float() * blocks_of(x)).sum((-1, -2)) * d.float().mean(-1)


def matvec_blocks_transposed(x: torch.Tensor, qs: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    return ((qs.float() * x.reshape(32, -1).T).sum(-1) * d.float()).sum(-1)


def matvec_float16(x: torch.Tensor, qs: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    w = (qs * d[..., None]).float()  # int8 × float16 is float16: each weight rounded to 11 bits
    return (w * blocks_of(x)).sum((-1, -2))


def _quantize_x(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x as llama.cpp feeds it to its integer dot products: Q8_0 blocks (int8 codes, float32 scales)."""
    blocks = quantize(x[None], "q8_0")
    return blocks["qs"][0], blocks["d"][0].float()


def matvec_int8_overflow(x: torch.Tensor, qs: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    xq, dx = _quantize_x(x)
    products = qs * xq  # int8 × int8 stays int8 in torch: wraps past 127
    return (products.sum(-1).float() * d.float() * dx).sum(-1)


def matvec_int32(x: torch.Tensor, qs: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    xq, dx = _quantize_x(x)
    products = qs.int() * xq.int()
    return (products.sum(-1).float() * d.float() * dx).sum(-1)


# --- exercise 4: the Q4_1 product with the offset trick ---------------------------------------------


def offset_with(codes: Callable[[torch.Tensor], torch.Tensor] = unpack_nibbles, offset: str = "block",
                ) -> Callable[..., torch.Tensor]:
    """An offset product that differs from the right one in one place: how the codes are unpacked,
    or the offset ("none", "row": against the whole x, "scaled": times d too)."""

    def q4_1_offset_matvec(x: torch.Tensor, qs: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
        xb = blocks_of(x)
        y = (d.float() * (codes(qs).float() * xb).sum(-1)).sum(-1)
        if offset == "block":
            return y + (m.float() * xb.sum(-1)).sum(-1)
        if offset == "row":
            return y + (m.float() * x.sum()).sum(-1)
        if offset == "scaled":
            return y + (d.float() * m.float() * xb.sum(-1)).sum(-1)
        return y

    return q4_1_offset_matvec


# --- exercise 5: a Q4_1 quantizer --------------------------------------------------------------------


def _trunc_half_up(v: torch.Tensor) -> torch.Tensor:
    return torch.trunc(v + 0.5)  # ggml's Q4 rounding (v >= 0 here)


def q4_1_with(rounding: Callable[[torch.Tensor], torch.Tensor] = _trunc_half_up, levels: float = 15.0,
              from_stored: bool = False, pack: Callable[[torch.Tensor], torch.Tensor] = pack_nibbles,
              scale_dtype: torch.dtype = torch.float16) -> Callable[[torch.Tensor], tuple[torch.Tensor, ...]]:
    """A Q4_1 quantizer that differs from llama.cpp's in one place: the rounding, the number of
    steps, codes computed from the float16-rounded scales, the nibble order, or float32 scales."""

    def quantize_q4_1(w: torch.Tensor) -> tuple[torch.Tensor, ...]:
        blocks = w.reshape(w.shape[0], -1, 32)
        low = blocks.amin(-1, keepdim=True)
        d = (blocks.amax(-1, keepdim=True) - low) / levels
        if from_stored:
            d, low_used = d.half().float(), low.half().float()
        else:
            low_used = low
        inv = torch.where(d == 0, torch.zeros_like(d), 1 / torch.where(d == 0, torch.ones_like(d), d))
        q = rounding((blocks - low_used) * inv).clamp(0, 15).to(torch.uint8)
        return pack(q), d[..., 0].to(scale_dtype), low[..., 0].to(scale_dtype)

    return quantize_q4_1
