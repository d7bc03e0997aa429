"""The classic wrong answers to notebook 12's first two exercises, written as a learner would.

``nb12`` names each one (``Mistake``): when a learner's function returns what one of these
returns, the check says which mistake it is. Kept apart so that ``nb12`` reads as the exercises.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from minillm.engine import prefill_chunk_sizes

Prefilling = Sequence[tuple[str, int]]  # (request, prompt tokens still to compute), in arrival order


# --- exercise 1: the block hash chain ----------------------------------------------------------------


def full_blocks(tokens: Sequence[int], block_size: int) -> list[tuple[int, ...]]:
    return [tuple(tokens[i : i + block_size]) for i in range(0, len(tokens) - block_size + 1, block_size)]


def keys_unchained(tokens: Sequence[int], block_size: int) -> list[int]:
    return [hash((None, block)) for block in full_blocks(tokens, block_size)]


def keys_unchained_plain(tokens: Sequence[int], block_size: int) -> list[int]:
    return [hash(block) for block in full_blocks(tokens, block_size)]


def keys_with_partial(tokens: Sequence[int], block_size: int) -> list[int]:
    keys, previous = [], None
    for i in range(0, len(tokens), block_size):
        previous = hash((previous, tuple(tokens[i : i + block_size])))
        keys.append(previous)
    return keys


def keys_whole_prefix(tokens: Sequence[int], block_size: int) -> list[int]:
    return [hash(tuple(tokens[: i + block_size])) for i in range(0, len(tokens) - block_size + 1, block_size)]


def keys_chained_on_tokens(tokens: Sequence[int], block_size: int) -> list[int]:
    blocks = full_blocks(tokens, block_size)
    return [hash((blocks[i - 1] if i else None, block)) for i, block in enumerate(blocks)]


def chain(start: object, pair: Callable[[object, tuple[int, ...]], tuple[object, object]]
           ) -> Callable[[Sequence[int], int], list[int]]:
    def keys(tokens: Sequence[int], block_size: int) -> list[int]:
        out: list[int] = []
        previous = start
        for block in full_blocks(tokens, block_size):
            key = hash(pair(previous, block))
            out.append(key)
            previous = key
        return out

    return keys


# --- exercise 2: one step of a token-budget scheduler -----------------------------------------------------


def limit(budget: int | None) -> float:
    return float("inf") if budget is None else budget


def step_whole_prompts(decoding: Sequence[str], prefilling: Prefilling, budget: int | None) -> dict[str, int]:
    return {d: 1 for d in decoding} | {p: n for p, n in prefilling}


def step_budget_each(decoding: Sequence[str], prefilling: Prefilling, budget: int | None) -> dict[str, int]:
    return {d: 1 for d in decoding} | {p: int(min(n, limit(budget))) for p, n in prefilling}


def step_first_only(decoding: Sequence[str], prefilling: Prefilling, budget: int | None) -> dict[str, int]:
    return {d: 1 for d in decoding} | {p: int(min(n, limit(budget))) if i == 0 else 0
                                      for i, (p, n) in enumerate(prefilling)}


def step_newest_first(decoding: Sequence[str], prefilling: Prefilling, budget: int | None) -> dict[str, int]:
    order = list(prefilling)[::-1]
    chunks = dict(zip([p for p, _ in order], prefill_chunk_sizes([n for _, n in order], budget)))
    return {d: 1 for d in decoding} | {p: chunks[p] for p, _ in prefilling}


def step_prefill_before_decodes(decoding: Sequence[str], prefilling: Prefilling, budget: int | None) -> dict[str, int]:
    chunks = prefill_chunk_sizes([n for _, n in prefilling], budget)
    left = limit(budget) - sum(chunks)
    decodes = {}
    for d in decoding:
        decodes[d] = 1 if left >= 1 else 0
        left -= decodes[d]
    return decodes | {p: n for (p, _), n in zip(prefilling, chunks)}


def step_decodes_in_budget(decoding: Sequence[str], prefilling: Prefilling, budget: int | None) -> dict[str, int]:
    left = limit(budget) - len(decoding)
    chunks = prefill_chunk_sizes([n for _, n in prefilling], None if budget is None else max(int(left), 0))
    return {d: 1 for d in decoding} | {p: n for (p, _), n in zip(prefilling, chunks)}


def step_equal_split(decoding: Sequence[str], prefilling: Prefilling, budget: int | None) -> dict[str, int]:
    share = limit(budget) / max(len(prefilling), 1)
    return {d: 1 for d in decoding} | {p: int(min(n, share)) for p, n in prefilling}


def step_no_decodes(decoding: Sequence[str], prefilling: Prefilling, budget: int | None) -> dict[str, int]:
    return {p: n for (p, _), n in zip(prefilling, prefill_chunk_sizes([n for _, n in prefilling], budget))}


def step_waiting_left_out(decoding: Sequence[str], prefilling: Prefilling, budget: int | None) -> dict[str, int]:
    chunks = prefill_chunk_sizes([n for _, n in prefilling], budget)
    return {d: 1 for d in decoding} | {p: n for (p, _), n in zip(prefilling, chunks) if n > 0}
