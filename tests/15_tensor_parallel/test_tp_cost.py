"""The tensor-parallel cost model (``bench tp``): the bytes formula, the ring's traffic, the ranks' shares
and the break-even point, checked as arithmetic (no timing)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minillm.bench import tp_cost
from minillm.bench.tp_cost import Link
from minillm.exercises.nb15 import SMOLLM2
from minillm.model.config import ModelConfig


def test_a_smollm2_step_carries_two_all_reduces_per_layer_plus_the_embedding_and_the_logits():
    b = tp_cost.step_bytes(SMOLLM2, world=2, batch=1, dtype_bytes=4)
    assert b.all_reduces == 2 * 30 + 1
    assert b.all_reduce_bytes == 576 * 4
    assert b.total_all_reduce_bytes == 61 * 2304
    assert b.all_gather_bytes == 2 * 24576 * 4  # every rank's logits: the whole vocabulary, once
    b8 = tp_cost.step_bytes(SMOLLM2, world=3, batch=8, dtype_bytes=2)
    assert (b8.all_reduce_bytes, b8.all_gather_bytes) == (8 * 576 * 2, 3 * 16384 * 8 * 2)


def test_an_uneven_vocabulary_is_gathered_padded_to_the_largest_share():
    config = ModelConfig(vocab_size=320, hidden_size=96, n_layers=2, n_heads=6, n_kv_heads=3,
                               intermediate_size=96)
    assert tp_cost.step_bytes(config, world=3, batch=2, dtype_bytes=8).all_gather_bytes == 3 * 107 * 2 * 8


def ring_all_reduce(values: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[int]]:
    """A ring all-reduce written out: W - 1 steps of reduce-scatter, W - 1 of all-gather, each rank
    sending one chunk to its right neighbour per step. Returns every rank's result and elements sent."""
    world = len(values)
    chunks = [list(v.clone().chunk(world)) for v in values]
    sent = [0] * world
    for step in range(world - 1):  # reduce-scatter: after it, rank r holds the full sum of chunk (r + 1) % W
        outgoing = [(r, (r - step) % world, chunks[r][(r - step) % world].clone()) for r in range(world)]
        for r, c, data in outgoing:
            chunks[(r + 1) % world][c] += data
            sent[r] += data.numel()
    for step in range(world - 1):  # all-gather: pass the finished chunks around
        outgoing = [(r, (r + 1 - step) % world, chunks[r][(r + 1 - step) % world].clone()) for r in range(world)]
        for r, c, data in outgoing:
            chunks[(r + 1) % world][c] = data
            sent[r] += data.numel()
    return [torch.cat(c) for c in chunks], sent


@settings(max_examples=40, deadline=None)
@given(world=st.integers(1, 8), per_rank=st.integers(1, 5), seed=st.integers(0, 2**16))
def test_the_ring_sums_and_each_rank_sends_two_w_minus_one_over_w_of_the_tensor(world, per_rank, seed):
    g = torch.Generator().manual_seed(seed)
    values = [torch.randn(world * per_rank, generator=g, dtype=torch.float64) for _ in range(world)]
    results, sent = ring_all_reduce(values)
    total = torch.stack(values).sum(0)
    for r in results:
        assert torch.allclose(r, total, atol=1e-12)
    size = world * per_rank
    assert sent == pytest.approx([tp_cost.ring_all_reduce_bytes(size, world)] * world)


def test_ring_traffic_formulas():
    assert tp_cost.ring_all_reduce_bytes(1000, 1) == 0
    assert tp_cost.ring_all_reduce_bytes(1000, 2) == 1000
    assert tp_cost.ring_all_reduce_bytes(1000, 4) == 1500
    assert tp_cost.ring_all_gather_bytes(1000, 4) == 750
    link = Link("test", bandwidth=1e9, latency=1e-5)
    assert tp_cost.all_reduce_seconds(1e6, 2, link) == pytest.approx(2e-5 + 1e-3)


def test_the_ranks_weights_tile_the_model_and_the_busiest_share():
    assert sum(tp_cost.weight_elements(SMOLLM2, 1)) == 134_515_008 - (2 * 30 + 1) * 576  # the parameters but the norms
    for world in (1, 2, 3):
        assert sum(tp_cost.weight_elements(SMOLLM2, world)) == sum(tp_cost.weight_elements(SMOLLM2, 1))
    assert tp_cost.rank_share(SMOLLM2, 1) == 1.0
    assert tp_cost.rank_share(SMOLLM2, 3) == pytest.approx(1 / 3)  # one group, 512 channels, 16384 rows each
    assert 0.5 < tp_cost.rank_share(SMOLLM2, 2) < 0.55  # 2 of 3 groups, but half the feed-forward and vocabulary


@pytest.mark.parametrize("link", tp_cost.LINKS, ids=lambda link: link.name)
@pytest.mark.parametrize("batch", [1, 8])
def test_at_the_break_even_point_both_world_sizes_take_the_same_time(link, batch):
    seconds = tp_cost.break_even_seconds(SMOLLM2, 2, batch, 4, link)
    one = tp_cost.predict_seconds(seconds, SMOLLM2, 1, batch, 4, link)
    two = tp_cost.predict_seconds(seconds, SMOLLM2, 2, batch, 4, link)
    assert one == seconds and two == pytest.approx(one)
    assert tp_cost.predict_seconds(2 * seconds, SMOLLM2, 2, batch, 4, link) < 2 * seconds  # above it, W=2 wins
    assert tp_cost.predict_seconds(seconds / 2, SMOLLM2, 2, batch, 4, link) > seconds / 2  # below it, it loses


def test_slower_links_cost_more_and_a_big_model_pays_where_a_small_one_does_not():
    nvlink, pcie, ethernet = tp_cost.LINKS
    costs = [tp_cost.communication_seconds(SMOLLM2, 2, 1, 4, link) for link in (nvlink, pcie, ethernet)]
    assert costs == sorted(costs) and tp_cost.communication_seconds(SMOLLM2, 1, 1, 4, nvlink) == 0
    small = tp_cost.roofline_seconds(SMOLLM2, 4)
    assert small < tp_cost.break_even_seconds(SMOLLM2, 2, 1, 4, nvlink)
    big = tp_cost.LLAMA3_8B
    assert tp_cost.roofline_seconds(big, 2) > tp_cost.break_even_seconds(big, 2, 1, 2, nvlink)


def test_a_fitted_link_recovers_latency_and_bandwidth_and_prices_the_step_as_measured():
    truth = Link("truth", bandwidth=2e9, latency=40e-6)
    messages = tp_cost.step_messages(SMOLLM2, 2)
    assert messages == 61 * 2 + 1
    sent = [tp_cost.sent_per_rank(SMOLLM2, 2, batch, 4) for batch in (1, 8)]
    seconds = [messages * truth.latency + s / truth.bandwidth for s in sent]
    fit = tp_cost.fit_link("fit", messages, sent, seconds)
    assert fit.latency == pytest.approx(truth.latency) and fit.bandwidth == pytest.approx(truth.bandwidth)
    for batch, s in zip((1, 8), seconds):  # the step's collectives, plus the broadcast's two messages
        assert tp_cost.communication_seconds(SMOLLM2, 2, batch, 4, fit) == pytest.approx(s + 2 * fit.latency)
    flat = tp_cost.fit_link("flat", messages, sent, [1.0e-2, 0.9e-2])  # more bytes, less time: noise
    assert flat.bandwidth == float("inf") and flat.latency == pytest.approx(0.95e-2 / messages)
