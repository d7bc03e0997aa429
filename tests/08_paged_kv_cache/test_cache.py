"""The paged KV cache: paged attention against plain attention, copy-on-write of the pools,
running out of blocks (the bookkeeping alone: ``test_block_manager.py``; the contiguous cache and
the memory formula: ``tests/07_kv_cache/test_cache.py``)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minillm.cache import ContiguousKVCache, OutOfBlocksError, PagedKVCache
from minillm.cache.base import build_mask
from minillm.model.attention import attention_explicit, gather_kv, paged_attention, repeat_kv, write_kv
from minillm.model.config import ModelConfig

TINY = ModelConfig(vocab_size=64, hidden_size=16, n_layers=2, n_heads=4, n_kv_heads=2, intermediate_size=32,
                   max_position_embeddings=512)


def _reference_attention(q, k, v):
    """Plain causal attention over one whole sequence: q, k, v [1, heads, seq, head_dim]."""
    return attention_explicit(q, k, v, build_mask(None, q.shape[2], k.shape[2], q.device))


def _stored(cache: PagedKVCache, seq: int, layer: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The keys and values ``seq`` holds in ``layer``, [1, n_kv_heads, length, head_dim]: read
    through a step of no new tokens (which reserves and counts nothing)."""
    step = cache.step([seq], [0])
    return gather_kv(step.k_pools[layer], step), gather_kv(step.v_pools[layer], step)


@settings(max_examples=40, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 40), min_size=1, max_size=4),
    block_size=st.integers(1, 17),
    chunks=st.integers(1, 3),
    seed=st.integers(0, 2**16),
)
def test_paged_attention_equals_reference_attention(lengths, block_size, chunks, seed):
    """Sequences of random lengths written in random chunks, then one batched decode step:
    every row's attention through the block table equals plain attention on its own keys."""
    g = torch.Generator().manual_seed(seed)
    heads, head_dim = TINY.n_kv_heads, TINY.head_dim
    total_blocks = sum(math.ceil((n + 1) / block_size) for n in lengths)
    cache = PagedKVCache(TINY, total_blocks, block_size)
    keys = [torch.randn(1, heads, n + 1, head_dim, generator=g) for n in lengths]
    values = [torch.randn(1, heads, n + 1, head_dim, generator=g) for n in lengths]
    for s, n in enumerate(lengths):  # prefill each sequence alone, in `chunks` pieces
        cache.add_sequence(s)
        bounds = sorted({0, n, *torch.randint(1, n + 1, (chunks - 1,), generator=g).tolist()})
        for a, b in zip(bounds, bounds[1:]):
            write_kv(cache.prepare([s], b - a), 0, keys[s][:, :, a:b], values[s][:, :, a:b])
    step = cache.prepare(list(range(len(lengths))), 1)  # one decode token per sequence, batched
    new_k = torch.cat([k[:, :, -1:] for k in keys])
    new_v = torch.cat([v[:, :, -1:] for v in values])
    q = torch.randn(len(lengths), heads, 1, head_dim, generator=g)
    write_kv(step, 0, new_k, new_v)
    k_all, v_all = gather_kv(step.k_pools[0], step), gather_kv(step.v_pools[0], step)  # [rows, heads, longest, d]
    keys_held = torch.arange(k_all.shape[2])[None] < step.context_lens[:, None]  # a shorter row's tail: padding
    out = attention_explicit(q, k_all, v_all, build_mask(keys_held.long(), 1, k_all.shape[2], q.device))
    for s in range(len(lengths)):
        expected = attention_explicit(q[s : s + 1], keys[s], values[s], torch.ones(1, 1, 1, lengths[s] + 1, dtype=torch.bool))
        torch.testing.assert_close(out[s : s + 1], expected, atol=1e-6, rtol=1e-6)


def test_paged_prefill_equals_contiguous_cache_bit_for_bit():
    g = torch.Generator().manual_seed(0)
    k = torch.randn(1, 2, 23, 4, generator=g)
    v = torch.randn(1, 2, 23, 4, generator=g)
    contiguous = ContiguousKVCache(TINY, 1, 32)
    paged = PagedKVCache(TINY, 8, block_size=5)
    paged.add_sequence(0)
    ck, cv = contiguous.update(1, k, v)
    step = paged.prepare([0], 23)
    write_kv(step, 1, k, v)
    pk, pv = gather_kv(step.k_pools[1], step), gather_kv(step.v_pools[1], step)
    assert torch.equal(ck, pk) and torch.equal(cv, pv)
    assert torch.equal(_stored(paged, 0, 1)[0], k)


def test_fork_shares_blocks_and_copy_on_write_keeps_the_parent_intact():
    cache = PagedKVCache(TINY, num_blocks=6, block_size=4)
    cache.add_sequence(0)
    prompt_k = torch.arange(6 * 2 * 4, dtype=torch.float32).view(1, 2, 6, 4)
    step = cache.prepare([0], 6)
    for layer in range(TINY.n_layers):
        write_kv(step, layer, prompt_k, prompt_k)
    cache.fork(0, 1)
    assert cache.block_tables[0] == cache.block_tables[1]
    assert cache.allocator.num_free == 4  # 2 blocks, shared
    parent_before, _ = _stored(cache, 0)
    assert torch.equal(parent_before, prompt_k)
    step = cache.prepare([1], 1)  # the child writes into the shared, half-full second block
    assert cache.block_tables[1][0] == cache.block_tables[0][0]  # full first block still shared
    assert cache.block_tables[1][1] != cache.block_tables[0][1]  # second block copied
    write_kv(step, 0, torch.full((1, 2, 1, 4), -1.0), torch.full((1, 2, 1, 4), -1.0))
    parent_after, _ = _stored(cache, 0)
    assert torch.equal(parent_before, parent_after)
    child_k, _ = _stored(cache, 1)
    assert torch.equal(child_k[:, :, :6], prompt_k) and (child_k[:, :, 6] == -1).all()
    assert torch.equal(_stored(cache, 1, layer=1)[0][:, :, :6], prompt_k)  # the copy holds every layer's keys


def test_running_out_of_blocks_raises_and_leaves_the_pool_reusable():
    cache = PagedKVCache(TINY, num_blocks=4, block_size=4)
    cache.add_sequence(0)
    cache.prepare([0], 10)  # 3 blocks
    cache.add_sequence(1)
    with pytest.raises(OutOfBlocksError, match="needs 2 more blocks for this step but only 1 of 4 are free"):
        cache.prepare([1], 5)
    assert cache.block_tables[1] == [] and cache.allocator.num_free == 1
    cache.free_sequence(0)
    cache.prepare([1], 16)  # the freed blocks are reused
    assert cache.allocator.num_free == 0


def test_packed_prefill_fills_the_same_blocks_as_one_by_one_prefills():
    g = torch.Generator().manual_seed(3)
    lengths = [5, 1, 9]
    keys = [torch.randn(1, 2, n, 4, generator=g) for n in lengths]
    one_by_one = PagedKVCache(TINY, 8, block_size=4)
    packed = PagedKVCache(TINY, 8, block_size=4)
    for s, k in enumerate(keys):
        one_by_one.add_sequence(s)
        packed.add_sequence(s)
        write_kv(one_by_one.prepare([s], lengths[s]), 0, k, k)
    batch = packed.prepare([0, 1, 2], lengths)  # one step, three rows of different lengths
    flat = torch.cat(keys, dim=2)
    write_kv(batch, 0, flat, flat)
    assert batch.logits_index.tolist() == [4, 5, 14]  # each prompt's last token
    assert batch.positions.tolist() == [0, 1, 2, 3, 4, 0, 0, 1, 2, 3, 4, 5, 6, 7, 8]
    assert batch.q_lens == lengths and batch.context_lens.tolist() == lengths
    for s in range(3):
        assert one_by_one.lengths[s] == packed.lengths[s] == lengths[s]
        ours, theirs = _stored(packed, s)[0], _stored(one_by_one, s)[0]
        assert torch.equal(ours, theirs) and torch.equal(ours, keys[s])


@settings(max_examples=30, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 30), min_size=1, max_size=4),
    cached=st.lists(st.integers(0, 20), min_size=4, max_size=4),
    block_size=st.integers(1, 9),
    seed=st.integers(0, 2**16),
)
def test_paged_prefill_attention_equals_plain_causal_attention(lengths, cached, block_size, seed):
    """Rows of new tokens, some continuing a cached sequence (a prefill chunk), attended in one
    packed step: each row equals plain causal attention over its whole sequence (float64)."""
    _check_paged_step_attention(lengths, cached, block_size, seed)


@settings(max_examples=30, deadline=None)
@given(
    cached=st.lists(st.integers(0, 70), min_size=1, max_size=5),
    block_size=st.integers(1, 17),
    seed=st.integers(0, 2**16),
)
def test_paged_decode_attention_reads_blocks_in_place_like_plain_attention(cached, block_size, seed):
    """A decode step (one new token per row, rows of different lengths): the in-place read
    through the block tables equals plain attention over each row's keys (float64)."""
    _check_paged_step_attention([1] * len(cached), cached, block_size, seed)


def _check_paged_step_attention(lengths, cached, block_size, seed):
    g = torch.Generator().manual_seed(seed)
    heads, kv_heads, head_dim = TINY.n_heads, TINY.n_kv_heads, TINY.head_dim
    cached = cached[: len(lengths)]
    cache = PagedKVCache(TINY, sum(math.ceil((c + n) / block_size) for c, n in zip(cached, lengths)), block_size,
                         dtype=torch.float64)
    keys = [torch.randn(1, kv_heads, c + n, head_dim, generator=g, dtype=torch.float64) for c, n in zip(cached, lengths)]
    values = [torch.randn(1, kv_heads, c + n, head_dim, generator=g, dtype=torch.float64) for c, n in zip(cached, lengths)]
    for s, c in enumerate(cached):
        cache.add_sequence(s)
        if c:
            write_kv(cache.prepare([s], c), 0, keys[s][:, :, :c], values[s][:, :, :c])
    step = cache.prepare(list(range(len(lengths))), lengths)
    new_k = torch.cat([k[:, :, c:] for k, c in zip(keys, cached)], dim=2)
    new_v = torch.cat([v[:, :, c:] for v, c in zip(values, cached)], dim=2)
    q = torch.randn(1, heads, sum(lengths), head_dim, generator=g, dtype=torch.float64)
    out = paged_attention(q, new_k, new_v, step, 0)  # writes the new keys and values, then attends
    start = 0
    for s, (c, n) in enumerate(zip(cached, lengths)):
        q_s = q[:, :, start : start + n]
        k_s, v_s = repeat_kv(keys[s], heads // kv_heads), repeat_kv(values[s], heads // kv_heads)
        scores = (q_s @ k_s.transpose(-1, -2) / math.sqrt(head_dim)).masked_fill(~build_mask(None, n, c + n, q.device), -math.inf)
        expected = scores.softmax(-1) @ v_s  # all in float64 (attention_explicit's softmax is float32)
        torch.testing.assert_close(out[:, :, start : start + n], expected, atol=1e-12, rtol=1e-12)
        start += n
