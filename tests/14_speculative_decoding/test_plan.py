"""How many drafts a step verifies: laws of ``plan_drafts``, ``StepCosts`` and ``Acceptance``."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from minillm.engine.speculation import StepCosts, plan_drafts
from minillm.sampling.speculative import Acceptance

rates = st.lists(st.one_of(st.just(0.0), st.floats(0.1, 0.999)), min_size=1, max_size=8)


@settings(max_examples=200, deadline=None)
@given(rates, st.integers(0, 8), st.integers(1, 16))
def test_free_rows_take_every_draft_that_may_be_kept(rs, cap, rows):
    counts = plan_drafts(rs, [cap] * len(rs), rows, lambda n: 1.0)
    assert counts == [cap if r > 0 else 0 for r in rs]


@settings(max_examples=200, deadline=None)
@given(rates, st.integers(0, 8), st.integers(1, 16))
def test_rows_that_cost_a_whole_step_each_never_pay(rs, cap, rows):
    """t(n) = n: a draft kept with probability < 1 can never raise tokens per second."""
    assert plan_drafts(rs, [cap] * len(rs), rows, lambda n: float(n)) == [0] * len(rs)


@settings(max_examples=200, deadline=None)
@given(rates, st.lists(st.integers(0, 8), min_size=8, max_size=8), st.integers(1, 16), st.floats(0, 2))
def test_counts_stay_within_caps_and_favour_likelier_requests(rs, caps, rows, slope):
    caps = caps[: len(rs)]
    counts = plan_drafts(rs, caps, rows, lambda n: 1.0 + slope * n)
    assert all(0 <= c <= cap for c, cap in zip(counts, caps))
    for i, j in [(i, j) for i in range(len(rs)) for j in range(len(rs))]:
        if rs[i] > rs[j] and counts[j] > 0 and counts[i] < caps[i]:
            assert rs[i] ** (counts[i] + 1) <= rs[j] ** counts[j] + 1e-12  # j's last draft beat i's next one


def test_step_costs_skip_the_first_of_each_count_and_interpolate():
    costs = StepCosts()
    assert costs(4) is None
    costs.record(1, 99.0)  # the first step of a row count may compile: not counted
    costs.record(1, 1.0)
    assert costs(1) == 1.0 and costs(7) == 1.0  # one count known: optimism, every count costs the same
    costs.record(5, 9.0)
    costs.record(5, 3.0)
    assert costs(5) == 3.0 and costs(3) == 2.0 and costs(9) == 5.0  # between, and past, along the slope


def test_acceptance_learns_and_drifts_back_when_idle():
    a = Acceptance()
    prior = a.rate
    for _ in range(10):
        a.update(4, 4)
    assert a.rate > 0.9
    for _ in range(20):
        a.update(4, 0)
    low = a.rate
    assert low < 0.2
    for _ in range(200):
        a.idle()
    assert abs(a.rate - prior) < abs(low - prior) / 10
