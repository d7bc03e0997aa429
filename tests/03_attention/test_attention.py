"""The attention of ``minillm.model.attention`` against hand-written math: the fused kernel equals
the written-out formula (with and without repeated K/V heads), the mask is causal and hides
padding, and ``repeat_kv`` shares each K/V head with its group of query heads."""

from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minillm.model.attention import attention_explicit, attention_sdpa, build_mask, repeat_kv


@settings(max_examples=25, deadline=None)
@given(
    batch=st.integers(1, 3),
    n_kv_heads=st.integers(1, 3),
    n_groups=st.integers(1, 4),
    q_len=st.integers(1, 9),
    extra_k=st.integers(0, 70),
    head_dim=st.sampled_from([8, 16, 64]),
    seed=st.integers(0, 2**16),
)
def test_sdpa_path_equals_explicit_path(batch, n_kv_heads, n_groups, q_len, extra_k, head_dim, seed):
    """The fused kernel computes the written-out math; and given the un-repeated K/V heads
    (enable_gqa) it returns the very same numbers, bit for bit, as given repeat_kv's copies."""
    g = torch.Generator().manual_seed(seed)
    k_len = q_len + extra_k
    q = torch.randn(batch, n_kv_heads * n_groups, q_len, head_dim, generator=g)
    k_shared = torch.randn(batch, n_kv_heads, k_len, head_dim, generator=g)
    v_shared = torch.randn(batch, n_kv_heads, k_len, head_dim, generator=g)
    k, v = repeat_kv(k_shared, n_groups), repeat_kv(v_shared, n_groups)
    padding = torch.ones(batch, k_len, dtype=torch.long)
    padding[0, : min(2, k_len - 1)] = 0  # left padding in the first row
    mask = build_mask(padding, q_len, k_len, q.device)
    out = attention_sdpa(q, k, v, mask)
    torch.testing.assert_close(out, attention_explicit(q, k, v, mask), atol=1e-5, rtol=1e-5)
    assert torch.equal(attention_sdpa(q, k_shared, v_shared, mask), out)


def test_explicit_attention_matches_the_formula_by_hand():
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 1, 3, 4), torch.randn(1, 1, 3, 4), torch.randn(1, 1, 3, 4)
    mask = build_mask(None, 3, 3, q.device)
    out = attention_explicit(q, k, v, mask)
    for t in range(3):  # query t sees keys 0..t
        scores = torch.tensor([float(q[0, 0, t] @ k[0, 0, s]) / math.sqrt(4) for s in range(t + 1)])
        weights = torch.softmax(scores, dim=0)
        expected = sum(w * v[0, 0, s] for s, w in enumerate(weights))
        torch.testing.assert_close(out[0, 0, t], expected)


def test_mask_is_causal_hides_padding_and_never_leaves_a_row_empty():
    padding = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]])
    mask = build_mask(padding, 4, 4, torch.device("cpu"))
    assert mask[1, 0].tolist() == [[True, False, False, False], [True, True, False, False],
                                    [True, True, True, False], [True, True, True, True]]
    assert mask[0, 0, 2].tolist() == [False, False, True, False]
    assert mask[0, 0, 3].tolist() == [False, False, True, True]
    assert mask[0, 0, 0].all()  # a pad query that could see nothing sees everything (no NaN)


def test_repeat_kv_shares_each_kv_head_with_consecutive_query_heads():
    kv = torch.arange(2).float().view(1, 2, 1, 1)
    assert repeat_kv(kv, 3).flatten().tolist() == [0, 0, 0, 1, 1, 1]
