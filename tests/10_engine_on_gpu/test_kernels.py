"""The float32 kernels of a decode step (``minillm/model/kernels``).

* ``paged_attention.cpp``: each row's attention through its block table equals exact attention
  over that row's keys, within a float32 rounding bound of the float64 result; a row's result
  does not depend on the rest of the batch or on the thread count (bit for bit).
* ``linear.cpp``: the small-batch product equals the float64 product within a float32 bound.
* Both refuse bad tables and tensors with the sizes named.

References: float64 computations on the same data (``paged_decode_attention_reference`` on
float64 copies, ``x.double() @ w.double().T``). Nothing here compares one float32
implementation's rounding with another's. (The packed-weight kernels: ``tests/11_quantization/test_quant.py``.)
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minillm.model import kernels
from minillm.model.attention import paged_decode_attention, paged_decode_attention_reference

pytestmark = pytest.mark.usefixtures("kernels_built")  # (built when the first test runs, not at collection)


def _step(lengths: list[int], block_size: int, n_kv_heads: int, groups: int, head_dim: int, seed: int,
          scale: float = 1.0):
    """A pool holding each row's keys in shuffled blocks, its tables and one query per row."""
    g = torch.Generator().manual_seed(seed)
    widths = [math.ceil(n / block_size) for n in lengths]
    num_blocks = sum(widths) + 3  # a few blocks nobody reads
    k_pool = torch.randn(num_blocks, n_kv_heads, block_size, head_dim, generator=g) * scale
    v_pool = torch.randn(num_blocks, n_kv_heads, block_size, head_dim, generator=g)
    order = torch.randperm(num_blocks, generator=g)
    tables = torch.zeros(len(lengths), max(widths), dtype=torch.long)  # padding: block 0, never read
    start = 0
    for row, width in enumerate(widths):
        tables[row, :width] = order[start : start + width]
        start += width
    q = torch.randn(len(lengths), n_kv_heads * groups, head_dim, generator=g) * scale
    return q, k_pool, v_pool, tables, torch.tensor(lengths)


def _within_rounding(got: torch.Tensor, q, k_pool, v_pool, tables, lens) -> None:
    """|kernel - exact| <= a float32 bound: the scores carry ~head_dim roundings of |q||k|, which
    the softmax turns into relative errors of the weights; the output is a weighted mean of
    values, so its error is at most that relative error times the largest |value|, plus the
    roundings of the sum over the keys."""
    exact = paged_decode_attention_reference(q.double(), k_pool.double(), v_pool.double(), tables, lens)
    u = 2.0**-24
    head_dim = q.shape[-1]
    score_error = 4 * head_dim * u * q.abs().max() * k_pool.abs().max() / math.sqrt(head_dim) + 16 * u
    bound = v_pool.abs().max() * (2 * score_error + 4 * int(lens.max()) * u) + 1e-30
    error = (got.double() - exact).abs().max()
    assert error <= bound, f"kernel off the exact result by {error:.3g} > bound {bound:.3g}"


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 700), min_size=1, max_size=5),
    block_size=st.sampled_from([1, 3, 5, 16, 17, 32]),
    n_kv_heads=st.integers(1, 3),
    groups=st.sampled_from([1, 3, 4]),
    head_dim=st.sampled_from([64, 128, 32, 48]),  # 64/128: the AVX-512 version; others: the portable one
    scale=st.sampled_from([0.01, 1.0, 4.0]),
    seed=st.integers(0, 2**16),
)
def test_the_kernel_equals_exact_attention_within_float32_rounding(lengths, block_size, n_kv_heads, groups, head_dim,
                                                                    scale, seed):
    """Rows of 1..700 keys (one chunk or several, partial groups of 16), blocks of 1..32 keys
    in shuffled order, 1-3 KV heads shared by 1-4 query heads, peaked and flat softmaxes."""
    step = _step(lengths, block_size, n_kv_heads, groups, head_dim, seed, scale)
    got = kernels.paged_decode_attention(*step)
    assert got.shape == step[0].shape and got.dtype == torch.float32
    _within_rounding(got, *step)


def test_the_model_path_uses_the_kernel_for_float32_and_the_reference_otherwise():
    step = _step([40, 3], 16, 3, 3, 64, seed=1)
    if kernels.vectorized():  # (else the portable loop is never the model's path)
        assert torch.equal(paged_decode_attention(*step), kernels.paged_decode_attention(*step))
    q, k_pool, v_pool, tables, lens = step
    half = paged_decode_attention(q.bfloat16(), k_pool.bfloat16(), v_pool.bfloat16(), tables, lens)
    assert half.dtype == torch.bfloat16  # the reference formulation, in the pools' dtype
    transposed = q.transpose(0, 1).contiguous().transpose(0, 1)  # a non-contiguous query is copied first
    assert torch.equal(paged_decode_attention(transposed, k_pool, v_pool, tables, lens), paged_decode_attention(*step))
    small = _step([40, 3], 16, 3, 3, 32, seed=1)  # a head size without a vectorized version: the reference
    assert torch.equal(paged_decode_attention(*small), paged_decode_attention_reference(*small))
    # vectorized() is what the library itself reports it was built with
    assert kernels.vectorized() == (kernels.available() and bool(torch.ops.minillm.vectorized()))


@settings(max_examples=15, deadline=None)
@given(lengths=st.lists(st.integers(1, 1500), min_size=2, max_size=5), seed=st.integers(0, 2**16))
def test_a_rows_result_does_not_depend_on_the_batch_or_the_thread_count(lengths, seed):
    """Batch invariance, bit for bit: each row alone equals the same row in the batch, and one
    thread equals several (how a row's keys are split depends only on its own length)."""
    q, k_pool, v_pool, tables, lens = _step(lengths, 16, 3, 3, 64, seed)
    batched = kernels.paged_decode_attention(q, k_pool, v_pool, tables, lens)
    for row in range(len(lengths)):
        alone = kernels.paged_decode_attention(q[row : row + 1], k_pool, v_pool, tables[row : row + 1].contiguous(),
                                               lens[row : row + 1])
        assert torch.equal(alone[0], batched[row])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(kernels.paged_decode_attention(q, k_pool, v_pool, tables, lens), batched)
    finally:
        torch.set_num_threads(threads)


def test_bad_tables_and_tensors_are_refused_naming_the_sizes():
    q, k_pool, v_pool, tables, lens = _step([20, 9], 16, 3, 3, 64, seed=2)
    run = kernels.paged_decode_attention
    with pytest.raises(RuntimeError, match=r"row 1 reads block 99 of a pool of \d+ blocks"):
        bad = tables.clone()
        bad[1, 0] = 99
        run(q, k_pool, v_pool, bad, lens)
    with pytest.raises(RuntimeError, match=r"row 0 reads block -1"):
        bad = tables.clone()
        bad[0, 1] = -1
        run(q, k_pool, v_pool, bad, lens)
    with pytest.raises(RuntimeError, match=r"row 0 has context length 33, outside 1\.\.32 \(2 blocks of 16\)"):
        run(q, k_pool, v_pool, tables, torch.tensor([33, 9]))
    with pytest.raises(RuntimeError, match=r"row 1 has context length 0"):
        run(q, k_pool, v_pool, tables, torch.tensor([20, 0]))
    with pytest.raises(RuntimeError, match=r"q must be contiguous float32 \[rows, n_heads, head_dim\], got Double"):
        run(q.double(), k_pool, v_pool, tables, lens)
    with pytest.raises(RuntimeError, match=r"head_dim of q \(32\) and of the pool \(64\) differ"):
        run(q[..., :32].contiguous(), k_pool, v_pool, tables, lens)
    with pytest.raises(RuntimeError, match=r"8 query heads cannot share 3 KV heads"):
        run(q[:, :8].contiguous(), k_pool, v_pool, tables, lens)
    with pytest.raises(RuntimeError, match=r"v_pool must be contiguous float32 shaped like k_pool"):
        run(q, k_pool, v_pool[:-1], tables, lens)
    with pytest.raises(RuntimeError, match=r"block_tables must be contiguous int64 \[rows=2, width\], got Int"):
        run(q, k_pool, v_pool, tables.int(), lens)
    with pytest.raises(RuntimeError, match=r"context_lens must be contiguous int64 \[rows=2\]"):
        run(q, k_pool, v_pool, tables, lens[:1])
    assert torch.isfinite(run(q, k_pool, v_pool, tables, lens)).all()  # and it still works afterwards


# ---------------------------------------------------------------------------- f32_linear


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 20), out_features=st.integers(1, 50), in_features=st.integers(1, 300),
       scale=st.sampled_from([2.0**-20, 1.0, 2.0**12]), seed=st.integers(0, 2**16))
def test_the_small_batch_product_stays_within_float32_rounding_of_the_exact_product(rows, out_features, in_features,
                                                                                     scale, seed):
    """Every row tile (1-8 rows, and more than 8 in several passes), every output tile and the
    outputs left over, inputs not a multiple of 16 (the masked tail): within K roundings of
    sum |x||w| of the float64 product."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, in_features, generator=g) * scale
    weight = torch.randn(out_features, in_features, generator=g)
    got = kernels.f32_linear(x, weight)
    assert got.shape == (rows, out_features) and got.dtype == torch.float32
    exact = x.double() @ weight.double().T
    bound = 2 * in_features * 2.0**-24 * (x.double().abs() @ weight.double().abs().T)
    assert ((got.double() - exact).abs() <= bound + 1e-300).all()


def test_the_small_batch_product_refuses_what_it_cannot_read_naming_the_sizes():
    x, weight = torch.randn(2, 64), torch.randn(8, 64)
    with pytest.raises(RuntimeError, match=r"f32_linear: x has 32 features, the weight takes 64"):
        kernels.f32_linear(x[:, :32].contiguous(), weight)
    with pytest.raises(RuntimeError, match=r"f32_linear: x must be a contiguous float32 CPU matrix.*Double"):
        kernels.f32_linear(x.double(), weight)
    with pytest.raises(RuntimeError, match=r"f32_linear: w must be a contiguous float32 CPU matrix"):
        kernels.f32_linear(x, weight.T.contiguous().T)
    assert kernels.f32_linear(x, weight).shape == (2, 8)
