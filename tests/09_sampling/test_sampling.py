"""Sampling: each logits processor equals transformers' bit for bit (ties, -inf and extreme
logits included), the composed chain equals the one ``generate()`` builds, seeded draws follow
the filtered distribution (chi-square on the real model's next-token logits), and
``SamplingParams`` rejects every bad value by name."""

from __future__ import annotations

import math
import re
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.stats import chisquare
from transformers import GenerationConfig
from transformers.generation import logits_process as hf
from transformers.generation.utils import GenerationMixin

import minillm
from minillm.sampling import (
    NO_TOKEN,
    MinP,
    RepetitionPenalty,
    SamplingParams,
    SamplingState,
    Temperature,
    TopK,
    TopP,
    apply_processors,
    build_processors,
    filtered_distribution,
    make_generator,
    next_token,
    sample_batch,
)

INF = math.inf
HYPOTHESIS = settings(max_examples=150, deadline=None)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """These tensors are tiny (or one row of 49152): handing them to a thread pool costs more
    than the work, and on a busy machine the pool's spin-waits made this file ~3x slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# --------------------------------------------------------------------------- strategies
@st.composite
def logits_batches(draw, max_batch: int = 4, max_vocab: int = 32) -> torch.Tensor:
    """A float32 [batch, vocab] of logits of one of four kinds, optionally with -inf entries:
    'ties' (small integers, so many values are equal), 'normal', 'extreme' (magnitudes up to
    1e30) and 'dominant' (one logit far above the rest). Every row keeps a finite entry."""
    batch = draw(st.integers(1, max_batch))
    vocab = draw(st.integers(1, max_vocab))
    kind = draw(st.sampled_from(["ties", "normal", "extreme", "dominant"]))
    element = {
        "ties": st.integers(-3, 3).map(float),
        "normal": st.floats(-20, 20, width=32),
        "extreme": st.one_of(
            st.sampled_from([1e30, -1e30, 1e4, -1e4, 88.0, -104.0, 0.0, -0.0, 1e-30]),
            st.floats(-2.0**100, 2.0**100, width=32),
        ),
        "dominant": st.floats(-2, 2, width=32),
    }[kind]
    if draw(st.booleans()):
        element = st.one_of(element, st.just(-INF))
    values = torch.tensor(draw(st.lists(element, min_size=batch * vocab, max_size=batch * vocab)))
    scores = values.reshape(batch, vocab).float()
    if kind == "dominant":
        rows = torch.arange(batch)
        cols = torch.tensor(draw(st.lists(st.integers(0, vocab - 1), min_size=batch, max_size=batch)))
        scores[rows, cols] = draw(st.sampled_from([30.0, 60.0, 1e4]))
    all_inf = torch.isinf(scores).all(dim=-1)
    scores[all_inf, 0] = 0.0
    return scores


@st.composite
def histories(draw, batch: int, vocab: int) -> torch.Tensor:
    """input_ids [batch, seq] with repeats; a few ids >= vocab (embedding larger than the head)."""
    seq = draw(st.integers(0, 24))
    ids = draw(st.lists(st.integers(0, vocab + 2), min_size=batch * seq, max_size=batch * seq))
    return torch.tensor(ids, dtype=torch.long).reshape(batch, seq)


def probabilities(minimum: float = 0.0) -> st.SearchStrategy[float]:
    edges = [1.0, 0.5, 0.9, 0.95, 1e-9] + ([0.0] if minimum == 0.0 else [])
    return st.one_of(st.sampled_from(edges), st.floats(minimum, 1.0, exclude_min=minimum > 0))


def assert_same(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    """Bit-for-bit equality: the same -inf mask and the same values everywhere else."""
    assert torch.equal(torch.isneginf(ours), torch.isneginf(theirs)), "different tokens were filtered out"
    assert torch.equal(ours, theirs)


def check_processor(ours, theirs, input_ids: torch.Tensor, scores: torch.Tensor) -> None:
    before = scores.clone()
    out = ours(input_ids, scores)
    assert torch.equal(scores, before), "the processor modified its input in place"
    assert out.shape == scores.shape and out.dtype == scores.dtype
    assert_same(out, theirs(input_ids, scores.clone()))


# --------------------------------------------------------------------------- processors vs transformers
@HYPOTHESIS
@given(
    data=st.data(),
    scores=logits_batches(),
    penalty=st.one_of(st.sampled_from([1.0, 1.3, 0.7, 2.0]), st.floats(0.01, 10)),
)
def test_repetition_penalty_matches_transformers(data, scores, penalty):
    input_ids = data.draw(histories(scores.shape[0], scores.shape[1]))
    check_processor(RepetitionPenalty(penalty), hf.RepetitionPenaltyLogitsProcessor(penalty), input_ids, scores)


def test_repetition_penalty_semantics():
    scores = torch.tensor([[2.0, -2.0, 3.0, -1.0, 0.0]])
    out = RepetitionPenalty(2.0)(torch.tensor([[0, 1, 1, 1, 4, 7]]), scores)
    # seen: 0 (positive: halved), 1 (negative: doubled, once despite three occurrences), 4 (zero stays);
    # 2 and 3 unseen; 7 is outside the vocabulary and ignored.
    assert out.tolist() == [[1.0, -4.0, 3.0, -1.0, 0.0]]


@HYPOTHESIS
@given(scores=logits_batches(), temperature=st.one_of(st.sampled_from([1.0, 0.7, 1.3]), st.floats(0.05, 20)))
def test_temperature_matches_transformers(scores, temperature):
    ids = torch.zeros(scores.shape[0], 0, dtype=torch.long)
    check_processor(Temperature(temperature), hf.TemperatureLogitsWarper(temperature), ids, scores)


@HYPOTHESIS
@given(scores=logits_batches(), k=st.integers(1, 50), keep=st.integers(1, 4))
def test_top_k_matches_transformers(scores, k, keep):
    ids = torch.zeros(scores.shape[0], 0, dtype=torch.long)
    check_processor(TopK(k, keep), hf.TopKLogitsWarper(k, min_tokens_to_keep=keep), ids, scores)


@HYPOTHESIS
@given(scores=logits_batches(), p=probabilities(minimum=1e-12), keep=st.integers(1, 4))
def test_top_p_matches_transformers(scores, p, keep):
    ids = torch.zeros(scores.shape[0], 0, dtype=torch.long)
    check_processor(TopP(p, keep), hf.TopPLogitsWarper(p, min_tokens_to_keep=keep), ids, scores)


@HYPOTHESIS
@given(scores=logits_batches(), p=probabilities(), keep=st.integers(1, 4))
def test_min_p_matches_transformers(scores, p, keep):
    ids = torch.zeros(scores.shape[0], 0, dtype=torch.long)
    check_processor(MinP(p, keep), hf.MinPLogitsWarper(p, min_tokens_to_keep=keep), ids, scores)


def test_top_k_keeps_ties_with_the_kth():
    scores = torch.tensor([[3.0, 1.0, 2.0, 2.0, 0.0]])
    assert torch.isfinite(TopK(2)(None, scores)).tolist() == [[True, False, True, True, False]]


def test_top_p_keeps_the_boundary_token():
    # probabilities 0.5, 0.3, 0.2: the running total crosses 0.6 at the second token, which stays.
    scores = torch.tensor([[0.5, 0.3, 0.2]]).log()
    assert torch.isfinite(TopP(0.6)(None, scores)).tolist() == [[True, True, False]]
    # A single token above p is kept on its own (never an empty nucleus).
    assert torch.isfinite(TopP(0.4)(None, scores)).tolist() == [[True, False, False]]


def test_min_p_threshold_is_relative_to_the_top_token():
    scores = torch.tensor([[0.5, 0.3, 0.04, 0.16]]).log()
    assert torch.isfinite(MinP(0.1)(None, scores)).tolist() == [[True, True, False, True]]


# --------------------------------------------------------------------------- the composed chain
class _GenerateStub(GenerationMixin):
    """Just enough of a model for transformers' own ``_get_logits_processor`` to run."""

    config = SimpleNamespace(is_encoder_decoder=False)


def hf_processors(params: SamplingParams) -> hf.LogitsProcessorList:
    """The chain ``model.generate()`` would build for these settings."""
    options = {"do_sample": params.do_sample, "repetition_penalty": params.repetition_penalty}
    if params.do_sample:
        options |= {
            "temperature": params.temperature,
            "top_k": params.top_k or None,
            "top_p": params.top_p,
            "min_p": params.min_p or None,
        }
    return _GenerateStub()._get_logits_processor(GenerationConfig(**options), input_ids_seq_length=1, device="cpu")


HF_CLASS = {
    RepetitionPenalty: hf.RepetitionPenaltyLogitsProcessor,
    Temperature: hf.TemperatureLogitsWarper,
    TopK: hf.TopKLogitsWarper,
    TopP: hf.TopPLogitsWarper,
    MinP: hf.MinPLogitsWarper,
}

sampling_params = st.builds(
    SamplingParams,
    temperature=st.sampled_from([0.0, 0.3, 0.7, 1.0, 1.5]),
    top_k=st.sampled_from([0, 1, 3, 20]),
    top_p=st.sampled_from([1.0, 0.95, 0.8, 0.3]),
    min_p=st.sampled_from([0.0, 0.05, 0.3]),
    repetition_penalty=st.sampled_from([1.0, 1.3, 0.8]),
)


@HYPOTHESIS
@given(data=st.data(), scores=logits_batches(), params=sampling_params)
def test_pipeline_matches_transformers_generate(data, scores, params):
    input_ids = data.draw(histories(scores.shape[0], scores.shape[1]))
    ours, theirs = build_processors(params), hf_processors(params)
    assert [HF_CLASS[type(p)] for p in ours] == [type(p) for p in theirs]
    before = scores.clone()
    processed = apply_processors(ours, input_ids, scores)
    assert torch.equal(scores, before)
    assert_same(processed, theirs(input_ids, scores.clone()))
    # what next_token draws from, and the greedy pick
    reference = theirs(input_ids, scores.clone())
    probs = filtered_distribution(scores, input_ids, params)
    if params.is_greedy:
        assert torch.equal(next_token(scores, input_ids, params), reference.argmax(-1))
        assert torch.equal(probs.argmax(-1), reference.argmax(-1))
        assert torch.equal(probs.sum(-1), torch.ones(len(probs)))
    else:
        assert torch.equal(probs, reference.softmax(-1))


def test_build_processors_order_and_activity():
    params = SamplingParams(temperature=0.7, top_k=20, top_p=0.9, min_p=0.05, repetition_penalty=1.3)
    assert build_processors(params) == [RepetitionPenalty(1.3), Temperature(0.7), TopK(20), TopP(0.9), MinP(0.05)]
    assert build_processors(SamplingParams(temperature=1.0)) == []
    # greedy: the filters cannot change the argmax, only the repetition penalty can
    greedy = SamplingParams(temperature=0.0, top_k=5, top_p=0.5, repetition_penalty=1.2)
    assert build_processors(greedy) == [RepetitionPenalty(1.2)]


# --------------------------------------------------------------------------- decoding rules
def test_greedy_is_argmax():
    logits = torch.randn(8, 1000, generator=torch.Generator().manual_seed(0))
    ids = torch.zeros(8, 0, dtype=torch.long)
    params = SamplingParams(top_k=3, top_p=0.5)  # temperature 0: filters inactive
    assert params.is_greedy and not params.do_sample
    assert torch.equal(next_token(logits, ids, params), logits.argmax(-1))
    assert next_token(logits, ids, params).dtype == torch.long


def test_same_seed_same_draws_different_seed_different_draws():
    logits = torch.randn(64, 500, generator=torch.Generator().manual_seed(1))
    ids = torch.zeros(64, 0, dtype=torch.long)
    params = SamplingParams(temperature=1.0, top_p=0.95)

    def draws(seed):
        generator = make_generator(seed)
        return torch.stack([next_token(logits, ids, params, generator) for _ in range(3)])

    first = draws(7)
    assert first.shape == (3, 64) and first.dtype == torch.long
    assert torch.equal(first, draws(7))
    assert not torch.equal(first, draws(8))
    assert not torch.equal(first[0], first[1]), "the generator must advance between calls"
    assert make_generator(None) is None


def test_next_token_rejects_bad_shapes_and_beams():
    logits = torch.zeros(2, 10)
    with pytest.raises(ValueError, match="logits"):
        next_token(torch.zeros(10), torch.zeros(1, 0, dtype=torch.long), SamplingParams())
    with pytest.raises(ValueError, match="input_ids"):
        next_token(logits, torch.zeros(3, 1, dtype=torch.long), SamplingParams())
    with pytest.raises(ValueError, match="num_beams=4"):
        next_token(logits, torch.zeros(2, 1, dtype=torch.long), SamplingParams(num_beams=4))


# --------------------------------------------------------------------------- seeded draws on the real model
DRAWS = 600
CHUNK = 150  # rows per next_token call: one call, many independent draws
SAMPLING_CONFIGS = [
    {"temperature": 0.7, "top_k": 20},
    {"temperature": 1.0, "top_p": 0.9},
    {"temperature": 1.3, "min_p": 0.05},
    {"temperature": 1.0, "repetition_penalty": 1.3, "top_p": 0.8},
]


@pytest.fixture(scope="module")
def paris():
    """Real next-token logits [1, vocab] and the prompt ids [1, seq]."""
    model, tok = minillm.load_model(device="cpu")
    input_ids = torch.tensor([tok.encode("The best thing about Paris is")])
    with torch.no_grad():
        logits = model(input_ids, last_only=True)[:, -1]
    return logits, input_ids


def draw_counts(logits, input_ids, params: SamplingParams, seed: int) -> torch.Tensor:
    generator = make_generator(seed)
    draws = [
        next_token(logits.expand(CHUNK, -1), input_ids.expand(CHUNK, -1), params, generator)
        for _ in range(DRAWS // CHUNK)
    ]
    return torch.bincount(torch.cat(draws), minlength=logits.shape[-1])


def chi_square_p(counts: torch.Tensor, reference: torch.Tensor) -> float:
    """Goodness of fit of ``counts`` to ``reference`` probabilities, bins with expected < 5 pooled."""
    expected = reference.double() * counts.sum()
    big = expected >= 5
    assert big.sum() >= 3, "too few bins for the test to mean anything"
    f_obs = torch.cat([counts[big].double(), counts[~big].sum().double()[None]])
    f_exp = torch.cat([expected[big], expected[~big].sum()[None]])
    if f_exp[-1] < 5:  # the pooled bin is still small: fold it into the last big bin
        f_obs, f_exp = f_obs[:-1].clone(), f_exp[:-1].clone()
        f_obs[-1] += counts[~big].sum()
        f_exp[-1] += expected[~big].sum()
    f_exp *= f_obs.sum() / f_exp.sum()  # float rounding: chisquare wants equal totals
    return float(chisquare(f_obs.numpy(), f_exp.numpy()).pvalue)


@pytest.mark.parametrize("config", SAMPLING_CONFIGS, ids=lambda c: "+".join(f"{k}={v}" for k, v in c.items()))
def test_seeded_draws_follow_the_transformers_filtered_distribution(paris, config):
    logits, input_ids = paris
    params = SamplingParams(**config)
    reference = hf_processors(params)(input_ids, logits.clone()).softmax(-1)[0]
    counts = draw_counts(logits, input_ids, params, seed=1234)
    assert counts.sum() == DRAWS
    drawn = counts.nonzero().squeeze(-1)
    assert (reference[drawn] > 0).all(), f"drew filtered-out tokens {drawn[reference[drawn] == 0].tolist()}"
    assert chi_square_p(counts, reference) > 0.001


def test_chi_square_check_catches_a_wrong_distribution(paris):
    """The check above can fail: draws at temperature 1.0 do not pass for a 0.7 reference."""
    logits, input_ids = paris
    reference = hf_processors(SamplingParams(temperature=0.7, top_k=20))(input_ids, logits.clone()).softmax(-1)[0]
    counts = draw_counts(logits, input_ids, SamplingParams(temperature=1.0, top_k=20), seed=1234)
    assert chi_square_p(counts, reference) < 0.001


# --------------------------------------------------------------------------- SamplingParams
@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("temperature", -1),
        ("temperature", -1e-9),
        ("top_p", 0),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_p", -0.1),
        ("top_k", -1),
        ("min_p", -0.01),
        ("min_p", 1.01),
        ("max_new_tokens", -1),
        ("num_beams", 0),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", -1.0),
        ("repetition_penalty", 1e-300),  # logits / 1e-300 overflow to inf: every probability NaN
        ("repetition_penalty", 0.009),
        ("repetition_penalty", 1e300),
        ("length_penalty", 1e308),  # length ** 1e308 overflows a float
        ("length_penalty", -17.0),
        ("n", 0),
        ("n", 10**6),  # a million completions: hours of work for one call
        ("num_beams", 129),
        ("seed", -1),
        ("temperature", math.nan),
        ("top_p", math.nan),
        ("min_p", math.nan),
        ("repetition_penalty", math.nan),
        ("length_penalty", math.nan),
        ("temperature", math.inf),
    ],
)
def test_params_reject_bad_values_by_name(name, value):
    with pytest.raises(ValueError, match=f"^{name} must .*got {re.escape(str(value))}$"):
        SamplingParams(**{name: value})


@pytest.mark.parametrize(
    ("name", "value"),
    [("temperature", "0.7"), ("top_k", 2.5), ("top_k", True), ("max_new_tokens", None), ("n", "2"),
     ("seed", 1.0), ("top_p", None), ("ignore_eos", 1), ("stop", 3), ("stop", ["ok", 3])],
)
def test_params_reject_bad_types(name, value):
    with pytest.raises(TypeError, match=name.split("_")[0]):
        SamplingParams(**{name: value})


def test_params_normalise_and_flags():
    assert SamplingParams(stop="###").stop == ("###",)
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b")
    assert SamplingParams().stop == ()
    with pytest.raises(ValueError, match="stop strings must be non-empty"):
        SamplingParams(stop=["a", ""])
    params = SamplingParams(temperature=1, top_p=1)
    assert isinstance(params.temperature, float) and isinstance(params.top_p, float)
    assert params.do_sample and not params.is_greedy
    assert SamplingParams().is_greedy and not SamplingParams().do_sample
    beams = SamplingParams(num_beams=4, n=4)
    assert not beams.do_sample and not beams.is_greedy
    with pytest.raises(AttributeError):
        params.temperature = 0.5  # frozen
    assert SamplingParams(seed=2**64 - 1).seed == 2**64 - 1


@pytest.mark.parametrize("knob", [dict(temperature=0.7), dict(top_k=5), dict(top_p=0.9), dict(min_p=0.1)])
def test_beam_search_refuses_sampling_knobs_it_would_ignore(knob):
    name, value = next(iter(knob.items()))
    with pytest.raises(ValueError, match=f"beam search is deterministic: {name}={value}"):
        SamplingParams(num_beams=2, **knob)


def test_beam_search_refuses_more_completions_than_beams():
    with pytest.raises(ValueError, match="n=3 completions need at least as many beams, got num_beams=2"):
        SamplingParams(num_beams=2, n=3)


@pytest.mark.parametrize("temperature", [1e-40, 1e-300, 5e-324, 9.9e-6])
def test_vanishing_temperatures_decode_greedily_instead_of_overflowing(temperature):
    params = SamplingParams(temperature=temperature, seed=0)
    assert params.is_greedy and not params.do_sample
    logits = torch.tensor([[1.0, 3.0, 2.0, 3.0 - 1e-3]])
    assert next_token(logits, torch.zeros(1, 0, dtype=torch.long), params).tolist() == [1]


def test_processors_validate_their_arguments():
    for bad in [lambda: Temperature(0.0), lambda: TopK(0), lambda: TopP(0.0), lambda: TopP(1.1),
                lambda: MinP(-0.1), lambda: RepetitionPenalty(0.0), lambda: TopK(3, min_tokens_to_keep=0)]:
        with pytest.raises(ValueError):
            bad()


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 5), st.integers(1, 300), st.integers(0, 2**31 - 1), st.sampled_from(["random", "ties", "nan", "-inf"]))
def test_the_samplers_argmax_is_torch_argmax(rows, vocab, seed, kind):
    """The sampler's CPU argmax (NumPy's, vectorized) picks exactly torch.argmax's index: the
    first of tied maxima, the first NaN, index 0 of an all -inf row."""
    from minillm.sampling.sampler import argmax

    g = torch.Generator().manual_seed(seed)
    scores = torch.randn(rows, vocab, generator=g)
    if kind == "ties":
        scores = torch.randint(0, 3, (rows, vocab), generator=g).float()
    elif kind == "nan":
        scores[torch.rand(rows, vocab, generator=g) < 0.1] = float("nan")
    elif kind == "-inf":
        scores[torch.rand(rows, vocab, generator=g) < 0.7] = float("-inf")
        scores[0] = float("-inf")
    assert torch.equal(argmax(scores), scores.argmax(dim=-1))
    transposed_layout = scores.t().contiguous().t()  # the same values, column-major in memory
    assert torch.equal(argmax(transposed_layout), scores.argmax(dim=-1))


# ---------------------------------------------------------------------------- one bad row
ROW_PARAMS = [SamplingParams(), SamplingParams(temperature=0.8, seed=3), SamplingParams(temperature=1.0, top_k=5, seed=4),
              SamplingParams(temperature=0.7, top_p=0.9, min_p=0.05, seed=5), SamplingParams(repetition_penalty=1.3),
              SamplingParams(temperature=1.2, repetition_penalty=0.8, seed=6)]


def _states(params: list[SamplingParams], vocab: int) -> list[SamplingState]:
    return [SamplingState(p, [1, 2, 3], vocab, make_generator(p.seed)) for p in params]


@settings(max_examples=80, deadline=None)
@given(rows=st.lists(st.sampled_from(range(len(ROW_PARAMS))), min_size=1, max_size=8), data=st.data(),
       poison=st.sampled_from(["nan", "all -inf", "+inf", "nan everywhere"]))
def test_a_row_that_cannot_be_sampled_fails_alone(rows, data, poison):
    """A row whose logits hold NaN (or, sampled, no finite probability) gets NO_TOKEN and a reason;
    every other row draws exactly what it draws in a batch without the bad row."""
    vocab = 50
    params = [ROW_PARAMS[i] for i in rows]
    bad = data.draw(st.sets(st.integers(0, len(rows) - 1), max_size=len(rows)))
    logits = torch.randn(len(rows), vocab, generator=torch.Generator().manual_seed(len(rows)))
    for row in bad:
        if poison == "nan":
            logits[row, row % vocab] = math.nan
        elif poison == "nan everywhere":
            logits[row] = math.nan
        elif poison == "all -inf":
            logits[row] = -math.inf
        else:
            logits[row, 7] = math.inf
    states = _states(params, vocab)
    tokens = sample_batch(logits, states)
    good = [r for r in range(len(rows)) if r not in bad]
    alone = sample_batch(logits[good], _states([params[r] for r in good], vocab)) if good else torch.empty(0)
    assert tokens[good].tolist() == alone.tolist()
    for row in bad:
        greedy_and_finite = params[row].is_greedy and poison == "+inf"  # an argmax exists (all -inf: none does)
        if greedy_and_finite:
            assert tokens[row] != NO_TOKEN and states[row].error is None
        else:
            assert tokens[row] == NO_TOKEN
            assert "NaN" in states[row].error or "not finite" in states[row].error
    assert all(states[r].error is None for r in good)


def test_a_failed_row_draws_nothing_from_its_generator():
    """A seeded request whose row failed once keeps its random stream where it was."""
    params = SamplingParams(temperature=1.0, seed=11)
    logits = torch.randn(1, 30, generator=torch.Generator().manual_seed(0))
    state = SamplingState(params, [], 30, make_generator(params.seed))
    assert sample_batch(torch.full((1, 30), math.nan), [state]).item() == NO_TOKEN
    fresh = SamplingState(params, [], 30, make_generator(params.seed))
    assert sample_batch(logits, [state]).item() == sample_batch(logits, [fresh]).item()
