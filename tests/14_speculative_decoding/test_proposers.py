"""Prompt lookup proposes what followed the last n-gram's most recent earlier occurrence."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from minillm.engine.proposers import prompt_lookup


def test_it_copies_what_followed_the_last_ngram():
    text = [5, 6, 7, 8, 9, 1, 2, 5, 6, 7]
    assert prompt_lookup(text, k=3) == [8, 9, 1]
    assert prompt_lookup(text, k=10) == [8, 9, 1, 2, 5, 6, 7]  # up to the end of the text


def test_the_longest_ngram_and_the_most_recent_occurrence_win():
    text = [1, 2, 3, 9, 2, 3, 4, 1, 2, 3]
    assert prompt_lookup(text, k=1, max_ngram=3) == [9]  # "1 2 3" matched at 0 beats "2 3" at 4
    assert prompt_lookup(text, k=1, max_ngram=2) == [4]  # "2 3": the later match, at 4


def test_no_match_proposes_nothing():
    assert prompt_lookup([1, 2, 3, 4], k=4) == []
    assert prompt_lookup([7], k=4) == []


@given(st.lists(st.integers(0, 4), max_size=40), st.integers(1, 6), st.integers(1, 4))
def test_a_proposal_is_a_continuation_that_occurs_in_the_text(tokens, k, max_ngram):
    proposal = prompt_lookup(tokens, k, max_ngram=max_ngram)
    assert len(proposal) <= k
    if proposal:  # some earlier n-gram equal to the tail is followed by exactly these tokens
        assert any(tokens[s:s + n] == tokens[-n:] and tokens[s + n:s + n + len(proposal)] == proposal
                   for n in range(1, max_ngram + 1) for s in range(len(tokens) - n))


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="k >= 1"):
        prompt_lookup([1, 2], k=0)
