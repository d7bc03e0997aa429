"""The per-request grammar state and the batch mask (notebook 13, step 5): decoding random
logits through the mask always spells a match of the pattern; one call masks exactly the
constrained rows of a batch; the sampler's processors keep the masked tokens out; states
advance, refuse, finish, roll back and fork."""

from __future__ import annotations

import json
import math
import re

import numpy as np
import pytest
import torch

from minillm.sampling import SamplingParams, apply_processors, build_processors
from minillm.structured import GrammarState, apply_grammar, grammar_mask, schema_to_regex, token_index

PATTERNS = [r"\d{3}-\d{4}", r"(yes|no|maybe)", r"[α-ω]{1,4}!", r'"([^"\\]|\\.){0,6}"', r"-?\d+(\.\d{1,2})?"]


def decode_constrained(index, vocab: int, generator: torch.Generator, greedy: bool, limit: int = 80) -> list[int]:
    """Random logits, masked, then argmax or a draw, until eos (or ``limit`` tokens)."""
    state, ids = GrammarState(index), []
    while not state.finished and len(ids) < limit:
        logits = torch.randn(1, vocab, generator=generator) * 4
        scores = apply_grammar(logits, [0], [state])
        token = int(scores.argmax()) if greedy else int(torch.multinomial(scores.softmax(-1), 1, generator=generator))
        state.advance(token)
        ids.append(token)
    return ids


@pytest.mark.parametrize("greedy", [True, False], ids=["greedy", "sampled"])
@pytest.mark.parametrize("pattern", PATTERNS)
def test_decoding_random_logits_through_the_mask_spells_a_match(smol, pattern, greedy):
    index = token_index(pattern, smol)
    generator = torch.Generator().manual_seed(0)
    for _ in range(5):
        ids = decode_constrained(index, 49_216, generator, greedy)  # logits wider than the vocabulary
        assert ids[-1] == smol.eos_id, smol.decode(ids)
        text = smol.decode(ids[:-1])
        assert re.fullmatch(pattern, text, re.ASCII), text


def test_a_json_schema_decodes_to_valid_json(smol):
    schema = {"type": "object", "required": ["name", "n"], "properties": {
        "name": {"type": "string", "maxLength": 6}, "n": {"type": "integer"}, "ok": {"type": "boolean"}}}
    index = token_index(schema_to_regex(schema), smol)
    generator = torch.Generator().manual_seed(1)
    for _ in range(5):
        ids = decode_constrained(index, smol.vocab_size, generator, greedy=False, limit=200)
        assert ids[-1] == smol.eos_id
        value = json.loads(smol.decode(ids[:-1]))
        assert set(value) >= {"name", "n"} and isinstance(value["n"], int) and len(value["name"]) <= 6


def test_one_call_masks_exactly_the_constrained_rows(smol):
    digits, words = GrammarState(token_index(r"\d+", smol)), GrammarState(token_index(r"(yes|no)", smol))
    logits = torch.randn(4, smol.vocab_size + 64, generator=torch.Generator().manual_seed(2))
    before = logits.clone()
    out = apply_grammar(logits, [1, 3], [digits, words])
    assert torch.equal(logits, before)  # the input is not modified
    assert torch.equal(out[[0, 2]], logits[[0, 2]])  # free rows untouched, bit for bit
    for row, state in ((1, digits), (3, words)):
        allowed = torch.from_numpy(state.allowed().copy())  # (the index keeps its masks read-only)
        kept = torch.isfinite(out[row])
        assert torch.equal(kept[: smol.vocab_size], allowed) and not kept[smol.vocab_size :].any()
        assert torch.equal(out[row][kept], logits[row][kept])
    assert apply_grammar(logits, [], []) is logits


def test_the_mask_matches_the_index_and_pads_the_width(smol):
    state = GrammarState(token_index(r"[a-c]+", smol))
    mask = grammar_mask([state, state], smol.vocab_size + 10)
    assert mask.dtype == torch.bool and mask.shape == (2, smol.vocab_size + 10)
    assert torch.equal(mask[0, : smol.vocab_size], torch.from_numpy(state.index.allowed(state.state).copy()))
    assert not mask[:, smol.vocab_size :].any()


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.7, top_k=5), SamplingParams(temperature=1.3, top_p=0.9),
                                    SamplingParams(temperature=1.0, min_p=0.2, repetition_penalty=1.3)])
def test_the_processors_keep_masked_tokens_out(smol, params):
    """The mask goes first; temperature, top-k/p, min-p and the penalty keep -inf at -inf, so the
    filtered distribution gives disallowed tokens exactly 0."""
    state = GrammarState(token_index(r"(red|green|blue)", smol))
    logits = torch.randn(1, smol.vocab_size, generator=torch.Generator().manual_seed(3))
    history = torch.tensor([[smol.encode("red")[0], 5, 6]])
    scores = apply_processors(build_processors(params), history, apply_grammar(logits, [0], [state]))
    probs = scores.softmax(-1)[0]
    allowed = torch.from_numpy(state.allowed().copy())
    assert probs[~allowed].sum() == 0 and math.isclose(float(probs[allowed].sum()), 1.0, rel_tol=1e-5)


def test_advance_refuses_finishes_rolls_back_and_forks(smol):
    index = token_index(r"ab|ac", smol)
    state = GrammarState(index)
    a, b, c = (smol.encode(x)[0] for x in "abc")
    with pytest.raises(ValueError, match="not allowed"):
        state.advance(b)
    with pytest.raises(ValueError, match="not allowed"):
        state.advance(smol.eos_id)  # the empty output is not a match
    state.advance(a)
    fork = state.copy()
    state.advance(b)
    assert state.is_accepting and state.allowed_ids().tolist() == [smol.eos_id]
    assert not fork.is_accepting and set(fork.allowed_ids().tolist()) >= {b, c}
    state.advance(smol.eos_id)
    assert state.finished and state.allowed_ids().tolist() == [smol.eos_id]
    state.advance(smol.eos_id)  # (a finished row that is stepped again stays finished)
    with pytest.raises(ValueError, match="after the end"):
        state.advance(a)
    state.rollback(2)
    assert not state.finished and not state.is_accepting and state.state == fork.state
    with pytest.raises(ValueError, match="cannot roll back 5"):
        state.rollback(5)
    assert "GrammarState(state=" in repr(state)


def test_a_state_the_vocabulary_cannot_continue_is_a_dead_end(smol):
    """SmolLM2 has no token for the byte 0x04: after "a", a\\x04b cannot go on."""
    assert 4 in smol.missing_bytes
    state = GrammarState(token_index("a\x04b", smol))
    assert not state.is_dead_end
    state.advance(smol.encode("a")[0])
    assert state.is_dead_end and not state.allowed().any()
    assert np.isneginf(apply_grammar(torch.zeros(1, smol.vocab_size), [0], [state]).numpy()).all()
