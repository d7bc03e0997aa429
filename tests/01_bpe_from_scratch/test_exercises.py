"""Notebook 01's exercises: a right answer passes, each classic wrong answer fails with its message."""

from __future__ import annotations

from collections import Counter, defaultdict

import pytest

from minillm.exercises import nb01


def _merge(ids, pair, new_id):
    """Every non-overlapping occurrence of ``pair``, left to right, replaced by ``new_id``."""
    out, i = [], 0
    while i < len(ids):
        if i + 1 < len(ids) and (ids[i], ids[i + 1]) == pair:
            out.append(new_id)
            i += 2
        else:
            out.append(ids[i])
            i += 1
    return out


def _utf8_len(s):
    return sum(1 if ord(c) < 0x80 else 2 if ord(c) < 0x800 else 3 if ord(c) < 0x10000 else 4 for c in s)


def _merge_word_local(word, freq, pair, new_id):
    """The local update: only the pairs around each merge site change."""
    out, delta, i = [], defaultdict(int), 0
    while i < len(word):
        if i + 1 < len(word) and (word[i], word[i + 1]) == pair:
            delta[pair] -= freq
            if out:
                delta[(out[-1], word[i])] -= freq
                delta[(out[-1], new_id)] += freq
            if i + 2 < len(word):
                delta[(word[i + 1], word[i + 2])] -= freq
                delta[(new_id, word[i + 2])] += freq
            out.append(new_id)
            i += 2
        else:
            out.append(word[i])
            i += 1
    return out, dict(delta)


def _merge_word_recount(word, freq, pair, new_id):
    """Recounting the one word's pairs before and after is a right answer too."""
    merged = _merge(word, pair, new_id)
    delta = Counter()
    for p in zip(word, word[1:]):
        delta[p] -= freq
    for p in zip(merged, merged[1:]):
        delta[p] += freq
    return merged, delta


def _token_bytes(token_id, merges):
    if token_id < 256:
        return bytes([token_id])
    a, b = merges[token_id - 256]
    return _token_bytes(a, merges) + _token_bytes(b, merges)


def _encode_bytes(data, merges):
    ranks = {pair: rank for rank, pair in enumerate(merges)}
    ids = list(data)
    while True:
        known = [p for p in zip(ids, ids[1:]) if p in ranks]
        if not known:
            return ids
        best = min(known, key=ranks.get)
        ids = _merge(ids, best, 256 + ranks[best])


@pytest.mark.parametrize(
    "check, answer",
    [
        (nb01.check_utf8_len, _utf8_len),
        (nb01.check_merge_word, _merge_word_local),
        (nb01.check_merge_word, _merge_word_recount),
        (nb01.check_token_bytes, _token_bytes),
        (nb01.check_encode_bytes, _encode_bytes),
    ],
    ids=["utf8_len", "merge_word-local", "merge_word-recount", "token_bytes", "encode_bytes"],
)
def test_right_answers_pass(capsys, check, answer):
    assert check(answer) is True
    assert "❌" not in capsys.readouterr().out


def test_merge_word_passes_only_when_training_matches_train_bpe(capsys):
    assert nb01.check_merge_word(_merge_word_local) is True
    out = capsys.readouterr().out
    assert "✅ merge_word" in out and "✅ training with merge_word" in out


def _local_with_original_neighbours(word, freq, pair, new_id):
    """The classic overlap bug written as a learner would: word[i - 1] instead of out[-1]."""
    out, delta, i = [], defaultdict(int), 0
    while i < len(word):
        if i + 1 < len(word) and (word[i], word[i + 1]) == pair:
            delta[pair] -= freq
            if i > 0:
                delta[(word[i - 1], word[i])] -= freq
                delta[(word[i - 1], new_id)] += freq
            if i + 2 < len(word):
                delta[(word[i + 1], word[i + 2])] -= freq
                delta[(new_id, word[i + 2])] += freq
            out.append(new_id)
            i += 2
        else:
            out.append(word[i])
            i += 1
    return out, dict(delta)


def _local_without_neighbours(word, freq, pair, new_id):
    merged, delta = _merge_word_local(word, freq, pair, new_id)
    return merged, {p: d for p, d in delta.items() if d > 0 or p == pair}


def _local_unweighted(word, freq, pair, new_id):
    return _merge_word_local(word, 1, pair, new_id)


@pytest.mark.parametrize(
    "wrong, says",
    [
        (_local_with_original_neighbours, "read the neighbours from the original word"),
        (_local_without_neighbours, "neighbours' old pairs are not decremented"),
        (_local_unweighted, "multiplied by freq"),
        *[(m.wrong, m.message[:40]) for m in nb01.MERGE_WORD_MISTAKES],
    ],
    ids=["original-neighbours", "no-neighbour-decrement", "unweighted",
         *[m.wrong.__name__ for m in nb01.MERGE_WORD_MISTAKES]],
)
def test_merge_word_mistakes_are_named(capsys, wrong, says):
    assert nb01.check_merge_word(wrong) is False
    assert says in capsys.readouterr().out


@pytest.mark.parametrize(
    "check, mistakes",
    [
        (nb01.check_utf8_len, nb01.UTF8_MISTAKES),
        (nb01.check_token_bytes, nb01.TOKEN_BYTES_MISTAKES),
        (nb01.check_encode_bytes, nb01.ENCODE_MISTAKES),
    ],
    ids=["utf8_len", "token_bytes", "encode_bytes"],
)
def test_other_mistakes_are_named(capsys, check, mistakes):
    for mistake in mistakes:
        assert check(mistake.wrong) is False
        assert mistake.message in capsys.readouterr().out


def test_a_stub_is_not_attempted_and_hints_come_in_tiers(capsys):
    def stub(*args):
        raise NotImplementedError

    assert nb01.check_merge_word(stub) is False
    assert "not attempted yet" in capsys.readouterr().out
    nb01.check_merge_word(lambda *args: ([], {}), hint=3)
    out = capsys.readouterr().out
    assert "Hint 3/3" in out and "Stuck?" not in out
