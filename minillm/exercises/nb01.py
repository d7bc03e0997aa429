"""Exercises of notebook 01 (BPE from scratch): UTF-8 lengths, the incremental merge update,
a token's bytes from the merges, and encoding by merge rank.

The expected answers come from the package where it has the piece (``minillm.train_bpe``'s
merges and vocabulary, ``Tokenizer.encode``, the trainer's ``_merge``); each classic mistake is
written out as the function a learner would write (``merge_word``'s in ``nb01_mistakes``), so a
wrong answer of that kind is named.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable
from functools import cache
from typing import Any

from minillm.assets import corpus_path
from minillm.exercises import Mistake, check, nb01_mistakes
from minillm.exercises.nb01_mistakes import Delta, Pair, delta_of, sites, without_zeros
from minillm.tokenizer import PreTokenizer, Tokenizer, train_bpe
from minillm.tokenizer.train import _merge, count_chunks
MergeWordFn = Callable[[list[int], int, Pair, int], tuple[list[int], Delta]]


@cache
def _trained() -> Tokenizer:
    """A small tokenizer trained by the package on a slice of the course's corpus (~0.3 s)."""
    return train_bpe(_training_text(), 256 + 120, progress=False)


@cache
def _training_text() -> str:
    return corpus_path().read_text(encoding="utf-8")[200_000:230_000]


# --- exercise 1: utf8_len ------------------------------------------------------------------------


def _utf8_cases() -> list[tuple[tuple[str], int]]:
    family = "\U0001f468\u200d\U0001f469\u200d\U0001f467\u200d\U0001f466"  # 7 code points, 25 bytes
    texts = ["hello", "café", "苹果手机很好用", family, "", "\x7f\x80\u07ff\u0800\uffff\U00010000"]
    return [((s,), len(s.encode("utf-8"))) for s in texts]


def _utf8_one_per_char(s: str) -> int:
    return len(s)


def _utf8_no_four_bytes(s: str) -> int:
    return sum(1 if ord(c) < 0x80 else 2 if ord(c) < 0x800 else 3 for c in s)


def _utf8_off_by_one(s: str) -> int:
    return sum(1 if ord(c) <= 0x80 else 2 if ord(c) <= 0x800 else 3 if ord(c) <= 0x10000 else 4 for c in s)


UTF8_MISTAKES = [
    Mistake(_utf8_one_per_char, "that is the number of code points (len(s)); UTF-8 spends 1 to 4 bytes on each."),
    Mistake(_utf8_no_four_bytes, "characters above U+FFFF (emoji, 😀 = U+1F600) take 4 bytes, not 3."),
    Mistake(
        _utf8_off_by_one,
        "the limits are exclusive: U+0080 already needs 2 bytes, U+0800 3 and U+10000 4 (use <, not <=).",
    ),
]

UTF8_HINTS = [
    "The number of bytes depends only on the code point, ord(c): count each character and add up.",
    "1 byte below U+0080 (ASCII), 2 below U+0800, 3 below U+10000, 4 above.",
    "sum(1 if ord(c) < 0x80 else 2 if ord(c) < 0x800 else 3 if ord(c) < 0x10000 else 4 for c in s)",
]


def check_utf8_len(fn: Callable[[str], int], hint: int = 0) -> bool:
    """``fn(s)`` -> the number of UTF-8 bytes of ``s``, computed from its code points."""
    return check("utf8_len", fn, _utf8_cases(), hint=hint, hints=UTF8_HINTS, mistakes=UTF8_MISTAKES)


# --- exercise 2: merge_word, the incremental merge update ----------------------------------------


def _merge_word_cases() -> list[tuple[tuple[list[int], int, Pair, int], tuple[list[int], Delta]]]:
    a = 97
    inputs: list[tuple[list[int], int, Pair, int]] = [
        ([1, 2, 3, 4], 1, (2, 3), 9),  # one site with a neighbour on each side
        ([2, 3, 1, 2, 3], 1, (2, 3), 9),  # sites at both ends
        ([5, 2, 3, 6], 7, (2, 3), 9),  # the word occurs 7 times in the corpus
        ([1, 2, 1, 2], 1, (1, 2), 9),  # two sites share a neighbour pair
        ([a, a, a], 1, (a, a), 256),  # overlapping: replaced once, left to right
        ([a, a, a, a], 3, (a, a), 256),
        ([a, a, a, a, a], 1, (a, a), 256),
        (list(" hello".encode()), 4, (108, 108), 300),
        (list(" unmannerly".encode()), 2, (110, 110), 300),  # one site, far from both ends
        ([4, 5, 6], 2, (7, 8), 9),  # the pair is not in the word: nothing changes
    ]
    cases = []
    for word, freq, pair, new_id in inputs:
        merged = _merge(word, pair, new_id)  # the package's merge: left to right, no overlaps
        cases.append(((word, freq, pair, new_id), (merged, delta_of(word, merged, freq))))
    return cases


MERGE_WORD_MISTAKES = [
    Mistake(
        nb01_mistakes.neighbours_from_original,
        "you read the neighbours from the original word. Two merge sites can share a neighbour: in "
        "[a, a, a, a] (or [x, y, x, y] merging (x, y)) the second site's left neighbour is the *new* token "
        "of the first site. Take the left neighbour from the merged word you are building (out[-1]).",
    ),
    Mistake(
        nb01_mistakes.no_neighbour_decrement,
        "the neighbours' old pairs are not decremented: merging (a, b) in [x, a, b, y] removes (x, a) and "
        "(b, y) as well as (a, b).",
    ),
    Mistake(nb01_mistakes.no_new_pairs,
            "the new pairs are never added: [x, a, b, y] -> [x, N, y] creates (x, N) and (N, y)."),
    Mistake(
        nb01_mistakes.unweighted,
        "each change must be multiplied by freq: the word stands for freq identical chunks of the corpus.",
    ),
    Mistake(
        nb01_mistakes.merged_pair_left_out,
        "the merged pair's own count must drop too (by freq for every occurrence replaced). HF tokenizers' "
        "Word::merge leaves that to its trainer; here delta includes it.",
    ),
    Mistake(
        nb01_mistakes.counted_as_sets,
        "a pair that occurs twice in a word counts twice: count with a Counter over zip(word, word[1:]), "
        "not with a set.",
    ),
    Mistake(
        nb01_mistakes.right_to_left,
        "merge left to right, as training does: [a, a, a] with (a, a) becomes [N, a], not [a, N].",
    ),
]

MERGE_WORD_HINTS = [
    "Walk the word left to right as merge() does, building the merged word in a list `out`. Only the pairs "
    "around each merge site change.",
    "At a site (word[i], word[i+1]) == pair: the pair loses freq; if out is not empty, (out[-1], word[i]) loses "
    "freq and (out[-1], new_id) gains it; if i + 2 < len(word), (word[i+1], word[i+2]) loses freq and "
    "(new_id, word[i+2]) gains it. out[-1] (not word[i-1]) is what makes overlapping sites right.",
    "out, delta, i = [], defaultdict(int), 0; while i < len(word): if i + 1 < len(word) and "
    "(word[i], word[i+1]) == pair: [the five updates above]; out.append(new_id); i += 2; else: "
    "out.append(word[i]); i += 1. Return out, dict(delta) (zero entries may stay).",
]


def _normalised(fn: MergeWordFn) -> Callable[..., Any]:
    """``fn`` with zero changes dropped from its delta (the learner may keep them), else as returned."""

    def merge_word(word: list[int], freq: int, pair: Pair, new_id: int) -> Any:
        result = fn(list(word), freq, pair, new_id)
        if isinstance(result, tuple) and len(result) == 2 and hasattr(result[1], "items"):
            merged, delta = result
            return merged, without_zeros(dict(delta))
        return result

    merge_word.__name__ = getattr(fn, "__name__", "merge_word")
    return merge_word


class _Token(int):
    """A token id that counts how often it is hashed: as part of a pair that becomes a key of a
    dict, a Counter or a set, or is looked up in one. Equal to the int it stands for."""

    def __hash__(self) -> int:
        self.hashed = getattr(self, "hashed", 0) + 1
        return int.__hash__(self)


def _only_around_the_sites(fn: MergeWordFn) -> Callable[[Callable[..., Any], tuple[Any, ...]], str | None]:
    """A rule: ``fn`` looks up only the pairs around the merge sites, never one far from all of them.

    Only the pairs that hold a token of a merge site (positions s - 1 .. s + 2 for a site at s)
    change; a token two places away from every site is in no changed pair, so an incremental update
    never hashes it. A full recount (``Counter(zip(word, word[1:]))`` before and after, the code of
    section 5's trainer) hashes every pair of the word: its values are right, its work is not."""

    def rule(_: Callable[..., Any], args: tuple[Any, ...]) -> str | None:
        word, freq, pair, new_id = args
        tokens = [_Token(t) for t in word]
        near = {p for s in sites(word, pair) for p in range(s - 1, s + 3)}
        try:
            fn(list(tokens), freq, pair, new_id)
        except Exception:  # the values already passed; a rule only reports what it saw
            return None
        far = [i for i, t in enumerate(tokens) if i not in near and getattr(t, "hashed", 0)]
        if not far:
            return None
        where = f"merging {pair} in {list(word)}, it looked up a pair holding {word[far[0]]} at position {far[0]}"
        where += " (as a key of a dict, Counter or set)"
        where += ", which no merge site touches" if near else " (the pair is not in the word: nothing changes)"
        return (f"{where}: that is a full recount of the word's pairs (every old "
                "pair subtracted, every new one added, as section 5's trainer does). The exercise is the "
                "incremental update: walk the word once and change only the pairs around each merge site.")

    return rule


def train_with(merge_word: MergeWordFn, text: str, n_merges: int) -> list[Pair]:
    """Train ``n_merges`` merges, updating the pair counts only through ``merge_word``'s deltas.

    The same rules as ``minillm.train_bpe`` (GPT-2's regex, highest count first, ties to the
    smallest pair); it scans for the best pair instead of keeping a heap, which is slower but
    picks the same pair."""
    counts = count_chunks(text, PreTokenizer())
    words = [list(chunk.encode("utf-8")) for chunk in counts]
    freqs = list(counts.values())
    pair_counts: Counter[Pair] = Counter()
    for word, freq in zip(words, freqs):
        for pair in zip(word, word[1:]):
            pair_counts[pair] += freq
    merges: list[Pair] = []
    for new_id in range(256, 256 + n_merges):
        live = [p for p, c in pair_counts.items() if c > 0]
        if not live:
            break
        best = max(live, key=lambda p: (pair_counts[p], -p[0], -p[1]))
        merges.append(best)
        for w, word in enumerate(words):
            if best in zip(word, word[1:]):
                words[w], delta = merge_word(word, freqs[w], best, new_id)
                pair_counts.update(delta)
    return merges


TRAINING_TEXTS = ["aaaa aaa aaaaa banana bandana " * 3 + "low lower newest widest " * 4]


def check_merge_word(fn: MergeWordFn, hint: int = 0) -> bool:
    """``fn(word, freq, pair, new_id)`` -> ``(merged, delta)``; then the same function trains merges.

    ``merged`` is ``word`` with ``pair`` replaced by ``new_id`` (left to right, no overlaps);
    ``delta`` maps each pair whose count changes to the change, the word counting ``freq``
    times. The values must come from the incremental update: ``fn`` may look up only the pairs
    around the merge sites (a full recount of the word gives the same delta and is refused). Once
    the cases pass, a trainer that updates its counts only through ``fn`` must learn exactly
    ``minillm.train_bpe``'s merges."""
    learner = _normalised(fn)
    if not check("merge_word", learner, _merge_word_cases(), hint=hint, hints=MERGE_WORD_HINTS,
                 mistakes=MERGE_WORD_MISTAKES, rules=[_only_around_the_sites(fn)]):
        return False
    texts = [*TRAINING_TEXTS, _training_text()]
    cases = [((text, 120), train_bpe(text, 256 + 120, progress=False).merges) for text in texts]

    def train_with_your_merge_word(text: str, n_merges: int) -> list[Pair]:
        return train_with(learner, text, n_merges)

    return check("training with merge_word", train_with_your_merge_word, cases, hint=hint, hints=MERGE_WORD_HINTS)


# --- exercise 3: token_bytes ---------------------------------------------------------------------

THE_MERGES: list[Pair] = [(116, 104), (101, 32), (256, 257)]  # 'th', 'e ', 'th' + 'e '
PING_MERGES: list[Pair] = [(0xE8, 0x8B), (256, 0xB9)]  # the 3 UTF-8 bytes of 苹


def _token_bytes_cases() -> list[tuple[tuple[int, list[Pair]], bytes]]:
    cases: list[tuple[tuple[int, list[Pair]], bytes]] = [
        ((104, []), b"h"),
        ((256, THE_MERGES), b"th"),
        ((258, THE_MERGES), b"the "),
        ((257, PING_MERGES), "苹".encode("utf-8")),
    ]
    tok = _trained()
    longest = sorted(range(256, 256 + len(tok.merges)), key=lambda i: (-len(tok.vocab[i]), i))[:4]
    cases += [((i, tok.merges), tok.vocab[i]) for i in longest]
    return cases


def _token_bytes_swapped(token_id: int, merges: list[Pair]) -> bytes:
    if token_id < 256:
        return bytes([token_id])
    a, b = merges[token_id - 256]
    return _token_bytes_swapped(b, merges) + _token_bytes_swapped(a, merges)


TOKEN_BYTES_MISTAKES = [
    Mistake(
        _token_bytes_swapped, "the halves are joined in the wrong order: merge (a, b) stands for a's bytes, then b's."
    ),
]

TOKEN_BYTES_HINTS = [
    "An id below 256 is one byte; any other id is a merge of two earlier tokens.",
    "a, b = merges[token_id - 256], and the token's bytes are a's bytes followed by b's — each found the same way.",
    "return bytes([token_id]) if token_id < 256 else token_bytes(a, merges) + token_bytes(b, merges)",
]


def check_token_bytes(fn: Callable[[int, list[Pair]], bytes], hint: int = 0) -> bool:
    """``fn(token_id, merges)`` -> the bytes the token stands for (checked against ``train_bpe``'s vocab)."""
    return check("token_bytes", fn, _token_bytes_cases(), hint=hint, hints=TOKEN_BYTES_HINTS,
                 mistakes=TOKEN_BYTES_MISTAKES)


# --- exercise 4: encode_bytes --------------------------------------------------------------------


def _encode_cases() -> list[tuple[tuple[bytes, list[Pair]], list[int]]]:
    cases: list[tuple[tuple[bytes, list[Pair]], list[int]]] = [
        ((b"hello", []), [104, 101, 108, 108, 111]),
        ((b"abc", [(98, 99), (97, 98)]), [97, 256]),  # (b, c) has the lower rank
        ((b"hello", [(104, 101), (108, 108), (256, 108)]), [256, 257, 111]),
        ((b"aaa", [(97, 97)]), [256, 97]),
        ((b"aaaa", [(97, 97), (256, 256)]), [257]),
    ]
    tok = _trained()
    for chunk in [" question", " therefore", "Desdemona", " unmannerly"]:  # each is one pre-token chunk
        cases.append(((chunk.encode("utf-8"), tok.merges), tok.encode(chunk)))
    return cases


def _encode_with(pick: Callable[[list[Pair], dict[Pair, int]], Pair], rounds: float = math.inf,
                 merge: Callable[[list[int], Pair, int], list[int]] | None = None) -> Callable[[bytes, list[Pair]], list[int]]:
    """An encoder that merges the pair ``pick`` chooses among the known adjacent pairs, for at
    most ``rounds`` merges, with ``merge``: each classic mistake changes one of the three."""
    merge = merge or _merge

    def encode(data: bytes, merges: list[Pair]) -> list[int]:
        ranks = {pair: rank for rank, pair in enumerate(merges)}
        ids = list(data)
        done = 0
        while done < rounds:
            known = [pair for pair in zip(ids, ids[1:]) if pair in ranks]
            if not known:
                break
            best = pick(known, ranks)
            ids = merge(ids, best, 256 + ranks[best])
            done += 1
        return ids

    return encode


def _lowest_rank(known: list[Pair], ranks: dict[Pair, int]) -> Pair:
    return min(known, key=ranks.__getitem__)


def _merge_right_to_left(ids: list[int], pair: Pair, new_id: int) -> list[int]:
    return _merge(ids[::-1], (pair[1], pair[0]), new_id)[::-1]


_encode_leftmost = _encode_with(lambda known, ranks: known[0])
_encode_one_round = _encode_with(_lowest_rank, rounds=1)
_encode_right_to_left = _encode_with(_lowest_rank, merge=_merge_right_to_left)


ENCODE_MISTAKES = [
    Mistake(
        _encode_leftmost,
        "you merged the leftmost known pair; BPE applies the pair with the lowest rank (learned earliest) first, "
        "wherever it is: in b'abc' with merges [(b, c), (a, b)], (b, c) goes first.",
    ),
    Mistake(_encode_one_round, "you stopped after one merge: repeat until no adjacent pair is in merges."),
    Mistake(
        _encode_right_to_left, "replace occurrences left to right: b'aaa' with (a, a) is [256, 97], not [97, 256]."
    ),
]

ENCODE_HINTS = [
    "Start from list(data). Each round: find the adjacent pair with the smallest rank, merge it everywhere.",
    "ranks = {pair: r for r, pair in enumerate(merges)}; the pair to merge is min(pairs in ranks, key=ranks.get); "
    "it becomes id 256 + its rank.",
    "while True: known = [p for p in zip(ids, ids[1:]) if p in ranks]; if not known: return ids; "
    "p = min(known, key=ranks.get); ids = merge(ids, p, 256 + ranks[p])",
]


def check_encode_bytes(fn: Callable[[bytes, list[Pair]], list[int]], hint: int = 0) -> bool:
    """``fn(data, merges)`` -> BPE ids of one chunk's bytes (checked against ``Tokenizer.encode``)."""
    return check("encode_bytes", fn, _encode_cases(), hint=hint, hints=ENCODE_HINTS, mistakes=ENCODE_MISTAKES)
