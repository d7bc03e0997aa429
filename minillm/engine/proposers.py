"""Speculative decoding's proposers: guesses of the next few tokens, cheaper than the model.

**Prompt lookup** (transformers' ``prompt_lookup_num_tokens``, llama.cpp's lookup decoding)
needs no second model: when the last ``n`` tokens of the text so far occurred earlier (in the
prompt, or in the answer), guess that what followed them then follows them again. Editing,
summarising or answering about a given passage copies long runs of it, so the guesses are often
right; on open-ended text they are rarely right and cost a little verification each time.

A proposer is a planner of the step: it only says which tokens to verify; the engine runs one
forward over them and keeps what the target model agrees with (``minillm.sampling.speculative``).
Its guesses are deterministic, so for the sampling rule its ``q`` is one-hot.
"""

from __future__ import annotations

from collections.abc import Sequence


def prompt_lookup(tokens: Sequence[int], k: int, max_ngram: int = 3, min_ngram: int = 1) -> list[int]:
    """Up to ``k`` tokens that followed the most recent earlier occurrence of the text's last
    ``n``-gram (the longest ``n`` from ``max_ngram`` down to ``min_ngram`` that occurs); [] if none."""
    if k < 1 or not 1 <= min_ngram <= max_ngram:
        raise ValueError(f"need k >= 1 and 1 <= min_ngram <= max_ngram, got k={k}, {min_ngram}..{max_ngram}")
    tokens = list(tokens)
    for n in range(min(max_ngram, len(tokens) - 1), min_ngram - 1, -1):
        tail = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):  # most recent first, never the tail itself
            if tokens[start:start + n] == tail:
                return tokens[start + n:start + n + k]
    return []
