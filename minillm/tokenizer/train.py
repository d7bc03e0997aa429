"""Training byte-level BPE: learn merges from a corpus, the incremental way.

The naive trainer recounts every adjacent pair in the corpus for every merge: O(merges x
corpus). This one counts once, then after each merge updates only the words that contained
the merged pair, and keeps candidate pairs in a max-heap (``heapq`` with negated counts).
Heap entries are never updated in place: a changed count is pushed again, and an entry whose
count no longer matches is skipped when popped ("lazy deletion").

Ties between equally frequent pairs go to the smallest pair of ids, so training is
deterministic.
"""

from __future__ import annotations

import heapq
from collections import Counter, defaultdict
from collections.abc import Iterable

import regex
from tqdm.auto import tqdm

from minillm.tokenizer.bpe import Pair, Tokenizer
from minillm.tokenizer.pretokenize import GPT2_PATTERN, PreTokenizer


def count_chunks(text: str, pretokenizer: PreTokenizer, special_tokens: Iterable[str] = ()) -> Counter[str]:
    """How often each pre-tokenized chunk occurs; special-token strings are cut out first."""
    specials = sorted(special_tokens, key=len, reverse=True)
    pieces = regex.split("|".join(regex.escape(s) for s in specials), text) if specials else [text]
    counts: Counter[str] = Counter()
    for piece in pieces:
        counts.update(pretokenizer.split(piece))
    return counts


def train_bpe(
    text: str,
    vocab_size: int,
    special_tokens: Iterable[str] = (),
    *,
    pattern: str = GPT2_PATTERN,
    progress: bool = True,
) -> Tokenizer:
    """Learn a byte-level BPE tokenizer of ``vocab_size`` tokens from ``text``.

    The vocabulary is the 256 bytes, then one token per merge, then the special tokens (so
    ``vocab_size = 256 + merges + len(special_tokens)``). Training stops early when no
    adjacent pair is left to merge, so a tiny corpus may give a smaller vocabulary.
    """
    if not isinstance(text, str):
        raise TypeError(f"train_bpe() expects the corpus as a str, got {type(text).__name__}")
    special_tokens = list(dict.fromkeys(special_tokens))
    for token in special_tokens:
        if not isinstance(token, str) or not token:
            raise ValueError(f"special tokens must be non-empty strings, got {token!r}")
    n_merges = vocab_size - 256 - len(special_tokens)
    if n_merges < 0:
        raise ValueError(
            f"vocab_size={vocab_size} is too small: it must hold the 256 byte tokens "
            f"and {len(special_tokens)} special tokens"
        )
    pretokenizer = PreTokenizer(pattern)
    counts = count_chunks(text, pretokenizer, special_tokens)
    words = [list(chunk.encode("utf-8")) for chunk in counts]
    freqs = list(counts.values())

    pair_counts: dict[Pair, int] = defaultdict(int)
    where: dict[Pair, set[int]] = defaultdict(set)  # pair -> indices of the words holding it
    for w, (word, freq) in enumerate(zip(words, freqs)):
        for pair in zip(word, word[1:]):
            pair_counts[pair] += freq
            where[pair].add(w)
    heap = [(-count, pair) for pair, count in pair_counts.items()]
    heapq.heapify(heap)

    vocab = {i: bytes([i]) for i in range(256)}
    merges: list[Pair] = []
    for new_id in tqdm(range(256, 256 + n_merges), desc="BPE merges", disable=not progress):
        pair = _pop_most_frequent(heap, pair_counts)
        if pair is None:
            break
        merges.append(pair)
        vocab[new_id] = vocab[pair[0]] + vocab[pair[1]]
        delta: dict[Pair, int] = defaultdict(int)
        for w in where.pop(pair):
            word, freq = words[w], freqs[w]
            merged = _merge(word, pair, new_id)
            for old in zip(word, word[1:]):
                delta[old] -= freq
            for new in zip(merged, merged[1:]):
                delta[new] += freq
                where[new].add(w)
            words[w] = merged
        for changed, d in delta.items():
            if d == 0:
                continue
            pair_counts[changed] += d
            if pair_counts[changed] > 0:
                heapq.heappush(heap, (-pair_counts[changed], changed))
            else:
                del pair_counts[changed]

    first_special = 256 + len(merges)
    specials = {token: first_special + n for n, token in enumerate(special_tokens)}
    return Tokenizer(vocab, merges, specials, pretokenizer)


def _pop_most_frequent(heap: list[tuple[int, Pair]], pair_counts: dict[Pair, int]) -> Pair | None:
    """Pop the most frequent pair, skipping stale heap entries (lazy deletion)."""
    while heap:
        neg_count, pair = heapq.heappop(heap)
        if pair_counts.get(pair) == -neg_count:
            return pair
    return None


def _merge(ids: list[int], pair: Pair, merged: int) -> list[int]:
    """Replace every non-overlapping occurrence of ``pair`` (left to right) by ``merged``."""
    a, b = pair
    out: list[int] = []
    i = 0
    n = len(ids)
    while i < n:
        if i + 1 < n and ids[i] == a and ids[i + 1] == b:
            out.append(merged)
            i += 2
        else:
            out.append(ids[i])
            i += 1
    return out
