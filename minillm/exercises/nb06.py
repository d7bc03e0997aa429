"""Exercises of notebook 06 (real weights): the next-token loss the real model is measured with, the
Q4_1 dequantizer (the core one), and a Q8_0 quantizer that rounds the way llama.cpp does. (The Q/K
un-permute is notebook 04's exercise.)

The expected answers come from ``torch.nn.functional.cross_entropy`` in float64 and from the
``gguf`` package (``gguf.quants``, bit-exact with llama.cpp's reference quantizers); each classic
mistake is written out as the function a learner would write, so a wrong answer of that kind is
named. The reference solutions are the ``*_solution`` functions: the notebook's Solutions section
runs them, and the notebook goes on with them while a learner's stub is unfinished.
"""

from __future__ import annotations

from collections.abc import Callable

import math

import gguf
import numpy as np
import torch
import torch.nn.functional as F

from minillm.exercises import Mistake, check, forbid_calls

Q4_1 = gguf.GGMLQuantizationType.Q4_1
Q8_0 = gguf.GGMLQuantizationType.Q8_0

# --- the exercise of section 8: the next-token loss, in nats ----------------------------------


def next_token_nll_solution(logits: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """The mean negative log-likelihood, in nats, of each next token: position t's logits predict ids[:, t + 1].

    ``logits`` [batch, seq, vocab], ``ids`` [batch, seq], ``mask`` [batch, seq] (1 = real token, 0 =
    padding; None = all real). Only positions whose *target* is a real token count; the last position
    has no target. exp() of the result is the perplexity.
    """
    logp = torch.log_softmax(logits.double(), dim=-1)[:, :-1]            # position t predicts token t + 1
    nll = -logp.gather(-1, ids[:, 1:, None])[..., 0]                     # [batch, seq - 1], nats
    keep = torch.ones_like(nll, dtype=torch.bool) if mask is None else mask[:, 1:].bool()
    return nll[keep].mean()


def _nll_cases() -> list[tuple[tuple[torch.Tensor, ...], torch.Tensor]]:
    """Random float64 logits and ids (one batch without padding, one right-padded to unequal lengths)
    -> F.cross_entropy over the positions whose target is real."""
    g = torch.Generator().manual_seed(6)
    cases: list[tuple[tuple[torch.Tensor, ...], torch.Tensor]] = []
    for batch, seq, vocab, lengths in [(2, 7, 11, None), (3, 6, 13, [6, 4, 2])]:
        logits = 3 * torch.randn(batch, seq, vocab, generator=g, dtype=torch.float64)
        ids = torch.randint(1, vocab, (batch, seq), generator=g)
        targets = ids[:, 1:].clone()
        args: tuple[torch.Tensor, ...] = (logits, ids)
        if lengths is not None:
            mask = (torch.arange(seq)[None] < torch.tensor(lengths)[:, None]).long()
            ids.masked_fill_(mask == 0, 0)                                # the pad id: a real id, never a target
            targets = ids[:, 1:].masked_fill(mask[:, 1:] == 0, -100)      # cross_entropy's ignore_index
            args = (logits, ids, mask)
        want = F.cross_entropy(logits[:, :-1].reshape(-1, vocab), targets.reshape(-1), ignore_index=-100)
        cases.append((args, want))  # a 0-dim float64 tensor
    return cases


def _nll_variant(shift: str = "next", log: Callable[[torch.Tensor], torch.Tensor] = torch.log, dim: int = -1,
                 keep: str = "target", reduce: str = "tokens", sign: float = -1.0) -> Callable[..., torch.Tensor]:
    """The loss, wrong in one place (the classic mistakes)."""

    def nll(logits: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        logp = log(torch.softmax(logits.double(), dim=dim))
        real = torch.ones_like(ids, dtype=torch.bool) if mask is None else mask.bool()
        if shift == "next":
            picked, live = logp[:, :-1].gather(-1, ids[:, 1:, None])[..., 0], real[:, 1:]
        elif shift == "same":
            picked, live = logp.gather(-1, ids[..., None])[..., 0], real
        elif shift == "back":
            picked, live = logp[:, 1:].gather(-1, ids[:, :-1, None])[..., 0], real[:, :-1]
        else:  # "roll": torch.roll wraps the first token around as the last position's target
            picked, live = logp.gather(-1, ids.roll(-1, dims=1)[..., None])[..., 0], real.roll(-1, dims=1)
        if keep == "inputs":  # the mask of the position's own token, not of its target
            live = real[:, :-1] if shift == "next" else live
        elif keep == "all":
            live = torch.ones_like(live)
        per = sign * picked
        if reduce == "sum":
            return per[live].sum()
        if reduce == "rows":  # mean per sequence, then over sequences
            return torch.stack([row[ok].mean() for row, ok in zip(per, live)]).mean()
        return per[live].mean()

    return nll


NLL_MISTAKES = [
    Mistake(_nll_variant(shift="same"), "no shift: position t's logits were scored against token t itself. They "
                                        "predict the *next* token: logits[:, :-1] against ids[:, 1:]."),
    Mistake(_nll_variant(shift="back"), "shifted the wrong way: logits[:, 1:] against ids[:, :-1] scores each token "
                                        "with the logits of the position *after* it. Use logits[:, :-1], ids[:, 1:]."),
    Mistake(_nll_variant(shift="roll"), "the last position was scored too (torch.roll wraps the first token around as "
                                        "its target): the last position has no next token; drop it."),
    Mistake(_nll_variant(log=torch.log2), "that is log2, bits per token: the loss is in nats (natural log), as "
                                          "F.cross_entropy and perplexity = exp(loss) expect."),
    Mistake(_nll_variant(log=torch.log10), "that is log10: the loss is in nats (natural log)."),
    Mistake(_nll_variant(dim=1), "the softmax ran over the sequence axis (dim=1): each position's distribution is "
                                 "over the vocabulary, the last axis (dim=-1)."),
    Mistake(_nll_variant(keep="all"), "the padded positions were counted: keep only the positions whose target is a "
                                      "real token (mask[:, 1:] == 1)."),
    Mistake(_nll_variant(keep="inputs"), "the mask was shifted the wrong way: mask[:, :-1] counts the last real token "
                                         "predicting a pad; a position counts when its *target* is real, mask[:, 1:]."),
    Mistake(_nll_variant(reduce="rows"), "the mean was taken per sequence first, then over the sequences: every "
                                         "*token* weighs the same, so average over all kept positions at once."),
    Mistake(_nll_variant(reduce="sum"), "that is the sum over the positions: the loss is the mean per token."),
    Mistake(_nll_variant(sign=1.0), "the sign: that is the log-likelihood (negative); the loss is its negative."),
]

NLL_HINTS = [
    "Position t's logits predict token t + 1: score logits[:, :-1] against ids[:, 1:]; one position's loss is "
    "−log softmax(logits)[target], with the natural log (nats).",
    "logp = torch.log_softmax(logits.double(), dim=-1)[:, :-1]; nll = -logp.gather(-1, ids[:, 1:, None])[..., 0] "
    "([batch, seq − 1]); with a mask, keep the positions whose target is real: mask[:, 1:].",
    "keep = torch.ones_like(nll, dtype=torch.bool) if mask is None else mask[:, 1:].bool(); return nll[keep].mean()",
]

NOT_CROSS_ENTROPY = forbid_calls({name: "write the log-softmax and the pick of the target yourself (the check "
                                        "compares with F.cross_entropy)." for name in ("cross_entropy", "nll_loss")})


def _same_loss(got: object, want: torch.Tensor) -> bool:
    """One number (a 0-dim tensor or a float) equal to the float64 reference: to 1e-7 relative, or to
    float32's rounding when the learner computed in float32 (every named mistake is off by far more)."""
    tol = 1e-7
    if isinstance(got, torch.Tensor) and got.dim() == 0 and got.is_floating_point():
        tol = 1e-7 if got.dtype == torch.float64 else 1e-5
        got = got.item()
    return isinstance(got, float) and math.isclose(got, want.item(), rel_tol=tol)


def check_next_token_nll(fn: Callable[..., torch.Tensor], hint: int = 0) -> bool:
    """``fn(logits, ids, mask=None)`` -> the mean next-token NLL in nats, as F.cross_entropy in float64."""
    return check("next_token_nll", fn, _nll_cases(), hint=hint, hints=NLL_HINTS, equal=_same_loss,
                 mistakes=NLL_MISTAKES, rules=[NOT_CROSS_ENTROPY])


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


def dequantize_q4_1_solution(raw: torch.Tensor) -> torch.Tensor:
    """Whole Q4_1 tensors at once: [rows, 20·k] bytes -> [rows, 32·k] float32."""
    blocks = raw.reshape(-1, 20)                                   # one row per block
    d = blocks[:, 0:2].view(torch.float16).float()                 # [n_blocks, 1]: the scale
    m = blocks[:, 2:4].view(torch.float16).float()                 # [n_blocks, 1]: the minimum
    packed = blocks[:, 4:]                                         # 16 bytes, two 4-bit values each
    q = torch.cat([packed & 0x0F, packed >> 4], dim=1).float()     # low nibbles: elements 0-15, high: 16-31
    return (d * q + m).reshape(raw.shape[0], -1)


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


def quantize_q8_0_solution(x: torch.Tensor) -> torch.Tensor:
    """32 float32 weights -> the 34 bytes of their Q8_0 block, as llama.cpp writes them."""
    d = x.abs().max() / 127                                        # float32
    v = x * torch.where(d == 0, torch.zeros_like(d), 1 / d)
    q = _round_away(v)                                             # roundf: halves away from zero
    return torch.cat([d.reshape(1).half().view(torch.uint8), q.to(torch.int8).view(torch.uint8)])


def check_quantize_q8_0(fn: Callable[[torch.Tensor], torch.Tensor], hint: int = 0) -> bool:
    """``fn(x float32 [32])`` -> the 34 bytes (uint8) of its Q8_0 block, exactly as llama.cpp writes them."""
    return check("quantize_q8_0", fn, _q8_0_cases(), hint=hint, hints=Q8_0_HINTS, mistakes=Q8_0_MISTAKES)
