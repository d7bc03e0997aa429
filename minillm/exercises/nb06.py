"""Exercises of notebook 06 (real weights): the Q4_1 dequantizer (the core one), a Q8_0 quantizer
that rounds the way llama.cpp does, and the Q/K un-permute.

The expected answers come from the ``gguf`` package (``gguf.quants``, bit-exact with llama.cpp's
reference quantizers) and from the package (``minillm.model.gguf_weights.unpermute``); each classic
mistake is written out as the function a learner would write, so a wrong answer of that kind is
named. The exercises work on torch tensors, so a wrong answer is described by shape, dtype and
the largest difference.
"""

from __future__ import annotations

from collections.abc import Callable

import gguf
import numpy as np
import torch

from minillm.exercises import Mistake, check
from minillm.model.gguf_weights import unpermute

Q4_1 = gguf.GGMLQuantizationType.Q4_1
Q8_0 = gguf.GGMLQuantizationType.Q8_0

# --- exercise 1 (the core): dequantize Q4_1 ------------------------------------------------------


def _q4_1_cases() -> list[tuple[tuple[torch.Tensor], torch.Tensor]]:
    """Raw Q4_1 rows made by gguf's quantizer (llama.cpp's format, bit for bit) -> gguf's dequantization."""
    rng = np.random.default_rng(41)
    # rows x weights, scale, offset: one block; all-positive weights (m > 0); a few rows of many blocks
    shapes = [((1, 32), 1.0, 0.0), ((3, 64), 0.05, 0.3), ((4, 160), 2.0, -1.0)]
    cases = []
    for (rows, cols), scale, offset in shapes:
        x = (rng.standard_normal((rows, cols)) * scale + offset).astype(np.float32)
        raw = gguf.quants.quantize(x, Q4_1)  # uint8 [rows, 20 * cols / 32]
        cases.append(((torch.from_numpy(raw.copy()),), torch.from_numpy(gguf.quants.dequantize(raw, Q4_1))))
    return cases


def _q4_1_with(nibbles: Callable[[torch.Tensor], torch.Tensor], scales: str = "float16", formula: str = "dq+m",
               d_first: bool = True) -> Callable[[torch.Tensor], torch.Tensor]:
    """A Q4_1 dequantizer that differs from the right one in one place (the wrong variants)."""

    def dequantize(raw: torch.Tensor) -> torch.Tensor:
        blocks = raw.reshape(-1, 20)
        first, second = blocks[:, 0:2], blocks[:, 2:4]
        if scales == "float16":
            d, m = first.view(torch.float16).float(), second.view(torch.float16).float()
        elif scales == "bfloat16":
            d, m = first.view(torch.bfloat16).float(), second.view(torch.bfloat16).float()
        else:  # the two bytes as an integer
            d, m = first.view(torch.int16).float(), second.view(torch.int16).float()
        if not d_first:
            d, m = m, d
        q = nibbles(blocks[:, 4:]).float()
        w = {"dq+m": d * q + m, "dq": d * q, "d(q-8)": d * (q - 8), "d(q-8)+m": d * (q - 8) + m}[formula]
        return w.reshape(raw.shape[0], -1)

    return dequantize


def _low_first(packed: torch.Tensor) -> torch.Tensor:
    return torch.cat([packed & 0x0F, packed >> 4], dim=1)


def _high_first(packed: torch.Tensor) -> torch.Tensor:
    return torch.cat([packed >> 4, packed & 0x0F], dim=1)


def _interleaved(packed: torch.Tensor) -> torch.Tensor:
    return torch.stack([packed & 0x0F, packed >> 4], dim=-1).reshape(packed.shape[0], -1)


def _wrong_axis(packed: torch.Tensor) -> torch.Tensor:
    return torch.cat([packed & 0x0F, packed >> 4], dim=0).reshape(packed.shape[0], -1)


Q4_1_MISTAKES = [
    Mistake(_q4_1_with(_high_first), "the nibble order is swapped: byte j holds element j in its *low* nibble "
                                     "(byte & 0x0F) and element j + 16 in its high nibble (byte >> 4)."),
    Mistake(_q4_1_with(_interleaved), "you interleaved the nibbles (elements 2j, 2j+1 from byte j): in ggml, byte j "
                                      "holds elements j (low nibble) and j + 16 (high nibble)."),
    Mistake(_q4_1_with(_wrong_axis), "the nibbles of *all* blocks got concatenated along the first axis: "
                                     "concatenate each block's low and high nibbles along dim=1."),
    Mistake(_q4_1_with(_low_first, formula="dq"), "the minimum m is missing: w = d·q + m (Q4_1's levels run from m, "
                                                  "the block's minimum, up)."),
    Mistake(_q4_1_with(_low_first, formula="d(q-8)"), "that is Q4_0's rule, d·(q − 8): Q4_1's nibbles are unsigned "
                                                      "0..15 and the offset is the stored minimum, w = d·q + m."),
    Mistake(_q4_1_with(_low_first, formula="d(q-8)+m"),
            "the nibbles are unsigned (0..15) in Q4_1: no − 8 (that is Q4_0); w = d·q + m."),
    Mistake(_q4_1_with(_low_first, d_first=False),
            "d and m are swapped: the block starts with the scale d (bytes 0-1), then the minimum m (bytes 2-3)."),
    Mistake(_q4_1_with(_low_first, scales="bfloat16"),
            "d and m are IEEE float16 (`.view(torch.float16)`), not bfloat16."),
    Mistake(_q4_1_with(_low_first, scales="int16"), "d and m are float16 numbers: reinterpret their two bytes with "
                                                    "`.view(torch.float16)`, don't read them as integers."),
]

Q4_1_HINTS = [
    "Every 20 bytes are one block: reshape to [n_blocks, 20], decode all blocks at once, reshape back to "
    "[rows, 32 · blocks per row].",
    "d = blocks[:, 0:2].view(torch.float16).float() (shape [n_blocks, 1]), m likewise from bytes 2-3; the 16 bytes "
    "blocks[:, 4:] hold elements 0-15 in their low nibbles (& 0x0F) and 16-31 in their high nibbles (>> 4).",
    "q = torch.cat([packed & 0x0F, packed >> 4], dim=1).float(); return (d * q + m).reshape(raw.shape[0], -1)",
]


def check_dequantize_q4_1(fn: Callable[[torch.Tensor], torch.Tensor], hint: int = 0) -> bool:
    """``fn(raw uint8 [rows, 20·k])`` -> float32 ``[rows, 32·k]``, bit for bit what ``gguf`` dequantizes."""
    return check("dequantize_q4_1", fn, _q4_1_cases(), hint=hint, hints=Q4_1_HINTS, mistakes=Q4_1_MISTAKES, atol=0.0)


# --- exercise 2: quantize a Q8_0 block, rounding as llama.cpp does --------------------------------

# Ties: with max |x| = 127·2⁻³ the scale d is exactly 2⁻³, so x·(1/d) lands exactly on k + ½ for these.
TIES = np.float32(2.0**-3) * np.array([127, 2.5, -2.5, 0.5, -0.5, 1.5, -1.5, 3.5, 10.5, -11.5] + [1.0] * 22, np.float32)
# The float just below ½: floor(v + 0.5) rounds it up (0.49999997 + 0.5 is 1.0 in float32); roundf does not.
_JUST_BELOW_HALF = np.nextafter(np.float32(0.5), np.float32(0))
BELOW_HALF = np.array([127.0, _JUST_BELOW_HALF, -_JUST_BELOW_HALF] + [0.25] * 29, np.float32)


def _q8_0_cases() -> list[tuple[tuple[torch.Tensor], torch.Tensor]]:
    rng = np.random.default_rng(6)
    inputs = [rng.standard_normal(32).astype(np.float32) * s for s in (0.02, 1.0, 300.0)]
    inputs += [np.zeros(32, np.float32), TIES, BELOW_HALF]
    inputs.append(gguf.quants.dequantize(gguf.quants.quantize(inputs[1][None], Q8_0), Q8_0)[0])  # a round trip
    return [((torch.from_numpy(x.copy()),), torch.from_numpy(gguf.quants.quantize(x[None], Q8_0)[0].copy()))
            for x in inputs]


def _q8_0_with(rounding: Callable[[torch.Tensor], torch.Tensor], amax: str = "abs", levels: float = 127.0,
               d_bytes: str = "float16", q_from_stored_d: bool = False) -> Callable[[torch.Tensor], torch.Tensor]:
    """A Q8_0 quantizer that differs from llama.cpp's in one place (the wrong variants)."""

    def quantize(x: torch.Tensor) -> torch.Tensor:
        top = x.abs().max() if amax == "abs" else x.max()
        d = top / levels
        scale = d.half().float() if q_from_stored_d else d
        inv = torch.where(scale == 0, torch.zeros_like(scale), 1 / scale)
        q = rounding(x * inv).clamp(-128, 127).to(torch.int8)
        head = d.reshape(1).half() if d_bytes == "float16" else d.reshape(1).float()
        return torch.cat([head.view(torch.uint8), q.view(torch.uint8)])

    return quantize


def _round_away(v: torch.Tensor) -> torch.Tensor:
    """C's roundf: halves away from zero, exactly (gguf's np_roundf, written in torch)."""
    a = v.abs()
    return torch.sign(v) * (a.floor() + (2 * (a - a.floor())).floor())


Q8_0_MISTAKES = [
    Mistake(_q8_0_with(torch.round), "torch.round (like np.round) rounds halves to *even* (2.5 -> 2): llama.cpp's "
                                     "roundf rounds them away from zero (2.5 -> 3, -2.5 -> -3)."),
    Mistake(_q8_0_with(lambda v: (v + 0.5).floor()),
            "floor(v + 0.5) rounds −2.5 to −2 (and 0.49999997 to 1): round halves away from zero, the magnitude "
            "and the sign apart."),
    Mistake(_q8_0_with(lambda v: v.sign() * (v.abs() + 0.5).floor()),
            "sign · floor(|v| + 0.5) rounds 0.49999997 up: in float32, 0.49999997 + 0.5 is exactly 1.0. "
            "Round the fraction without adding: floor(a) + floor(2·(a − floor(a)))."),
    Mistake(_q8_0_with(_round_away, q_from_stored_d=True),
            "q was computed with the float16-rounded d: llama.cpp divides by the float32 d (x · (1/d)) and only "
            "*stores* d as float16."),
    Mistake(_q8_0_with(_round_away, amax="max"), "d comes from the largest *magnitude*, max |x|, not max x."),
    Mistake(_q8_0_with(_round_away, levels=128.0),
            "d = max |x| / 127: the largest weight lands on ±127 (int8 has room for −128, but Q8_0 keeps the "
            "grid symmetric)."),
    Mistake(_q8_0_with(_round_away, d_bytes="float32"),
            "d is stored as float16 (2 bytes), so a block is 2 + 32 = 34 bytes."),
]

Q8_0_HINTS = [
    "d = max |x| / 127 in float32; q = round(x · (1/d)); the block is d's 2 float16 bytes, then the 32 int8s, "
    "as uint8.",
    "Round halves away from zero, as C's roundf does: a = v.abs(); "
    "q = sign(v) · (floor(a) + floor(2·(a − floor(a)))). torch.round and np.round round halves to even.",
    "inv = 0 if d == 0 else 1/d; q = _round(x * inv).to(torch.int8); "
    "return torch.cat([d.reshape(1).half().view(torch.uint8), q.view(torch.uint8)])",
]


def check_quantize_q8_0(fn: Callable[[torch.Tensor], torch.Tensor], hint: int = 0) -> bool:
    """``fn(x float32 [32])`` -> the 34 bytes (uint8) of its Q8_0 block, exactly as llama.cpp writes them."""
    return check("quantize_q8_0", fn, _q8_0_cases(), hint=hint, hints=Q8_0_HINTS, mistakes=Q8_0_MISTAKES)


# --- exercise 3: the Q/K un-permute --------------------------------------------------------------


def permute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """What llama.cpp's converter does to W_q / W_k: in each head, rows i and i + head_dim/2 become neighbours."""
    rows = w.shape[0]
    return w.reshape(n_heads, 2, rows // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _unpermute_cases() -> list[tuple[tuple[torch.Tensor, int], torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    originals = [(torch.arange(8)[:, None], 1), (torch.arange(24).reshape(12, 2), 3),
                 (torch.randn(192, 16, generator=g), 3), (torch.randn(576, 8, generator=g), 9)]  # SmolLM2's k, q
    return [((permute(w, heads), heads), unpermute(permute(w, heads), heads)) for w, heads in originals]


def _unpermute_one_head(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    return unpermute(w, 1)


def _permute_again(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    return permute(w, n_heads)


def _no_swap(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    return w.reshape(n_heads, -1, 2, *w.shape[1:]).reshape(w.shape)


UNPERMUTE_MISTAKES = [
    Mistake(_unpermute_one_head, "the rows were un-permuted as one big head: the permutation acts *inside each head* "
                                 "(reshape to n_heads first)."),
    Mistake(_permute_again, "that applies the converter's permutation a second time; undo it: reshape to "
                            "(n_heads, head_dim // 2, 2, ...) and swap axes 1 and 2."),
    Mistake(_no_swap, "reshaping alone moves nothing: swap axes 1 and 2 before reshaping back."),
]

UNPERMUTE_HINTS = [
    "Stored order inside a head of h rows: 0, h/2, 1, h/2 + 1, ...: the pairs (i, i + h/2) sit side by side.",
    "w.reshape(n_heads, head_dim // 2, 2, cols): axis 2 says first half / second half, axis 1 says i.",
    "return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)",
]


def check_unpermute_rows(fn: Callable[[torch.Tensor, int], torch.Tensor], hint: int = 0) -> bool:
    """``fn(w [rows, cols] in GGUF order, n_heads)`` -> the rows in transformers' (rotate-half) order."""
    return check("unpermute_rows", fn, _unpermute_cases(), hint=hint, hints=UNPERMUTE_HINTS,
                 mistakes=UNPERMUTE_MISTAKES, atol=0.0)
