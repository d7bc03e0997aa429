"""Notebook 09's exercises: a right answer passes, each classic wrong answer fails with its message."""

from __future__ import annotations

import math

import pytest
import torch

from minillm.exercises import check, nb09


def own(mistakes, says):
    """(wrong, says): the package's own wrong answer whose message says ``says``, found in its
    public list of classic mistakes (``nb09.TOP_P_MISTAKES`` ...)."""
    (wrong,) = [mistake.wrong for mistake in mistakes if says in mistake.message]
    return wrong, says


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


@pytest.mark.parametrize("right", [_top_p_descending, _top_p_ascending, _top_p_other_tie], ids=["descending", "ascending", "other-tie"])
def test_nb09_top_p_right_answers_pass(capsys, right):
    assert nb09.check_top_p(right) is True


@pytest.mark.parametrize(
    "wrong, says",
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
def test_nb09_top_p_mistakes_are_named(capsys, wrong, says):
    assert nb09.check_top_p(wrong) is False
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


def test_nb09_penalty_right_answer_passes(capsys):
    assert nb09.check_repetition_penalty(_penalty_right) is True


@pytest.mark.parametrize(
    "wrong, says",
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
def test_nb09_penalty_mistakes_are_named(capsys, wrong, says):
    assert nb09.check_repetition_penalty(wrong) is False
    assert says in capsys.readouterr().out


# --- stop strings --------------------------------------------------------------------------------


def _cut_right(text, stops):
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return (text[: min(hits)], True) if hits else (text, False)


def test_nb09_stop_right_answer_passes(capsys):
    assert nb09.check_cut_at_stop(_cut_right) is True


@pytest.mark.parametrize(
    "wrong, says",
    [
        own(nb09.STOP_MISTAKES, "cut *before* the stop string"),
        own(nb09.STOP_MISTAKES, "the *first* occurrence"),
        own(nb09.STOP_MISTAKES, "not the first one listed"),
        (lambda text, stops: [*_cut_right(text, stops)], "expected a tuple, got a list"),
    ],
    ids=["keeps-stop", "last-occurrence", "first-listed", "list"],
)
def test_nb09_stop_mistakes_are_named(capsys, wrong, says):
    assert nb09.check_cut_at_stop(wrong) is False
    assert says in capsys.readouterr().out


# --- one step of beam search ---------------------------------------------------------------------


def _beam_right(beam_scores, log_probs, num_beams):
    scores = log_probs + beam_scores[:, None]
    top, index = scores.flatten().topk(2 * num_beams)
    return [(*divmod(i, scores.shape[-1]), s) for s, i in zip(top.tolist(), index.tolist())]


def test_nb09_beam_right_answer_passes(capsys):
    assert nb09.check_beam_candidates(_beam_right) is True


@pytest.mark.parametrize(
    "wrong, says",
    [
        own(nb09.BEAM_MISTAKES, "2 × num_beams candidates"),
        own(nb09.BEAM_MISTAKES, "parent and token are swapped"),
        own(nb09.BEAM_MISTAKES, "add each beam's cumulative score"),
        own(nb09.BEAM_MISTAKES, "rank all beams' continuations together"),
    ],
    ids=["num-beams-only", "divmod-swapped", "no-beam-scores", "fixed-share"],
)
def test_nb09_beam_mistakes_are_named(capsys, wrong, says):
    assert nb09.check_beam_candidates(wrong) is False
    assert says in capsys.readouterr().out


@pytest.mark.parametrize("checker", [nb09.check_top_p, nb09.check_repetition_penalty, nb09.check_cut_at_stop,
                                     nb09.check_beam_candidates])
def test_nb09_stubs_wait_and_hints_come_in_three_tiers(capsys, checker):
    def stub(*args):
        raise NotImplementedError

    assert checker(stub) is False
    assert "not attempted yet" in capsys.readouterr().out
    assert checker(lambda *args: None, hint=3) is False
    out = capsys.readouterr().out
    assert "Hint 1/3" in out and "Hint 3/3" in out
