"""Notebook 09's exercises: a right answer passes, each classic wrong answer fails with its message."""

from __future__ import annotations

import math

import pytest
import torch

from minillm.exercises import check, nb09
from minillm.exercises import nb09_mistakes as wrong
from minillm.sampling import MinP, TopK, TopP


def own(mistakes, says):
    """(wrong, says): the package's own wrong answer whose message says ``says``, found in its
    public list of classic mistakes (``nb09.TOP_P_MISTAKES`` ...)."""
    (found,) = [mistake.wrong for mistake in mistakes if says in mistake.message]
    return found, says


# --- temperature ---------------------------------------------------------------------------------


@pytest.mark.parametrize("right", [lambda s, t: s / t, lambda s, t: s * (1 / t), nb09.temperature_solution],
                         ids=["divide", "multiply-by-inverse", "solution"])
def test_nb09_temperature_right_answers_pass(capsys, right):
    assert nb09.check_temperature(right) is True


def _temperature_in_place(scores, t):
    return scores.div_(t)


@pytest.mark.parametrize(
    "wrong_fn, says",
    [
        own(nb09.TEMPERATURE_MISTAKES, "you multiplied by t"),
        own(nb09.TEMPERATURE_MISTAKES, "temperature applied after softmax"),
        own(nb09.TEMPERATURE_MISTAKES, "not probabilities"),
        (_temperature_in_place, "writes into the `scores`"),
    ],
    ids=["multiplies", "after-softmax", "probabilities", "in-place"],
)
def test_nb09_temperature_mistakes_are_named(capsys, wrong_fn, says):
    assert nb09.check_temperature(wrong_fn) is False
    assert says in capsys.readouterr().out


# --- top-k ---------------------------------------------------------------------------------------


def _top_k_sorted(scores, k):
    """Right, another way: the k-th largest from a descending sort, clamped."""
    kth = scores.sort(dim=-1, descending=True).values[..., min(k, scores.shape[-1]) - 1 :][..., :1]
    return scores.masked_fill(scores < kth, -math.inf)


def _top_k_unclamped(scores, k):
    kth = scores.topk(k, dim=-1).values[..., -1:]
    return scores.masked_fill(scores < kth, -math.inf)


def _top_k_in_place(scores, k):
    return scores.masked_fill_(scores < scores.topk(min(k, scores.shape[-1])).values[..., -1:], -math.inf)


@pytest.mark.parametrize("right", [nb09.top_k_filter_solution, _top_k_sorted, lambda s, k: TopK(k)(None, s)],
                         ids=["solution", "sorted", "package"])
def test_nb09_top_k_right_answers_pass(capsys, right):
    assert nb09.check_top_k(right) is True


@pytest.mark.parametrize(
    "wrong_fn, says",
    [
        own(nb09.TOP_K_MISTAKES, "you kept exactly k tokens"),
        own(nb09.TOP_K_MISTAKES, "the k-th token itself is gone"),
        own(nb09.TOP_K_MISTAKES, "one threshold for the whole batch"),
        own(nb09.TOP_K_MISTAKES, "the k *smallest*"),
        own(nb09.TOP_K_MISTAKES, "must become -inf, not 0"),
        (_top_k_unclamped, "is larger than the vocabulary (3): clamp it"),
        (_top_k_in_place, "writes into the `scores`"),
    ],
    ids=["exactly-k", "drops-kth", "one-threshold", "smallest", "zero-fill", "k-beyond-vocab", "in-place"],
)
def test_nb09_top_k_mistakes_are_named(capsys, wrong_fn, says):
    assert nb09.check_top_k(wrong_fn) is False
    assert says in capsys.readouterr().out


def test_nb09_top_k_cases_hold_ties_beyond_k():
    """The tie case keeps more than k tokens, which is what tells a value cut from a count."""
    (scores, k), want = nb09._top_k_cases()[1]
    assert int(want.isfinite().sum()) > k


# --- top-p ---------------------------------------------------------------------------------------


def _top_p_descending(scores, p):
    """The definition: walk down from the most likely token, keep while the mass before it is < p."""
    sorted_p, order = scores.softmax(-1).sort(dim=-1, descending=True)
    remove_sorted = sorted_p.cumsum(-1) - sorted_p >= p
    return scores.masked_fill(remove_sorted.scatter(-1, order, remove_sorted), -math.inf)


def _top_p_ascending(scores, p):
    """transformers' way: remove the tail whose cumulative mass is <= 1 - p."""
    ascending, order = scores.sort(dim=-1)
    remove_sorted = ascending.softmax(-1).cumsum(-1) <= 1 - p
    remove_sorted[..., -1:] = False
    return scores.masked_fill(remove_sorted.scatter(-1, order, remove_sorted), -math.inf)


def _top_p_other_tie(scores, p):
    """Right, but breaks ties at the boundary the other way round (a stable sort on the flipped row)."""
    return _top_p_descending(scores.flip(-1), p).flip(-1)


def _top_p_in_place(scores, p):
    return scores.masked_fill_(~_top_p_descending(scores, p).isfinite(), -math.inf)


@pytest.mark.parametrize("right", [_top_p_descending, _top_p_ascending, _top_p_other_tie, nb09.top_p_filter_solution],
                         ids=["descending", "ascending", "other-tie", "solution"])
def test_nb09_top_p_right_answers_pass(capsys, right):
    assert nb09.check_top_p(right) is True


@pytest.mark.parametrize(
    "wrong_fn, says",
    [
        own(nb09.TOP_P_MISTAKES, "the boundary token is missing"),
        own(nb09.TOP_P_MISTAKES, "walked up from the *least* likely"),
        own(nb09.TOP_P_MISTAKES, "p is a probability mass"),
        own(nb09.TOP_P_MISTAKES, "in vocabulary order"),
        own(nb09.TOP_P_MISTAKES, "kept every token tied with the boundary"),
        own(nb09.TOP_P_MISTAKES, "must become -inf, not 0"),
        own(nb09.TOP_P_MISTAKES, "not probabilities"),
        (_top_p_in_place, "writes into the `scores`"),
    ],
    ids=["drops-boundary", "ascending", "on-logits", "unsorted", "ties", "zero-fill", "probabilities", "in-place"],
)
def test_nb09_top_p_mistakes_are_named(capsys, wrong_fn, says):
    assert nb09.check_top_p(wrong_fn) is False
    assert says in capsys.readouterr().out


def test_nb09_top_p_cases_sit_far_from_rounding():
    """Every case keeps the same tokens whichever direction the sum runs (no knife-edge p)."""
    # (The cases are the module's private builder: the checker is their only public use, and it
    # says pass or fail, not why; these two tests check the expected answers themselves.)
    for (scores, p), want in nb09._top_p_cases():
        assert nb09.same_filter(_top_p_descending(scores, p), want)


def test_nb09_dropping_the_boundary_can_keep_nothing(capsys):
    scores = torch.tensor([[5.0, 1.0, 0.0]])
    drop_boundary, _ = own(nb09.TOP_P_MISTAKES, "the boundary token is missing")
    assert not drop_boundary(scores, 0.9).isfinite().any()
    assert nb09._top_p_cases()[2][1].isfinite().sum() == 1  # the package keeps the one confident token


def test_nb09_top_p_of_one_keeps_every_finite_token():
    for (scores, p), want in nb09._top_p_cases():
        if p == 1.0:
            assert torch.equal(want.isfinite(), scores.isfinite()) and torch.equal(want, TopP(1.0)(None, scores))


# --- min-p ---------------------------------------------------------------------------------------


def _min_p_log_space(scores, p):
    """Right, another way: p_i >= p * p_max  <=>  z_i >= z_max + log p (the softmax's normaliser cancels)."""
    return scores.masked_fill(scores < scores.amax(dim=-1, keepdim=True) + math.log(p) if p > 0 else
                              torch.zeros_like(scores, dtype=torch.bool), -math.inf)


def _min_p_in_place(scores, p):
    probs = scores.softmax(-1)
    return scores.masked_fill_(probs < p * probs.amax(dim=-1, keepdim=True), -math.inf)


@pytest.mark.parametrize("right", [nb09.min_p_filter_solution, _min_p_log_space, lambda s, p: MinP(p)(None, s)],
                         ids=["solution", "log-space", "package"])
def test_nb09_min_p_right_answers_pass(capsys, right):
    assert nb09.check_min_p(right) is True


@pytest.mark.parametrize(
    "wrong_fn, says",
    [
        own(nb09.MIN_P_MISTAKES, "min-p relative to the wrong max"),
        own(nb09.MIN_P_MISTAKES, "min_p is relative"),
        own(nb09.MIN_P_MISTAKES, "compare probabilities, not logits"),
        own(nb09.MIN_P_MISTAKES, "a token exactly at the cut stays"),
        own(nb09.MIN_P_MISTAKES, "must become -inf, not 0"),
        (_min_p_in_place, "writes into the `scores`"),
    ],
    ids=["global-max", "absolute", "on-logits", "at-threshold", "zero-fill", "in-place"],
)
def test_nb09_min_p_mistakes_are_named(capsys, wrong_fn, says):
    assert nb09.check_min_p(wrong_fn) is False
    assert says in capsys.readouterr().out


def test_equal_infinities_are_no_difference(capsys):
    got = torch.tensor([-math.inf, 1.0, -math.inf])
    assert check("f", lambda: got, [((), torch.tensor([-math.inf, 2.0, -math.inf]))]) is False
    assert "max |difference| 1 at index (1,)" in capsys.readouterr().out
    assert check("f", lambda: got, [((), torch.tensor([0.5, 1.0, -math.inf]))]) is False
    assert "max |difference| inf at index (0,) (got -inf, expected 0.5); 1 of 3 entries differ" in capsys.readouterr().out


# --- the repetition penalty ----------------------------------------------------------------------


def _penalty_right(scores, prompt_ids, output_ids, penalty):
    index = torch.tensor(sorted(set(prompt_ids + output_ids)), dtype=torch.long)
    seen = scores[index]
    new = scores.clone()
    new[index] = torch.where(seen < 0, seen * penalty, seen / penalty)
    return new


def _penalty_in_place(scores, prompt_ids, output_ids, penalty):
    index = torch.tensor(sorted(set(prompt_ids + output_ids)), dtype=torch.long)
    seen = scores[index]
    scores[index] = torch.where(seen < 0, seen * penalty, seen / penalty)
    return scores


@pytest.mark.parametrize("right", [_penalty_right, nb09.repetition_penalty_solution], ids=["mine", "solution"])
def test_nb09_penalty_right_answer_passes(capsys, right):
    assert nb09.check_repetition_penalty(right) is True


@pytest.mark.parametrize(
    "wrong_fn, says",
    [
        own(nb09.PENALTY_MISTAKES, "the CTRL paper's original rule"),
        own(nb09.PENALTY_MISTAKES, "moves towards 0, i.e. UP"),
        own(nb09.PENALTY_MISTAKES, "the prompt's tokens are not penalized"),
        own(nb09.PENALTY_MISTAKES, "once per occurrence"),
        own(nb09.PENALTY_MISTAKES, "the signs are swapped"),
        (_penalty_in_place, "writes into the `scores`"),
    ],
    ids=["ctrl", "divides-negatives", "generated-only", "per-occurrence", "signs-swapped", "in-place"],
)
def test_nb09_penalty_mistakes_are_named(capsys, wrong_fn, says):
    assert nb09.check_repetition_penalty(wrong_fn) is False
    assert says in capsys.readouterr().out


# --- the batched sampler -------------------------------------------------------------------------


def _batch_with_own_filters(logits, params, generators):
    """Right, with the notebook's exercise solutions as the processors (top-p summed descending)."""
    tokens = []
    for row, (p, g) in enumerate(zip(params, generators)):
        if p.temperature == 0:
            tokens.append(int(logits[row].argmax()))
            continue
        scores = nb09.temperature_solution(logits[row : row + 1], p.temperature)
        for on, filt, value in [(p.top_k > 0, nb09.top_k_filter_solution, p.top_k),
                                (p.top_p < 1, nb09.top_p_filter_solution, p.top_p),
                                (p.min_p > 0, nb09.min_p_filter_solution, p.min_p)]:
            scores = filt(scores, value) if on else scores
        tokens.append(int(torch.multinomial(scores.softmax(-1)[0], 1, generator=g)))
    return torch.tensor(tokens)


@pytest.mark.parametrize("right", [nb09.sample_batch_solution, _batch_with_own_filters, wrong.batch_right],
                         ids=["solution", "own-filters", "helper"])
def test_nb09_sample_batch_right_answers_pass(capsys, right):
    assert nb09.check_sample_batch(right) is True


def _batch_reseeds_each_call(logits, params, generators):
    """Builds a fresh generator from a fixed seed inside: the draws ignore the rows' generators."""
    return wrong.batch_right(logits, params, [torch.Generator().manual_seed(0) for _ in params])


@pytest.mark.parametrize(
    "wrong_fn, says",
    [
        (wrong.batch_shared_generator, "one generator shared by all rows"),
        (wrong.batch_one_multinomial, "one generator shared by all rows"),
        (wrong.batch_greedy_sampled, "greedy rows were sampled"),
        (wrong.batch_first_row_params, "every row used params[0]"),
        (wrong.batch_groups_concatenated, "concatenated the groups"),
        (wrong.batch_temperature_after_softmax, "the temperature did nothing"),
        (wrong.batch_filters_before_temperature, "your filters ran before the temperature"),
        (wrong.batch_softmax_twice, "you softmaxed twice"),
        (_batch_reseeds_each_call, "❌ sample_batch"),
        (lambda logits, params, generators: wrong.batch_right(logits, params, generators).tolist(),
         "expected a torch.Tensor, got a list"),
    ],
    ids=["shared-generator", "one-multinomial", "greedy-sampled", "first-row-params", "groups-concatenated",
         "temperature-after-softmax", "filters-before-temperature", "softmax-twice", "reseeded", "list"],
)
def test_nb09_sample_batch_mistakes_are_named(capsys, wrong_fn, says):
    assert nb09.check_sample_batch(wrong_fn) is False
    assert says in capsys.readouterr().out


def test_nb09_every_batch_mistake_is_in_the_list():
    """The messages the test above looks for are the module's own (no mistake is named only here)."""
    messages = " ".join(m.message for m in nb09.BATCH_MISTAKES)
    for says in ["one generator shared by all rows", "greedy rows were sampled", "every row used params[0]",
                 "concatenated the groups", "the temperature did nothing", "your filters ran before the temperature",
                 "you softmaxed twice"]:
        assert says in messages


# --- stop strings --------------------------------------------------------------------------------


def _cut_right(text, stops):
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return (text[: min(hits)], True) if hits else (text, False)


@pytest.mark.parametrize("right", [_cut_right, nb09.cut_at_stop_solution], ids=["mine", "solution"])
def test_nb09_stop_right_answer_passes(capsys, right):
    assert nb09.check_cut_at_stop(right) is True


@pytest.mark.parametrize(
    "wrong_fn, says",
    [
        own(nb09.STOP_MISTAKES, "cut *before* the stop string"),
        own(nb09.STOP_MISTAKES, "the *first* occurrence"),
        own(nb09.STOP_MISTAKES, "not the first one listed"),
        (lambda text, stops: [*_cut_right(text, stops)], "expected a tuple, got a list"),
    ],
    ids=["keeps-stop", "last-occurrence", "first-listed", "list"],
)
def test_nb09_stop_mistakes_are_named(capsys, wrong_fn, says):
    assert nb09.check_cut_at_stop(wrong_fn) is False
    assert says in capsys.readouterr().out


# --- one step of beam search ---------------------------------------------------------------------


def _beam_right(beam_scores, log_probs, num_beams):
    scores = log_probs + beam_scores[:, None]
    top, index = scores.flatten().topk(2 * num_beams)
    return [(*divmod(i, scores.shape[-1]), s) for s, i in zip(top.tolist(), index.tolist())]


@pytest.mark.parametrize("right", [_beam_right, nb09.beam_candidates_solution], ids=["mine", "solution"])
def test_nb09_beam_right_answer_passes(capsys, right):
    assert nb09.check_beam_candidates(right) is True


@pytest.mark.parametrize(
    "wrong_fn, says",
    [
        own(nb09.BEAM_MISTAKES, "2 × num_beams candidates"),
        own(nb09.BEAM_MISTAKES, "parent and token are swapped"),
        own(nb09.BEAM_MISTAKES, "add each beam's cumulative score"),
        own(nb09.BEAM_MISTAKES, "rank all beams' continuations together"),
    ],
    ids=["num-beams-only", "divmod-swapped", "no-beam-scores", "fixed-share"],
)
def test_nb09_beam_mistakes_are_named(capsys, wrong_fn, says):
    assert nb09.check_beam_candidates(wrong_fn) is False
    assert says in capsys.readouterr().out


@pytest.mark.parametrize("checker", [nb09.check_temperature, nb09.check_top_k, nb09.check_top_p, nb09.check_min_p,
                                     nb09.check_repetition_penalty, nb09.check_sample_batch, nb09.check_cut_at_stop,
                                     nb09.check_beam_candidates])
def test_nb09_stubs_wait_and_hints_come_in_three_tiers(capsys, checker):
    def stub(*args):
        raise NotImplementedError

    assert checker(stub) is False
    assert "not attempted yet" in capsys.readouterr().out
    assert checker(lambda *args: None, hint=3) is False
    out = capsys.readouterr().out
    assert "Hint 1/3" in out and "Hint 3/3" in out
