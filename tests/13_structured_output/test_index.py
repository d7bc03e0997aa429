"""The token index (notebook 13, step 3): each state's allowed tokens and next states equal a
token-by-token walk of the DFA; special tokens never match and eos is allowed exactly in
accepting states; strings the pattern accepts tokenize into paths the index allows end to end,
and strings it rejects can never be produced; indexes are shared per pattern and vocabulary."""

from __future__ import annotations

import random
import re

import numpy as np
import pytest
from helpers.structured import distances_to_accept, sample_match, walk_tokens
from hypothesis import given, settings
from hypothesis import strategies as st

from minillm import Tokenizer
from minillm.assets import default_gguf_path
from minillm.structured import DEAD, TokenIndex, compile_regex, token_index, vocab_trie

HYPOTHESIS = settings(max_examples=60, deadline=None)
PATTERNS = [r"\d{3}-\d{4}", r"(red|green|blue)", r'"([^"\\]|\\.){0,8}"', r"[α-ω]+ ?", r"-?\d+(\.\d+)?",
            r"[a-z]+@[a-z]+\.(com|org)", r"(\w+ ){1,3}\w+\.", r"\{ ?\"id\": ?\d+ ?\}"]


def brute_force(index: TokenIndex, tokenizer, state: int) -> np.ndarray:
    """The next state of every token, one token at a time through ``DFA.walk``."""
    out = np.zeros(tokenizer.vocab_size, dtype=np.int64)
    special = set(tokenizer.special_tokens.values())
    for i, data in tokenizer.vocab.items():
        if i not in special and i not in index.eos_ids and data:
            out[i] = index.dfa.walk(data, state)
    if index.dfa.accepting[state]:
        out[index.eos_ids] = state
    return out


@pytest.mark.parametrize("pattern", PATTERNS)
def test_every_state_equals_the_token_by_token_walk(trained, pattern):
    """On the small trained vocabulary, every state reachable through tokens."""
    index = TokenIndex(compile_regex(pattern), vocab_trie(trained), [trained.eos_id])
    assert index.explore_all() > 1
    for state in range(1, index.dfa.n_states):
        assert np.array_equal(index.next_states(state), brute_force(index, trained, state)), state


@pytest.mark.parametrize("pattern", [r'"([^"\\]|\\.){0,8}"', r"[α-ω]+ ?", r"(\w+ ){1,3}\w+\."])
def test_smollm2_states_equal_the_token_by_token_walk(smol, pattern):
    index = token_index(pattern, smol)
    rng = random.Random(0)
    states = [index.start] + rng.sample(range(1, index.dfa.n_states), min(3, index.dfa.n_states - 1))
    for state in states:
        assert np.array_equal(index.next_states(state), brute_force(index, smol, state)), state


def test_special_tokens_never_match_and_eos_only_where_accepting(smol):
    index = token_index(r"[^\n]*", smol)  # "<|im_end|>" as text would match
    start = index.next_states(index.start)
    assert start[smol.eos_id] == index.start  # the empty output matches: eos may end it, state kept
    specials = [i for i in smol.special_tokens.values() if i != smol.eos_id]
    assert not start[specials].any()
    ab = token_index("ab", smol)
    assert ab.next_state(ab.start, smol.eos_id) == DEAD
    after = ab.dfa.walk(b"ab")
    assert ab.allowed_ids(after).tolist() == [smol.eos_id]


def test_eos_ids_can_be_chosen(smol):
    index = token_index("a", smol, eos_ids=[smol.eos_id, 0])
    end = index.dfa.walk(b"a")
    assert index.allowed_ids(end).tolist() == sorted({smol.eos_id, 0})


def test_ids_past_the_vocabulary_are_refused(trained):
    index = token_index("a+", trained)
    assert index.next_state(index.start, trained.vocab_size) == DEAD
    assert index.next_state(index.start, -1) == DEAD


def test_indexes_are_shared_per_pattern_and_vocabulary(smol):
    again = Tokenizer.from_file(default_gguf_path())  # another object, the same vocabulary
    assert vocab_trie(again).fingerprint == vocab_trie(smol).fingerprint
    assert token_index(r"\d+", again) is token_index(r"\d+", smol)
    assert token_index(r"\d+", smol, eos_ids=[0]) is not token_index(r"\d+", smol)
    assert token_index(r"\d+", smol) is not token_index(r"\d*", smol)


def test_states_are_explored_once(smol):
    index = TokenIndex(compile_regex(r"\d{1,3}"), vocab_trie(smol), [smol.eos_id])
    first = index.next_states(index.start)
    assert index.next_states(index.start) is first and index.explored == 1
    assert not first.flags.writeable  # shared by every request: nobody may write into it


def test_the_trie_shares_prefixes(smol):
    trie = vocab_trie(smol)
    total_bytes = sum(len(data) for i, data in smol.vocab.items() if i not in smol.special_tokens.values())
    assert len(trie.token_ids) == len(smol.vocab) - len(smol.special_tokens)
    assert trie.n_nodes < total_bytes / 3  # 330k bytes of tokens, ~100k distinct prefixes
    depth = np.zeros(trie.n_nodes, dtype=np.int64)
    for d, (lo, hi) in enumerate(zip(trie.levels[:-1], trie.levels[1:]), start=1):
        depth[lo:hi] = d
        assert (depth[trie.parent[lo:hi]] == d - 1).all()  # a node's parent is one level up


# --------------------------------------------------------------------------- the laws, on SmolLM2
def _encode(tokenizer, text: str) -> list[int] | None:
    ids = tokenizer.encode(text, parse_special=False)
    return ids if tokenizer.decode(ids) == text else None  # (SmolLM2 has no token for 21 control bytes)


@given(st.sampled_from(PATTERNS), st.randoms(use_true_random=False))
@HYPOTHESIS
def test_accepted_strings_tokenize_into_allowed_paths(smol, pattern, rng):
    """A string the DFA accepts, tokenized the way the model would see it: every token is
    allowed where it comes, the end is accepting, and eos is allowed there."""
    index = token_index(pattern, smol)
    text = sample_match(index.dfa, rng).decode("utf-8")
    assert re.fullmatch(pattern, text, re.ASCII)
    ids = _encode(smol, text)
    if ids is None:
        return
    state, refused = walk_tokens(index, ids)
    assert refused is None, (pattern, text, ids)
    assert index.is_accepting(state) and index.next_state(state, smol.eos_id) == state


@given(st.sampled_from(PATTERNS), st.text(alphabet="ab1-. \"\\éαω@{}:id", max_size=12))
@HYPOTHESIS
def test_rejected_strings_are_never_produced(smol, pattern, text):
    """A string ``re.fullmatch`` rejects: its tokens hit a refused token, or end where eos is
    not allowed: no constrained generation can output it."""
    if re.fullmatch(pattern, text, re.ASCII) or (ids := _encode(smol, text)) is None:
        return
    index = token_index(pattern, smol)
    state, refused = walk_tokens(index, ids)
    assert refused is not None or index.next_state(state, smol.eos_id) == DEAD


@pytest.mark.parametrize("fixture", ["smol", "gpt2", "trained"])
def test_every_vocabulary_reaches_the_end(request, fixture):
    """Walking only allowed tokens (seeded random choices, heading for the nearest accepting
    state after 60 tokens) never gets stuck, and the text it spells matches."""
    tokenizer = request.getfixturevalue(fixture)
    rng = random.Random(1)
    for pattern in PATTERNS:
        index = token_index(pattern, tokenizer)
        dist = distances_to_accept(index.dfa)
        for _ in range(5):
            state, ids = index.start, []
            while True:
                nxt = index.next_states(state)
                allowed = np.setdiff1d(np.flatnonzero(nxt), index.eos_ids)
                if index.is_accepting(state) and (not len(allowed) or rng.random() < 0.3 or len(ids) > 60):
                    break
                assert len(allowed), (pattern, tokenizer.decode(ids))  # a state that is not accepting continues
                if len(ids) > 60:
                    allowed = allowed[[np.argmin(dist[nxt[allowed]])]]
                ids.append(int(rng.choice(allowed)))
                state = int(nxt[ids[-1]])
                assert len(ids) < 400, pattern
            text = b"".join(tokenizer.vocab[i] for i in ids).decode("utf-8")
            assert re.fullmatch(pattern, text, re.ASCII), (pattern, text)
