"""The inputs the benchmarks share: prompts cut from the corpus and seeded arrival times."""

from __future__ import annotations

import random

from minillm.assets import corpus_path
from minillm.tokenizer import Tokenizer

DECODE_PROMPT_TOKENS = 16  # the decode benchmarks start from this many tokens of the corpus


def corpus_prompt(tok: Tokenizer, n_tokens: int) -> list[int]:
    """The first ``n_tokens`` ids of the training corpus: a real, reproducible prompt."""
    return tok.encode(corpus_path().read_text(encoding="utf-8"))[:n_tokens]


def poisson_arrivals(n_requests: int, rate_per_s: float, seed: int = 0) -> list[float]:
    """Arrival times (seconds from the start) of a seeded Poisson stream: independent requests,
    ``rate_per_s`` of them per second on average, exponential gaps between them."""
    rng = random.Random(seed)
    times, now = [], 0.0
    for _ in range(n_requests):
        now += rng.expovariate(rate_per_s)
        times.append(now)
    return times
