"""Notebook 13's exercises: the solutions pass, every classic mistake fails with the message naming it,
and an unfinished stub reports ⏳ without raising."""

from __future__ import annotations

import pytest

from minillm.exercises import nb13, nb13_mistakes as wrong

CHECKS = {
    "subset": (nb13.check_subset_construction, nb13.subset_construction_solution, nb13.SUBSET_MISTAKES),
    "allowed": (nb13.check_allowed_tokens, nb13.allowed_tokens_solution, nb13.ALLOWED_MISTAKES),
    "mask": (nb13.check_masked_probs, nb13.masked_probs_solution, nb13.MASK_MISTAKES),
}

NAMED = [
    ("subset", wrong.start_not_closed, "epsilon-closure of nfa.start"),
    ("subset", wrong.moves_not_closed, "after each byte move"),
    ("subset", wrong.closure_one_step, "only one epsilon move"),
    ("subset", wrong.accept_all_members, "*any* of its NFA states"),
    ("allowed", wrong.first_byte_only, "*first* byte fits"),
    ("allowed", wrong.only_completing, "viable *prefix*"),
    ("allowed", wrong.eos_never, "eos (end of sequence) is never"),
    ("allowed", wrong.eos_always, "allowed eos in every state"),
    ("allowed", wrong.characters_not_bytes, "characters (ord of each), not its bytes"),
    ("mask", wrong.mask_after_softmax, "without renormalising"),
    ("mask", wrong.mask_with_zero, "not -inf"),
    ("mask", wrong.mask_after_top_k, "masked after top-k"),
]


@pytest.mark.parametrize("name", CHECKS)
def test_the_solution_passes(name, capsys):
    check, solution, _ = CHECKS[name]
    assert check(solution)
    assert "✅" in capsys.readouterr().out


def test_every_mistake_is_fed():
    fed = {id(fn) for _, fn, _ in NAMED}
    for name, (_, _, mistakes) in CHECKS.items():
        for m in mistakes:
            inner = getattr(m.wrong, "__name__", "")
            assert id(m.wrong) in fed or inner in {fn.__name__ for _, fn, _ in NAMED}, (name, inner)


@pytest.mark.parametrize("name, fn, words", NAMED, ids=[fn.__name__ for _, fn, _ in NAMED])
def test_a_classic_mistake_is_named(name, fn, words, capsys):
    check = CHECKS[name][0]
    assert not check(fn)
    out = capsys.readouterr().out
    assert "❌" in out and "🔎" in out and words in out, out


def test_a_learner_variant_of_the_byte_mistake_is_named(capsys):
    """Written independently of nb13_mistakes: walking str(ch) code points through dfa.step."""
    def allowed(dfa, state, vocab, eos_id):
        out = []
        for i, data in vocab.items():
            s = state
            for ch in data.decode("utf-8", errors="replace"):
                s = dfa.step(s, ord(ch) % 256)
            if s:
                out.append(i)
        return sorted(out + ([eos_id] if dfa.accepting[state] else []))
    assert not nb13.check_allowed_tokens(allowed)
    assert "not its bytes" in capsys.readouterr().out


@pytest.mark.parametrize("name", CHECKS)
def test_an_unfinished_stub_waits(name, capsys):
    def stub(*args):
        raise NotImplementedError
    assert not CHECKS[name][0](stub)
    assert "⏳" in capsys.readouterr().out


@pytest.mark.parametrize("name", CHECKS)
def test_hints_are_tiered(name, capsys):
    def broken(*args):
        raise ValueError("oops")
    CHECKS[name][0](broken, hint=3)
    assert "Hint 3/3" in capsys.readouterr().out
