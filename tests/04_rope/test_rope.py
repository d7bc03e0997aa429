"""RoPE (``minillm.model.rope``): the interleaved and rotate-half layouts agree under the
permutation between them (and so do the attention outputs), and the scores depend only on the
relative position."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minillm.model.attention import attention_explicit, build_mask
from minillm.model.rope import RotaryEmbedding, apply_rope, apply_rope_interleaved, interleaved_to_half


@settings(max_examples=20, deadline=None)
@given(seq=st.integers(1, 12), head_dim=st.sampled_from([4, 16, 64]), seed=st.integers(0, 2**16))
def test_interleaved_and_rotate_half_rope_agree_under_the_permutation(seq, head_dim, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 3, seq, head_dim, generator=g)  # interleaved layout
    positions = torch.randint(0, 8000, (2, seq), generator=g)
    rotary = RotaryEmbedding(head_dim, 8192, 100000.0)
    cos, sin = rotary(positions, torch.float32)
    perm = interleaved_to_half(head_dim)
    half = apply_rope(x[..., perm], cos, sin)
    interleaved = apply_rope_interleaved(x, positions, 100000.0)
    torch.testing.assert_close(interleaved[..., perm], half, atol=1e-4, rtol=1e-4)


def test_attention_outputs_agree_between_the_two_rope_layouts():
    """Scores are invariant to permuting head_dim, so attention outputs agree exactly."""
    torch.manual_seed(1)
    q, k, v = torch.randn(1, 2, 7, 64), torch.randn(1, 2, 7, 64), torch.randn(1, 2, 7, 64)
    positions = torch.arange(7)[None]
    perm = interleaved_to_half(64)
    cos, sin = RotaryEmbedding(64, 64, 100000.0)(positions, torch.float32)
    mask = build_mask(None, 7, 7, q.device)
    out_interleaved = attention_explicit(
        apply_rope_interleaved(q, positions, 100000.0), apply_rope_interleaved(k, positions, 100000.0), v, mask
    )
    out_half = attention_explicit(apply_rope(q[..., perm], cos, sin), apply_rope(k[..., perm], cos, sin), v, mask)
    torch.testing.assert_close(out_interleaved, out_half, atol=1e-5, rtol=1e-5)


def test_rope_scores_depend_only_on_relative_position():
    torch.manual_seed(2)
    q, k = torch.randn(1, 1, 1, 64), torch.randn(1, 1, 1, 64)
    rotary = RotaryEmbedding(64, 4096, 100000.0)

    def score(m: int, n: int) -> float:
        cos_m, sin_m = rotary(torch.tensor([[m]]), torch.float32)
        cos_n, sin_n = rotary(torch.tensor([[n]]), torch.float32)
        return float((apply_rope(q, cos_m, sin_m) * apply_rope(k, cos_n, sin_n)).sum())

    assert score(10, 3) == pytest.approx(score(1007, 1000), abs=1e-3)
    assert score(10, 3) != pytest.approx(score(10, 4), abs=1e-3)
