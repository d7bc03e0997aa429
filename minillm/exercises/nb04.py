"""Exercises of notebook 04 (RoPE): the angles, rotate-half RoPE from scratch, the inverse
layout permutation, and the un-permute of GGUF's Q/K rows.

The reference answers are here too, as ``<name>_solution`` (the notebook's solutions section runs
them through the same checks; ``nb04.rope_half_solution??`` shows one's code).

The expected answers come from the package (``minillm.model.rope`` and
``minillm.model.gguf_weights.unpermute``); each classic mistake is written out as the function a
learner would write, so a wrong answer of that kind is named.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from minillm.exercises import Mistake, check
from minillm.model.gguf_weights import unpermute
from minillm.model.rope import (
    RotaryEmbedding,
    apply_rope,
    apply_rope_interleaved,
    interleaved_to_half,
    rope_frequencies,
    rotate_half,
)

SMOLLM2_THETA = 100000.0  # the notebook's global `theta`: a function that reads it ignores its argument
NOTEBOOK_THETA = (
    "you used theta = 100000 (SmolLM2's, the notebook's global `theta`?) instead of the `theta` argument: "
    "the check also tries theta 100 and 10000."
)

AnglesFn = Callable[[int, int, float], torch.Tensor]
RopeFn = Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]
PermutationFn = Callable[[int], torch.Tensor]
UnpermuteFn = Callable[[torch.Tensor, int], torch.Tensor]


# --- exercise 1: the angles -----------------------------------------------------------------------


def _angle_cases() -> list[tuple[tuple[int, int, float], torch.Tensor]]:
    cases = [(0, 8, 10000.0), (1, 4, 100.0), (3, 64, 100000.0), (4000, 64, 100000.0)]
    return [((m, d, theta), m * rope_frequencies(d, theta)) for m, d, theta in cases]


def _angles_exponent_i(position: int, head_dim: int, theta: float) -> torch.Tensor:
    return position / theta ** (torch.arange(head_dim // 2).float() / head_dim)


def _angles_growing(position: int, head_dim: int, theta: float) -> torch.Tensor:
    return position * theta ** (torch.arange(0, head_dim, 2).float() / head_dim)


def _angles_no_position(position: int, head_dim: int, theta: float) -> torch.Tensor:
    return rope_frequencies(head_dim, theta)


def _angles_in_degrees(position: int, head_dim: int, theta: float) -> torch.Tensor:
    return torch.rad2deg(position * rope_frequencies(head_dim, theta))


def _angles_notebook_theta(position: int, head_dim: int, theta: float) -> torch.Tensor:
    return position * rope_frequencies(head_dim, SMOLLM2_THETA)


ANGLE_MISTAKES = [
    Mistake(
        _angles_exponent_i,
        "your exponent is i / head_dim; it is 2i / head_dim (torch.arange(0, head_dim, 2) / head_dim), "
        "so the slowest pair turns at theta^-(1 - 2/head_dim), not theta^-(1/2).",
    ),
    Mistake(_angles_growing, "your speeds grow with i: θ_i = theta ** (-2i / head_dim) — note the minus sign."),
    Mistake(_angles_no_position, "these are the speeds θ_i (radians per position); multiply by `position`."),
    Mistake(_angles_in_degrees, "these are degrees; the angles are in radians (drop the conversion)."),
    Mistake(_angles_notebook_theta, NOTEBOOK_THETA),
]

ANGLE_HINTS = [
    "Pair i turns by position · θ_i, with θ_i = theta^(-2i / head_dim) for i = 0 … head_dim/2 - 1.",
    "torch.arange(0, head_dim, 2).float() / head_dim gives the exponents 2i/head_dim as float32.",
    "return position * (1.0 / theta ** (torch.arange(0, head_dim, 2).float() / head_dim))",
]


def rope_angles_solution(position: int, head_dim: int, theta: float) -> torch.Tensor:
    """The reference answer: ``position * θ_i`` with ``θ_i = theta ** (-2i / head_dim)``, float32."""
    return position * (1.0 / theta ** (torch.arange(0, head_dim, 2).float() / head_dim))


def check_rope_angles(fn: AnglesFn, hint: int = 0) -> bool:
    """``fn(position, head_dim, theta)`` -> float32 ``[head_dim // 2]``: ``position * θ_i``."""
    return check("rope_angles", fn, _angle_cases(), hint=hint, hints=ANGLE_HINTS, mistakes=ANGLE_MISTAKES)


# --- exercise 2: rotate-half RoPE from scratch ----------------------------------------------------


def _package_rope(x: torch.Tensor, position_ids: torch.Tensor, theta: float) -> torch.Tensor:
    rotary = RotaryEmbedding(x.shape[-1], int(position_ids.max()) + 1, theta)
    cos, sin = rotary(position_ids, x.dtype)
    return apply_rope(x, cos, sin)


def _rope_cases() -> list[tuple[tuple[torch.Tensor, torch.Tensor, float], torch.Tensor]]:
    shapes = [  # (batch, heads, seq, head_dim), positions, theta
        ((1, 1, 1, 8), [[0]], 10000.0),  # position 0: no rotation at all
        ((1, 2, 3, 8), [[1, 2, 3]], 10000.0),
        ((2, 2, 3, 16), [[2, 3, 4], [7, 8, 9]], 10000.0),  # batch == heads: a missing head axis shows
        ((2, 9, 4, 64), [[0, 1, 2, 3], [0, 0, 0, 1]], 100000.0),  # SmolLM2's heads, a left-padded row
        ((1, 3, 2, 64), [[4000, 4001]], 100000.0),
    ]
    cases = []
    for seed, (shape, positions, theta) in enumerate(shapes):
        x = torch.randn(*shape, generator=torch.Generator().manual_seed(seed))
        position_ids = torch.tensor(positions)
        cases.append(((x, position_ids, theta), _package_rope(x, position_ids, theta)))
    return cases


def _rope_interleaved_pairs(x: torch.Tensor, position_ids: torch.Tensor, theta: float) -> torch.Tensor:
    return apply_rope_interleaved(x, position_ids, theta)


def _rope_wrong_way(x: torch.Tensor, position_ids: torch.Tensor, theta: float) -> torch.Tensor:
    cos, sin = RotaryEmbedding(x.shape[-1], int(position_ids.max()) + 1, theta)(position_ids, x.dtype)
    return x * cos - rotate_half(x) * sin


def _rope_position_plus_one(x: torch.Tensor, position_ids: torch.Tensor, theta: float) -> torch.Tensor:
    return _package_rope(x, position_ids + 1, theta)


def _rope_table_interleaved(x: torch.Tensor, position_ids: torch.Tensor, theta: float) -> torch.Tensor:
    angles = position_ids.float()[:, None, :, None] * rope_frequencies(x.shape[-1], theta)
    angles = angles.repeat_interleave(2, dim=-1)  # [a0, a0, a1, a1, ...]: the interleaved table
    return x * angles.cos() + rotate_half(x) * angles.sin()


def _rope_no_head_axis(x: torch.Tensor, position_ids: torch.Tensor, theta: float) -> torch.Tensor:
    angles = position_ids.float()[..., None] * rope_frequencies(x.shape[-1], theta)  # [batch, seq, half]
    angles = torch.cat([angles, angles], dim=-1)  # [batch, seq, head_dim]: lines up batch with heads
    return x * angles.cos() + rotate_half(x) * angles.sin()


def _rope_first_half_only(x: torch.Tensor, position_ids: torch.Tensor, theta: float) -> torch.Tensor:
    half = x.shape[-1] // 2
    angles = position_ids.float()[:, None, :, None] * rope_frequencies(x.shape[-1], theta)
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * angles.cos() - x2 * angles.sin(), x2], dim=-1)


def _rope_exponent_i(x: torch.Tensor, position_ids: torch.Tensor, theta: float) -> torch.Tensor:
    head_dim = x.shape[-1]
    inv_freq = 1.0 / theta ** (torch.arange(head_dim // 2).float() / head_dim)
    angles = position_ids.float()[:, None, :, None] * inv_freq
    angles = torch.cat([angles, angles], dim=-1)
    return x * angles.cos() + rotate_half(x) * angles.sin()


def _rope_positions_ignored(x: torch.Tensor, position_ids: torch.Tensor, theta: float) -> torch.Tensor:
    return _package_rope(x, torch.arange(x.shape[-2]).expand(x.shape[0], -1), theta)


def _rope_first_row_positions(x: torch.Tensor, position_ids: torch.Tensor, theta: float) -> torch.Tensor:
    return _package_rope(x, position_ids[:1].expand(x.shape[0], -1), theta)


def _rope_cos_sin_swapped(x: torch.Tensor, position_ids: torch.Tensor, theta: float) -> torch.Tensor:
    cos, sin = RotaryEmbedding(x.shape[-1], int(position_ids.max()) + 1, theta)(position_ids, x.dtype)
    return x * sin + rotate_half(x) * cos


def _rope_notebook_theta(x: torch.Tensor, position_ids: torch.Tensor, theta: float) -> torch.Tensor:
    return _package_rope(x, position_ids, SMOLLM2_THETA)


ROPE_MISTAKES = [
    Mistake(
        _rope_interleaved_pairs,
        "you paired adjacent coordinates (x[2i], x[2i+1]): that is the interleaved layout. Rotate-half "
        "pairs x[i] with x[i + head_dim/2].",
    ),
    Mistake(
        _rope_wrong_way,
        "your rotation turns the wrong way (by -mθ): the sin term has the wrong sign. Each pair (x1, x2) "
        "becomes (x1 cos - x2 sin, x2 cos + x1 sin); rotate_half(x) is (-x2, x1), not (x2, -x1).",
    ),
    Mistake(_rope_position_plus_one, "you rotated by position + 1: the first token sits at position 0 and is not rotated."),
    Mistake(
        _rope_table_interleaved,
        "your cos/sin repeat each angle twice side by side ([a0, a0, a1, a1, ...], repeat_interleave): that "
        "is the interleaved table. Rotate-half lays the angles out twice: torch.cat([a, a], dim=-1).",
    ),
    Mistake(
        _rope_no_head_axis,
        "your cos/sin are [batch, seq, head_dim]: broadcast against [batch, heads, seq, head_dim] they line "
        "the batch up with the heads. Add the head axis: [batch, 1, seq, head_dim].",
    ),
    Mistake(
        _rope_first_half_only,
        "only the first half is rotated; the second half of each pair changes too: x2 cos + x1 sin.",
    ),
    Mistake(_rope_exponent_i, "your speeds use the exponent i / head_dim; it is 2i / head_dim."),
    Mistake(
        _rope_positions_ignored,
        "you rotated by 0, 1, 2, ... (the index along seq), not by `position_ids`: a left-padded row, or a "
        "decode step at position 4000, sits elsewhere.",
    ),
    Mistake(_rope_first_row_positions, "every row was rotated with the first row's positions; each row has its own."),
    Mistake(_rope_cos_sin_swapped, "cos and sin are swapped: x' = x · cos + rotate_half(x) · sin (at position 0, x' = x)."),
    Mistake(_rope_notebook_theta, NOTEBOOK_THETA),
]

ROPE_HINTS = [
    "Three steps: the angles position · θ_i ([batch, seq, head_dim/2]); cos and sin of them laid out for "
    "both halves; then x1' = x1 cos - x2 sin, x2' = x2 cos + x1 sin.",
    "angles = position_ids.float()[:, None, :, None] * inv_freq gives [batch, 1, seq, head_dim/2] (one head "
    "axis to broadcast over); torch.cat([angles, angles], dim=-1) covers both halves.",
    "inv_freq = 1 / theta ** (torch.arange(0, d, 2).float() / d); a = cat([angles, angles], -1); "
    "rotated = torch.cat([-x[..., d//2:], x[..., :d//2]], -1); return x * a.cos() + rotated * a.sin()",
]


def _explain_shape_errors(fn: RopeFn) -> RopeFn:
    """Run ``fn``; a broadcasting error between head_dim and head_dim/2 gets a sentence on its cause."""

    @functools.wraps(fn)
    def run(x: torch.Tensor, position_ids: torch.Tensor, theta: float) -> Any:
        try:
            return fn(x, position_ids, theta)
        except RuntimeError as err:
            d = x.shape[-1]
            if "size of tensor" in str(err) and f"({d // 2})" in str(err) and f"({d})" in str(err):
                raise RuntimeError(
                    f"{err} — your cos/sin have head_dim/2 = {d // 2} columns and x has {d}: "
                    "concatenate the angles for both halves, torch.cat([a, a], dim=-1)."
                ) from None
            raise

    return run


def rope_half_solution(x: torch.Tensor, position_ids: torch.Tensor, theta: float) -> torch.Tensor:
    """The reference answer: angles per row and position, laid out for both halves, then the rotation."""
    head_dim = x.shape[-1]
    half = head_dim // 2
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2).float() / head_dim)  # θ_i
    angles = position_ids.float()[:, None, :, None] * inv_freq  # [batch, 1 (heads), seq, half]
    angles = torch.cat([angles, angles], dim=-1)  # rotate-half: pair i at i and i + half
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)  # (x1, x2) -> (-x2, x1)
    return x * angles.cos() + rotated * angles.sin()


def check_rope_half(fn: RopeFn, hint: int = 0) -> bool:
    """``fn(x [batch, heads, seq, head_dim], position_ids [batch, seq], theta)`` -> x rotated
    (rotate-half layout), compared with the package's ``apply_rope`` on ``RotaryEmbedding``'s cos/sin."""
    return check(
        "rope_half", _explain_shape_errors(fn), _rope_cases(), hint=hint, hints=ROPE_HINTS, mistakes=ROPE_MISTAKES
    )


# --- exercise 3: the inverse permutation ----------------------------------------------------------


def _inverse_cases() -> list[tuple[tuple[int], torch.Tensor]]:
    return [((d,), torch.argsort(interleaved_to_half(d))) for d in (4, 8, 64)]


def _identity_order(head_dim: int) -> torch.Tensor:
    return torch.arange(head_dim)


INVERSE_MISTAKES = [
    Mistake(
        interleaved_to_half,
        "that is interleaved_to_half itself (interleaved -> rotate-half). The inverse puts half position i "
        "back at 2i and half position i + head_dim/2 at 2i + 1.",
    ),
    Mistake(_identity_order, "that is the identity: it leaves every coordinate where it is."),
]

INVERSE_HINTS = [
    "x_interleaved[2i] is pair i's first coordinate, which rotate-half keeps at i; x_interleaved[2i+1] is "
    "its second, kept at i + head_dim/2.",
    "So the index reads [0, half, 1, half + 1, 2, half + 2, ...]: two aranges, interleaved.",
    "torch.stack([torch.arange(half), torch.arange(half) + half], dim=1).flatten()  (or torch.argsort of "
    "interleaved_to_half)",
]


def half_to_interleaved_solution(head_dim: int) -> torch.Tensor:
    """The reference answer: [0, half, 1, half + 1, ...], the inverse of ``interleaved_to_half``."""
    half = head_dim // 2
    return torch.stack([torch.arange(half), torch.arange(half) + half], dim=1).flatten()


def check_half_to_interleaved(fn: PermutationFn, hint: int = 0) -> bool:
    """``fn(head_dim)`` -> LongTensor index with ``x_interleaved = x_half[..., fn(head_dim)]``."""
    return check("half_to_interleaved", fn, _inverse_cases(), hint=hint, hints=INVERSE_HINTS, mistakes=INVERSE_MISTAKES)


# --- exercise 4: un-permute GGUF's Q/K rows -------------------------------------------------------


def _unpermute_cases() -> list[tuple[tuple[torch.Tensor, int], torch.Tensor]]:
    # rows, d_in, n_heads: tiny heads, SmolLM2's k (3 heads of 64) and q (9 heads), and a square weight
    # (like the real 576 x 576 q) on which un-permuting the columns instead of the rows still runs
    shapes = [(48, 48, 3), (8, 2, 2), (12, 5, 3), (24, 6, 3), (192, 32, 3), (576, 8, 9)]
    cases = []
    for seed, (rows, d_in, n_heads) in enumerate(shapes):
        w = torch.randn(rows, d_in, generator=torch.Generator().manual_seed(seed))
        cases.append(((w, n_heads), torch.from_numpy(unpermute(w.numpy(), n_heads))))
    return cases


def _permute_again(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """llama.cpp's converter's permute (HF -> GGUF): applying it instead of undoing it."""
    head_dim = w.shape[0] // n_heads
    return w.reshape(n_heads, 2, head_dim // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _one_head(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    return torch.from_numpy(unpermute(w.numpy(), 1))


def _no_swap(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    return w.reshape(n_heads, -1, 2, *w.shape[1:]).reshape(w.shape)


def _halves_swapped(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    head_dim = w.shape[0] // n_heads
    return w.reshape(n_heads, head_dim // 2, 2, *w.shape[1:]).transpose(1, 2).flip(1).reshape(w.shape)


def _columns(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    return torch.from_numpy(unpermute(w.T.numpy(), n_heads)).T


UNPERMUTE_MISTAKES = [
    Mistake(
        _permute_again,
        "you applied llama.cpp's permute (HF -> GGUF, view [n_heads, 2, head_dim // 2, d_in]) instead of undoing "
        "it: the GGUF rows of each head are pairs side by side, so view them as [n_heads, head_dim // 2, 2, d_in].",
    ),
    Mistake(
        _one_head,
        "you permuted all the rows as if they were one head; the permutation is within each head "
        "(view [n_heads, head_dim // 2, 2, d_in], head_dim = rows // n_heads).",
    ),
    Mistake(_no_swap, "the rows come back in the file's order: a reshape alone moves nothing; swap axes 1 and 2 "
                      "of [n_heads, head_dim // 2, 2, d_in] before reshaping back."),
    Mistake(
        _halves_swapped,
        "each head's halves are swapped: the pairs' *second* coordinates came first. In rotate-half order the "
        "first coordinates (GGUF rows 0, 2, 4, ...) fill the first half of the head.",
    ),
    Mistake(_columns, "you permuted the columns (d_in); the permutation is on the rows, the outputs of q = x Wᵀ."),
]

UNPERMUTE_HINTS = [
    "Within each head, GGUF stores the rows of pair i side by side (2i, 2i+1); rotate-half wants all the "
    "first coordinates, then all the second ones.",
    "Give each head its own axis and split its rows into (pair, which coordinate): "
    "w.view(n_heads, head_dim // 2, 2, d_in); then swap the last two of those axes.",
    "return w.view(n_heads, head_dim // 2, 2, -1).transpose(1, 2).reshape(w.shape)",
]


def unpermute_rows_solution(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """The reference answer: per head, (pair, coordinate) -> (coordinate, pair)."""
    head_dim = w.shape[0] // n_heads
    return w.view(n_heads, head_dim // 2, 2, -1).transpose(1, 2).reshape(w.shape)


def check_unpermute_rows(fn: UnpermuteFn, hint: int = 0) -> bool:
    """``fn(w [n_heads * head_dim, d_in], n_heads)`` -> the rows in rotate-half order, exactly
    ``gguf_weights.unpermute`` (a permutation: no rounding, so the comparison is exact)."""
    return check("unpermute_rows", fn, _unpermute_cases(), hint=hint, hints=UNPERMUTE_HINTS,
                 mistakes=UNPERMUTE_MISTAKES, atol=0.0)
