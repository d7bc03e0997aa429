"""Exercises of notebook 11 (quantization): unpack and pack 4-bit nibbles in ggml's order, a Q8_0
matrix-vector product computed straight from the blocks, the Q4_1 product with the offset trick
(d·Σq·x + m·Σx per block, as the package's kernel computes it), and (optional) a Q4_1 quantizer
that writes llama.cpp's bytes.

The expected answers come from the package (``minillm.model.quant``: its quantizers are bit-exact
with ``gguf.quants``, itself bit-exact with llama.cpp) and, for the product, from
``F.linear(x, dequantize(...))``. Each classic mistake is written out as the function a learner
would write (``nb11_mistakes``), so a wrong answer of that kind is named.

The reference solutions are ``*_solution`` functions here, one per exercise: the notebook never
shows them in a cell that could overwrite the learner's function. Read one with
``print(inspect.getsource(nb11.unpack_nibbles_solution))``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from minillm.exercises import Mistake, check, forbid_calls, forbid_copies
from minillm.exercises.nb11_mistakes import (
    matvec_blocks_transposed,
    matvec_first_scale,
    matvec_float16,
    matvec_int8_overflow,
    matvec_int32,
    matvec_mean_scale,
    matvec_no_scale,
    offset_with,
    pack_adjacent,
    pack_shift_8,
    pack_swapped,
    pack_unshifted,
    q4_1_with,
    unpack_adjacent,
    unpack_first_axis,
    unpack_signed,
    unpack_swapped,
    unpack_unmasked,
)
from minillm.model.quant import dequantize, pack_nibbles, quantize, unpack_nibbles

# --- exercise 1 (the core): unpack nibbles ---------------------------------------------------------


def _unpack_cases() -> list[tuple[tuple[torch.Tensor], torch.Tensor]]:
    """Packed bytes [..., 16] -> the 32 values of each block, in the weights' order."""
    g = torch.Generator().manual_seed(11)
    every_byte = torch.arange(256, dtype=torch.uint8).reshape(16, 16)  # each of the 256 bytes once
    real = quantize(torch.randn(4, 96, generator=g), "q4_1")["qs"]  # [4, 3, 16]: blocks as the package keeps them
    inputs = [torch.tensor([0x21, 0xF0, 0x0F, 0x8A] + [0x00] * 12, dtype=torch.uint8), every_byte, real,
              torch.randint(0, 256, (2, 3, 5, 16), generator=g, dtype=torch.uint8)]
    return [((qs,), unpack_nibbles(qs)) for qs in inputs]


UNPACK_MISTAKES = [
    Mistake(unpack_adjacent, "you unpacked adjacent pairs (byte j -> weights 2j, 2j+1): in ggml, byte j holds "
                              "weight j in its low nibble and weight j + 16 in its high nibble, so the 16 low "
                              "nibbles come first, then the 16 high ones."),
    Mistake(unpack_swapped, "high and low nibbles are swapped: the *low* nibble (byte & 15) is weight j, the high "
                             "nibble (byte >> 4) is weight j + 16."),
    Mistake(unpack_unmasked, "the mask is missing: `byte` alone keeps the high nibble too (0x8A is 138, not 10); the "
                              "low nibble is `byte & 15`."),
    Mistake(unpack_signed, "the bytes were read as int8: shifting a signed byte right copies its sign bit (0xF0 >> 4 "
                            "is -1, not 15). Shift the uint8 bytes as they are."),
    Mistake(unpack_first_axis, "the low and high nibbles were concatenated along the first axis: each block's 16 "
                                "bytes are the *last* axis, so concatenate with dim=-1."),
]

UNPACK_HINTS = [
    "A byte holds two 4-bit values: the low nibble is `byte & 15` (0x0F), the high nibble `byte >> 4`.",
    "ggml's order: byte j = weight j (low nibble) + weight j + 16 (high nibble). So all 16 low nibbles are weights "
    "0..15 and all 16 high nibbles are weights 16..31.",
    "return torch.cat([qs & 15, qs >> 4], dim=-1)",
]


def check_unpack_nibbles(fn: Callable[[torch.Tensor], torch.Tensor], hint: int = 0) -> bool:
    """``fn(qs uint8 [..., 16])`` -> uint8 ``[..., 32]``: the values 0..15 of each block, weights 0..31 in order."""
    return check("unpack_nibbles", fn, _unpack_cases(), hint=hint, hints=UNPACK_HINTS, mistakes=UNPACK_MISTAKES)


# --- exercise 2: pack nibbles ----------------------------------------------------------------------


def _pack_cases() -> list[tuple[tuple[torch.Tensor], torch.Tensor]]:
    g = torch.Generator().manual_seed(12)
    ramp = torch.cat([torch.arange(16), torch.arange(15, -1, -1)]).to(torch.uint8)  # every value once per half
    inputs = [ramp, torch.randint(0, 16, (3, 32), generator=g, dtype=torch.uint8),
              unpack_nibbles(quantize(torch.randn(4, 64, generator=g), "q4_0")["qs"]),  # [4, 2, 32]
              torch.randint(0, 16, (2, 3, 4, 32), generator=g, dtype=torch.uint8)]
    return [((q,), pack_nibbles(q)) for q in inputs]


PACK_MISTAKES = [
    Mistake(pack_adjacent, "you packed adjacent pairs (weights 2j, 2j+1 into byte j): in ggml, byte j holds weight j "
                            "(low nibble) and weight j + 16 (high nibble)."),
    Mistake(pack_swapped, "high and low nibbles are swapped: weight j goes in the *low* nibble, weight j + 16 in the "
                           "high nibble (shifted left by 4)."),
    Mistake(pack_unshifted, "weight j + 16 was OR-ed in without a shift, on top of weight j: move it into the high "
                             "nibble with `<< 4`."),
    Mistake(pack_shift_8, "the high nibbles are gone: a nibble is 4 bits, so shift by 4; a uint8 shifted left by 8 "
                           "is 0."),
]

PACK_HINTS = [
    "The inverse of unpack_nibbles: 32 values in [0, 15] become 16 bytes.",
    "Byte j = weight j in the low 4 bits + weight j + 16 in the high 4 bits: `low | (high << 4)`.",
    "return q[..., :16] | (q[..., 16:] << 4)",
]


def check_pack_nibbles(fn: Callable[[torch.Tensor], torch.Tensor], hint: int = 0) -> bool:
    """``fn(q uint8 [..., 32] of values 0..15)`` -> uint8 ``[..., 16]``, in ggml's nibble order."""
    return check("pack_nibbles", fn, _pack_cases(), hint=hint, hints=PACK_HINTS, mistakes=PACK_MISTAKES)


# --- exercise 3: a Q8_0 matrix-vector product from the blocks --------------------------------------

MATVEC_ATOL = 1e-4  # |y| < 10 in every case: float32 sums are ~1e-6 off, float16 products ~1e-3


def _matvec_cases() -> list[tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]]:
    """(x [in], qs int8 [out, blocks, 32], d float16 [out, blocks]) -> F.linear(x, dequantize(...))."""
    g = torch.Generator().manual_seed(13)
    cases = []
    # one block per row; a few blocks; SmolLM2's k_proj shape [192, 576], its rows' scales 10x apart
    for out, n_in, top in [(4, 32, 0.05), (8, 128, 0.05), (192, 576, 0.1)]:
        row_scale = torch.logspace(-1, 0, out)[:, None] * top if out > 8 else top
        blocks = quantize(torch.randn(out, n_in, generator=g) * row_scale, "q8_0")
        x = torch.randn(n_in, generator=g)
        cases.append(((x, blocks["qs"], blocks["d"]), F.linear(x, dequantize("q8_0", blocks["qs"], blocks["d"]))))
    return cases


MATVEC_MISTAKES = [
    Mistake(matvec_no_scale, "the scales are missing: the weights are d · q, so each block's sum Σ q·x must be "
                              "multiplied by that block's d."),
    Mistake(matvec_first_scale, "one scale per row: every block of 32 weights has its *own* d (d is [out, blocks]); "
                                 "multiply each block's Σ q·x by its d, then add up the blocks."),
    Mistake(matvec_mean_scale, "one scale per row: every block of 32 weights has its *own* d (d is [out, blocks]); "
                                "multiply each block's Σ q·x by its d, then add up the blocks."),
    Mistake(matvec_blocks_transposed, "x was cut into blocks the wrong way: block b holds x[32b : 32b + 32], i.e. "
                                       "x.reshape(-1, 32), not x.reshape(32, -1).T."),
    Mistake(matvec_float16, "the products were rounded to float16: in torch, int8 × float16 is float16 (11 "
                             "significant bits). Convert first: qs.float() * d.float()."),
    Mistake(matvec_int8_overflow, "the int8 × int8 products overflowed: torch keeps int8 × int8 in int8, which wraps "
                                   "past 127 (100 · 100 = 10000 becomes 16). llama.cpp widens to int32; and here x "
                                   "should stay float: multiply the int8 weights by the float32 x."),
    Mistake(matvec_int32, "you quantized x to 8 bits too, as llama.cpp does for its integer dot products: that "
                           "product is off by x's rounding error, more than this check allows. Multiply the int8 "
                           "weights by the float32 x."),
]

MATVEC_HINTS = [
    "y[o] = Σ over blocks b of d[o, b] · Σ over j of qs[o, b, j] · x[32b + j]: per block, an integer-weighted sum, "
    "then one multiply by the block's scale.",
    "x.reshape(-1, 32) is [blocks, 32] and broadcasts against qs [out, blocks, 32]; do the arithmetic in float32 "
    "(qs.float(), d.float()).",
    "return (qs.float() * x.reshape(-1, 32)).sum(-1).mul(d.float()).sum(-1)",
]

NO_LINEAR = forbid_calls({"linear": "F.linear on the dequantized matrix is the reference you are checked against; "
                                    "write the product from the blocks (each block: d · Σ q·x)."})


def check_q8_0_matvec(fn: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor], hint: int = 0) -> bool:
    """``fn(x float32 [in], qs int8 [out, blocks, 32], d float16 [out, blocks])`` -> float32 ``[out]``, equal to
    ``F.linear(x, dequantize("q8_0", qs, d))`` within float32 rounding (``MATVEC_ATOL``)."""
    return check("q8_0_matvec", fn, _matvec_cases(), hint=hint, hints=MATVEC_HINTS, mistakes=MATVEC_MISTAKES,
                 rules=[NO_LINEAR], atol=MATVEC_ATOL)


# --- exercise 4: the Q4_1 product with the offset trick ---------------------------------------------

OFFSET_ATOL = 1e-4  # |y| < 10 in every case: float32 sums are ~1e-6 off


def _offset_cases() -> list[tuple[tuple[torch.Tensor, ...], torch.Tensor]]:
    """(x [in], qs uint8 [out, blocks, 16], d, m float16 [out, blocks]) -> the float64 product on the dequantized
    weights, rounded once to float32 (the exact answer, as near as float32 can hold it)."""
    g = torch.Generator().manual_seed(15)
    cases = []
    # one block; a few blocks, lifted off zero so every minimum m is far from 0; SmolLM2's up_proj rows [64, 576]
    for out, n_in, shift in [(20, 32, 0.0), (8, 128, 0.3), (64, 576, 0.0)]:
        blocks = quantize(torch.randn(out, n_in, generator=g) * 0.05 + shift, "q4_1")
        x = torch.randn(n_in, generator=g)
        exact = dequantize("q4_1", blocks["qs"], blocks["d"], blocks["m"], torch.float64) @ x.double()
        cases.append(((x, blocks["qs"], blocks["d"], blocks["m"]), exact.float()))
    return cases


OFFSET_MISTAKES = [
    Mistake(offset_with(offset="none"), "the offset is missing: w = d·q + m, so each block adds m_b · Σ_j x_j to "
                                         "d_b · Σ_j q_j x_j."),
    Mistake(offset_with(offset="row"), "each minimum met the sum of the whole x: m_b belongs to the 32 weights of "
                                        "block b only, so it multiplies Σ x over that block, x.reshape(-1, 32).sum(-1)."),
    Mistake(offset_with(offset="scaled"), "the offset was multiplied by d too: in w = d·q + m the minimum m stands "
                                           "alone, so the offset is m_b · Σ_j x_j, not d_b · m_b · Σ_j x_j."),
    Mistake(offset_with(codes=unpack_swapped), "high and low nibbles are swapped: the *low* nibble (byte & 15) is "
                                                 "weight j, the high nibble (byte >> 4) weight j + 16."),
    Mistake(offset_with(codes=unpack_adjacent), "you unpacked adjacent pairs (byte j -> weights 2j, 2j+1): byte j "
                                                  "holds weight j (low nibble) and weight j + 16 (high nibble)."),
]

OFFSET_HINTS = [
    "Inside block b, Σ_j x_j (d_b q_j + m_b) = d_b · Σ_j q_j x_j + m_b · Σ_j x_j: the second sum is the same for "
    "every output row.",
    "xb = x.reshape(-1, 32); q = torch.cat([qs & 15, qs >> 4], dim=-1).float() (weights 0..15, then 16..31); both "
    "sums are over the last axis, then add up the blocks.",
    "return (d.float() * (q * xb).sum(-1) + m.float() * xb.sum(-1)).sum(-1)",
]

NO_WEIGHTS = forbid_copies({3: "m"}, "that builds the dequantized weights d·q + m, one per weight. Keep m per block: "
                                     "add m_b · Σ_j x_j once per block (the offset).")
NO_PACKAGE_PRODUCT = forbid_calls({"linear": "F.linear on a dequantized matrix is the reference you are checked "
                                             "against; write the product from the blocks.",
                                   "q4_linear": "that is the package's kernel, the very thing you are writing; "
                                                "write the product from the blocks.",
                                   "packed_linears": "that is the package's kernel for a group of matrices "
                                                     "(what QuantizedLinear.many calls), "
                                                     "the very thing you are writing; write the product from the "
                                                     "blocks."})


def check_q4_1_offset_matvec(fn: Callable[..., torch.Tensor], hint: int = 0) -> bool:
    """``fn(x float32 [in], qs uint8 [out, blocks, 16], d float16 [out, blocks], m float16 [out, blocks])`` ->
    float32 ``[out]``, the Q4_1 product within float32 rounding (``OFFSET_ATOL``) of the float64 one, computed as
    d·Σq·x + m·Σx per block: no dequantized weight matrix, no ``F.linear``, not the package's kernel."""
    return check("q4_1_offset_matvec", fn, _offset_cases(), hint=hint, hints=OFFSET_HINTS, mistakes=OFFSET_MISTAKES,
                 rules=[NO_PACKAGE_PRODUCT, NO_WEIGHTS], atol=OFFSET_ATOL)


# --- exercise 5 (optional): quantize to Q4_1, as llama.cpp does -------------------------------------

# min 0, max 15·2⁻⁴: d = 2⁻⁴ exactly, so (x − min)·(1/d) = 16·x lands exactly on k + ½ for these weights
Q4_1_TIES = torch.tensor([0.0, 15.0, 0.5, 2.5, 4.5, 6.5, 1.5, 3.5, 8.5, 10.5, 12.5, 14.5] + [7.0] * 20) / 16


def _q4_1_cases() -> list[tuple[tuple[torch.Tensor], tuple[torch.Tensor, ...]]]:
    g = torch.Generator().manual_seed(14)
    inputs = [Q4_1_TIES[None].clone(),
              torch.randn(3, 64, generator=g) * 0.05 + 0.01,
              torch.cat([torch.full((1, 32), 0.25), torch.randn(1, 32, generator=g)], dim=1),  # a constant block: d = 0
              torch.randn(8, 576, generator=g) * 0.03]
    cases = []
    for w in inputs:
        b = quantize(w, "q4_1")
        cases.append(((w,), (b["qs"], b["d"], b["m"])))
    return cases


Q4_1_MISTAKES = [
    Mistake(q4_1_with(rounding=torch.round), "torch.round rounds halves to *even* (2.5 -> 2): ggml rounds Q4 codes "
                                              "with trunc(v + 0.5), which sends every half up (2.5 -> 3)."),
    Mistake(q4_1_with(levels=16.0), "d = (max − min) / 15: 4 bits give 16 levels, 0..15, so 15 steps between the "
                                     "minimum and the maximum."),
    Mistake(q4_1_with(from_stored=True), "the codes were computed with the float16-rounded d and m: llama.cpp "
                                          "computes them with the float32 d and min, and only *stores* d and m as "
                                          "float16."),
    Mistake(q4_1_with(pack=pack_adjacent), "the nibbles are packed as adjacent pairs: byte j holds code j (low "
                                             "nibble) and code j + 16 (high nibble)."),
    Mistake(q4_1_with(scale_dtype=torch.float32), "d and m are stored as float16 (2 bytes each: 20 bytes per block), "
                                                   "not float32."),
]

Q4_1_HINTS = [
    "Per block of 32: m = min, d = (max − min) / 15 in float32; code = trunc((x − m) · (1/d) + 0.5), clamped to "
    "0..15; a block with d = 0 gets codes 0 (use 1/d = 0 there).",
    "blocks = w.reshape(rows, -1, 32); low = blocks.amin(-1, keepdim=True); d = (blocks.amax(-1, keepdim=True) - low) "
    "/ 15; pack the codes with your pack_nibbles.",
    "inv = torch.where(d == 0, 0, 1 / d); q = torch.trunc((blocks - low) * inv + 0.5).clamp(0, 15).to(torch.uint8); "
    "return pack_nibbles(q), d[..., 0].half(), low[..., 0].half()",
]


def check_quantize_q4_1(fn: Callable[[torch.Tensor], tuple[torch.Tensor, ...]], hint: int = 0) -> bool:
    """``fn(w float32 [rows, 32·k])`` -> ``(qs uint8 [rows, k, 16], d float16 [rows, k], m float16 [rows, k])``,
    the bytes llama.cpp writes (the package's ``quantize(w, "q4_1")``, bit-exact with ``gguf.quants``)."""
    return check("quantize_q4_1", fn, _q4_1_cases(), hint=hint, hints=Q4_1_HINTS, mistakes=Q4_1_MISTAKES, atol=0.0)


# --- the reference solutions -------------------------------------------------------------------------


def unpack_nibbles_solution(qs: torch.Tensor) -> torch.Tensor:
    # low nibbles are weights 0..15, high nibbles weights 16..31
    return torch.cat([qs & 15, qs >> 4], dim=-1)


def pack_nibbles_solution(q: torch.Tensor) -> torch.Tensor:
    # weight j in the low nibble, weight j + 16 in the high nibble
    return q[..., :16] | (q[..., 16:] << 4)


def q8_0_matvec_solution(x: torch.Tensor, qs: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    xb = x.reshape(-1, 32)  # [blocks, 32]: block b is x[32b : 32b + 32]
    per_block = (qs.float() * xb).sum(-1)  # [out, blocks]: Σ_j q·x, in float32
    return (per_block * d.float()).sum(-1)  # each block's own scale, then the sum over blocks


def q4_1_offset_matvec_solution(x: torch.Tensor, qs: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    xb = x.reshape(-1, 32)  # [blocks, 32]
    q = unpack_nibbles_solution(qs).float()  # [out, blocks, 32]: codes 0..15 in the weights' order
    per_block = d.float() * (q * xb).sum(-1)  # d_b · Σ_j q·x
    offset = m.float() * xb.sum(-1)  # m_b · Σ_j x: the block sums of x are the same for every row
    return (per_block + offset).sum(-1)


def quantize_q4_1_solution(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    blocks = w.reshape(w.shape[0], -1, 32)
    low = blocks.amin(-1, keepdim=True)
    d = (blocks.amax(-1, keepdim=True) - low) / 15  # float32; stored as float16 below
    inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    q = torch.trunc((blocks - low) * inv + 0.5).clamp(0, 15).to(torch.uint8)  # ggml: every half rounds up
    return pack_nibbles_solution(q), d[..., 0].half(), low[..., 0].half()
