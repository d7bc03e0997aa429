"""Speculative verification keeps the target's output: greedy exactly, sampling in distribution.

Greedy is checked as a law (the output equals the target's greedy continuation, whatever the
draft). Sampling by chi-square tests over seeded draws: the first token and the pair of the
first two tokens come out distributed as the target's own distributions, for three
target/draft pairs; a verifier that draws from ``p`` instead of the residual after a rejection
(a classic mistake) fails the same test by a wide margin.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.stats import chisquare

from minillm.sampling.speculative import verify_greedy, verify_sampled

V = 5


def _dist(seed: int, sharp: float) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(torch.randn(V, generator=g, dtype=torch.float64) * sharp, dim=-1)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, V - 1), min_size=0, max_size=6), st.integers(0, 2**31 - 1))
def test_greedy_verification_is_the_targets_greedy_continuation(draft, seed):
    logits = torch.randn(len(draft) + 1, V, generator=torch.Generator().manual_seed(seed))
    out = verify_greedy(logits, draft)
    best = logits.argmax(-1).tolist()
    n = next((i for i, (d, b) in enumerate(zip(draft, best)) if d != b), len(draft))
    assert out == draft[:n] + [best[n]]


def _broken(target_probs, draft_probs, draft_tokens, generator=None):
    """The classic mistake: after a rejection, draw from p itself instead of the residual."""
    out = []
    for i, token in enumerate(draft_tokens):
        p, q = target_probs[i], draft_probs[i]
        if torch.rand((), generator=generator) * q[token] < p[token]:
            out.append(token)
            continue
        return out + [int(torch.multinomial(p, 1, generator=generator))]
    return out + [int(torch.multinomial(target_probs[-1], 1, generator=generator))]


def _first_two(verify, p1, p2, q1, q2, draws: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Counts of the first token, and of the first two when two came out, over ``draws`` runs."""
    g = torch.Generator().manual_seed(seed)
    first, pairs = torch.zeros(V), torch.zeros(V, V)
    for _ in range(draws):
        d1 = int(torch.multinomial(q1, 1, generator=g))
        d2 = int(torch.multinomial(q2, 1, generator=g))
        out = verify(torch.stack([p1, p2, p2]), torch.stack([q1, q2]), [d1, d2], g)
        first[out[0]] += 1
        if len(out) >= 2:
            pairs[out[0], out[1]] += 1
    return first, pairs


CONFIGS = {"close": (0.5, 0.7), "far": (2.0, 0.3), "sharp draft": (0.5, 3.0)}


@pytest.mark.parametrize("name", CONFIGS)
def test_sampled_tokens_keep_the_targets_distribution(name):
    sharp_p, sharp_q = CONFIGS[name]
    p1, p2, q1, q2 = _dist(1, sharp_p), _dist(2, sharp_p), _dist(3, sharp_q), _dist(4, sharp_q)
    first, pairs = _first_two(verify_sampled, p1, p2, q1, q2, draws=6000, seed=7)
    assert chisquare(first, 6000 * p1).pvalue > 0.01
    # given two tokens came out, the second is distributed as p2 whatever the first was
    for x in range(V):
        if pairs[x].sum() > 200:
            assert chisquare(pairs[x], pairs[x].sum() * p2).pvalue > 0.01 / V


def test_a_verifier_that_ignores_the_residual_is_caught():
    p1, p2, q1, q2 = _dist(1, 2.0), _dist(2, 2.0), _dist(3, 0.3), _dist(4, 0.3)
    first, _ = _first_two(_broken, p1, p2, q1, q2, draws=6000, seed=7)
    assert chisquare(first, 6000 * p1).pvalue < 1e-6


def test_a_one_hot_draft_accepts_with_the_targets_probability():
    """Prompt lookup proposes deterministically: q is one-hot, so d is kept with probability p(d)."""
    p = torch.stack([_dist(5, 1.0), _dist(6, 1.0)])
    q = torch.zeros(1, V, dtype=torch.float64)
    q[0, 2] = 1.0
    g = torch.Generator().manual_seed(0)
    kept = sum(verify_sampled(p, q, [2], g)[0] == 2 for _ in range(4000))
    assert chisquare([kept, 4000 - kept], [4000 * p[0, 2].item(), 4000 * (1 - p[0, 2].item())]).pvalue > 0.01


@pytest.mark.parametrize("shape, draft", [((3, V), [1]), ((2, V), [1, 2])])
def test_shapes_are_checked(shape, draft):
    with pytest.raises(ValueError, match="one per draft token"):
        verify_greedy(torch.zeros(shape), draft)


def test_every_output_length_is_between_one_and_k_plus_one():
    g = torch.Generator().manual_seed(3)
    for k, _ in itertools.product(range(5), range(20)):
        p = torch.softmax(torch.randn(k + 1, V, generator=g), -1)
        q = torch.softmax(torch.randn(k, V, generator=g), -1)
        draft = [int(torch.multinomial(q[i], 1, generator=g)) for i in range(k)]
        assert 1 <= len(verify_sampled(p, q, draft, g)) <= k + 1
