"""Notebook 01's exercises: a right answer passes, each classic wrong answer fails with its message."""

from __future__ import annotations

from collections import Counter, defaultdict

import pytest

from minillm.exercises import nb01, nb01_mistakes


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


def _merge_word_local_counter(word, freq, pair, new_id):
    """The local update with a Counter for delta, and a scan by index: still only the sites' pairs."""
    out, delta = [], Counter()
    i = 0
    while i < len(word):
        if word[i : i + 2] == list(pair):
            delta.update({pair: -freq})
            if out:
                delta.update({(out[-1], word[i]): -freq, (out[-1], new_id): freq})
            if i + 2 < len(word):
                delta.update({(word[i + 1], word[i + 2]): -freq, (new_id, word[i + 2]): freq})
            out.append(new_id)
            i += 2
        else:
            out.append(word[i])
            i += 1
    return out, delta


def _merge_word_recount(word, freq, pair, new_id):
    """Section 5's trainer on one word: subtract every old pair, add every new one. Right values,
    the wrong mechanism (the exercise is the incremental update)."""
    merged = _merge(word, pair, new_id)
    delta = defaultdict(int)
    for p in zip(word, word[1:]):
        delta[p] -= freq
    for p in zip(merged, merged[1:]):
        delta[p] += freq
    return merged, dict(delta)


def _merge_word_counter_difference(word, freq, pair, new_id):
    """The recount written as the difference of two Counters, zeros dropped: the delta is exact."""
    merged = _merge(word, pair, new_id)
    before, after = Counter(zip(word, word[1:])), Counter(zip(merged, merged[1:]))
    return merged, {p: freq * (after[p] - before[p]) for p in before | after if after[p] != before[p]}


def _merge_word_set_guard(word, freq, pair, new_id):
    """The local update behind a whole-word membership test through a set: it hashes every pair."""
    if pair not in set(zip(word, word[1:])):
        return list(word), {}
    return _merge_word_local(word, freq, pair, new_id)


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
        (nb01.check_merge_word, _merge_word_local_counter),
        (nb01.check_token_bytes, _token_bytes),
        (nb01.check_encode_bytes, _encode_bytes),
    ],
    ids=["utf8_len", "merge_word-local", "merge_word-local-counter", "token_bytes", "encode_bytes"],
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
    "recount",
    [_merge_word_recount, _merge_word_counter_difference, _merge_word_set_guard, nb01_mistakes.full_recount],
    ids=["defaultdict", "counter-difference", "set-guard", "nb01_mistakes.full_recount"],
)
def test_a_full_recount_is_named_though_its_values_are_right(capsys, recount):
    assert nb01.check_merge_word(recount) is False
    out = capsys.readouterr().out
    assert "❌ merge_word: the values are right, but" in out
    assert "that is a full recount of the word's pairs" in out
    assert "training with merge_word" not in out  # it stops before training


def test_the_full_recount_gives_the_right_values():
    """What makes it a mechanism mistake: on every case its delta (zeros dropped) is the expected one."""
    learner = nb01._normalised(_merge_word_recount)
    for args, expected in nb01._merge_word_cases():
        assert learner(*args) == expected


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
