"""The classic wrong answers to notebook 01's ``merge_word`` exercise, and what they share.

Each function is the code a learner would plausibly write, so ``nb01.check_merge_word`` can name
the mistake. Most give wrong values; ``full_recount`` gives the right ones by the wrong mechanism
(it recounts every pair of the word, the code of the notebook's section 5), and the check tells it
by the pairs it looks at (``nb01.only_around_the_sites``).
"""

from __future__ import annotations

from collections import Counter

from minillm.tokenizer.train import _merge

Pair = tuple[int, int]
Delta = dict[Pair, int]


def pair_counts(word: list[int]) -> Counter[Pair]:
    return Counter(zip(word, word[1:]))


def delta_of(word: list[int], merged: list[int], freq: int) -> Delta:
    """How each pair's count changes when ``word`` (seen ``freq`` times) becomes ``merged``.

    This is the definition of the update, not the package's code path: recount the word's pairs
    before and after, and keep what changed."""
    before, after = pair_counts(word), pair_counts(merged)
    return {p: freq * (after[p] - before[p]) for p in sorted(before | after) if after[p] != before[p]}


def sites(word: list[int], pair: Pair) -> list[int]:
    """Where ``pair`` is replaced, scanning left to right without overlaps."""
    found, i = [], 0
    while i + 1 < len(word):
        if (word[i], word[i + 1]) == pair:
            found.append(i)
            i += 2
        else:
            i += 1
    return found


def without_zeros(delta: dict[Pair, int]) -> Delta:
    return {p: d for p, d in sorted(delta.items()) if d}


def no_neighbour_decrement(word: list[int], freq: int, pair: Pair, new_id: int) -> tuple[list[int], Delta]:
    merged = _merge(word, pair, new_id)
    delta: Counter[Pair] = Counter({pair: -freq * len(sites(word, pair))})
    for p, c in pair_counts(merged).items():
        if new_id in p:
            delta[p] += freq * c
    return merged, without_zeros(delta)


def no_new_pairs(word: list[int], freq: int, pair: Pair, new_id: int) -> tuple[list[int], Delta]:
    merged = _merge(word, pair, new_id)
    return merged, {p: d for p, d in delta_of(word, merged, freq).items() if d < 0}


def neighbours_from_original(word: list[int], freq: int, pair: Pair, new_id: int) -> tuple[list[int], Delta]:
    delta: Counter[Pair] = Counter()
    for s in sites(word, pair):
        delta[pair] -= freq
        if s > 0:
            delta[(word[s - 1], word[s])] -= freq
            delta[(word[s - 1], new_id)] += freq
        if s + 2 < len(word):
            delta[(word[s + 1], word[s + 2])] -= freq
            delta[(new_id, word[s + 2])] += freq
    return _merge(word, pair, new_id), without_zeros(delta)


def unweighted(word: list[int], freq: int, pair: Pair, new_id: int) -> tuple[list[int], Delta]:
    merged = _merge(word, pair, new_id)
    return merged, delta_of(word, merged, 1)


def merged_pair_left_out(word: list[int], freq: int, pair: Pair, new_id: int) -> tuple[list[int], Delta]:
    merged = _merge(word, pair, new_id)
    delta = dict(delta_of(word, merged, freq))
    delta[pair] = delta.get(pair, 0) + freq * len(sites(word, pair))
    return merged, without_zeros(delta)


def counted_as_sets(word: list[int], freq: int, pair: Pair, new_id: int) -> tuple[list[int], Delta]:
    merged = _merge(word, pair, new_id)
    before, after = set(zip(word, word[1:])), set(zip(merged, merged[1:]))
    return merged, without_zeros({p: freq * ((p in after) - (p in before)) for p in before | after})


def right_to_left(word: list[int], freq: int, pair: Pair, new_id: int) -> tuple[list[int], Delta]:
    merged = _merge(word[::-1], pair[::-1], new_id)[::-1]
    return merged, delta_of(word, merged, freq)


def full_recount(word: list[int], freq: int, pair: Pair, new_id: int) -> tuple[list[int], Delta]:
    """Section 5's trainer, one chunk at a time: subtract every old pair, add every new one. The
    values are right (the unchanged pairs cancel out); the work is the whole word's, every time."""
    merged = _merge(word, pair, new_id)
    delta: Counter[Pair] = Counter()
    for p in zip(word, word[1:]):
        delta[p] -= freq
    for p in zip(merged, merged[1:]):
        delta[p] += freq
    return merged, dict(delta)
