"""Requests arriving over time: the Poisson stream, the percentiles and the serving loop that
bench latency and notebook 10 time."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from minillm import Engine, SamplingParams, load_model
from minillm.bench import latency_summary, percentile, poisson_arrivals, serve_arrivals

from helpers.checkpoints import tiny_hf_checkpoint


def test_poisson_arrivals_are_seeded_increasing_and_have_the_asked_rate():
    times = poisson_arrivals(20_000, rate_per_s=4.0, seed=3)
    assert times == poisson_arrivals(20_000, rate_per_s=4.0, seed=3) != poisson_arrivals(20_000, 4.0, seed=4)
    assert all(b > a for a, b in zip(times, times[1:]))
    rate = len(times) / times[-1]
    assert 3.8 < rate < 4.2  # 20k exponential gaps: the mean is within 5% with overwhelming probability


@given(st.lists(st.floats(-1e6, 1e6), min_size=1, max_size=50), st.floats(0, 100))
def test_percentile_is_torch_quantile_with_linear_interpolation(values, q):
    expected = torch.quantile(torch.tensor(values, dtype=torch.float64), q / 100, interpolation="linear").item()
    assert percentile(values, q) == pytest.approx(expected, rel=1e-9, abs=1e-6)


def test_percentile_by_hand():
    assert percentile([3.0, 1.0, 2.0, 4.0], 50) == 2.5
    assert percentile([10.0, 20.0], 99) == pytest.approx(19.9)
    assert percentile([7.0], 99) == 7.0


def test_serving_arrivals_times_every_request_and_matches_generate(tmp_path, tiny_tokenizer):
    folder = tiny_hf_checkpoint(tmp_path, tiny_tokenizer, "llama", max_position_embeddings=256, vocab_size=300)
    model, tok = load_model(folder, device="cpu", dtype=torch.float64)
    engine = Engine(model, tok, backend="eager", max_batch_size=3)
    prompts = [[1 + i, 2 + i, 3] for i in range(6)]
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (5, 1, 8, 0, 3, 6)]
    rows = serve_arrivals(engine, prompts, params, poisson_arrivals(6, rate_per_s=200.0, seed=0))
    assert [row["tokens"] for row in rows] == [5, 1, 8, 0, 3, 6]
    assert all(0 <= row["ttft"] <= row["latency"] for row in rows)
    assert all(row["tpot"] >= 0 for row in rows)
    summary = latency_summary(rows)
    assert summary["ttft_p50_ms"] <= summary["ttft_p99_ms"]
    expected = [c.token_ids for c in engine.generate(prompts, params)]
    assert not engine.has_unfinished_requests()
    served_again = Engine(model, tok, backend="eager", max_batch_size=3)
    requests = [served_again.add_request(p, ps) for p, ps in zip(prompts, params)]
    while served_again.has_unfinished_requests():
        served_again.step()
    assert [r.output_ids for r in requests] == expected
