"""Exercises of notebook 12 (serving): the block hash chain of prefix caching, and one step of a
token-budget scheduler (chunked prefill).

The expected answers come from the package: ``BlockManager.prefix_keys`` (the keys the engine
stores for every full block) and ``minillm.engine.prefill_chunk_sizes`` (the split the engine's
``_prefill`` runs). Each classic mistake is written out as the function a learner would write, so
a wrong answer of that kind is named.
"""

from __future__ import annotations

import random
import types
from collections.abc import Callable, Sequence

from minillm.cache import BlockManager
from minillm.engine import prefill_chunk_sizes
from minillm.exercises import Mistake, Rule, check

# --- a rule for both: write the mechanism, do not call the package's ---------------------------------


def forbid_names(forbidden: dict[str, str]) -> Rule:
    """A rule: the learner's function (and the functions defined inside it) names none of
    ``forbidden`` (name -> why not): ``BlockManager(...).prefix_keys(...)`` or a call of
    ``prefill_chunk_sizes`` gives the right answer without writing it. These are plain Python
    functions, so the names are read from the function's code rather than recorded as torch calls."""

    def rule(fn: Callable[..., object], args: tuple[object, ...]) -> str | None:
        names: set[str] = set()
        codes = [getattr(fn, "__code__", None)]
        while codes:
            code = codes.pop()
            if code is None:
                continue
            names.update(code.co_names)
            codes += [const for const in code.co_consts if isinstance(const, types.CodeType)]
        for name, why in forbidden.items():
            if name in names:
                return f"it uses `{name}`: {why}"
        return None

    return rule


NO_PACKAGE_KEYS = forbid_names({"prefix_keys": "that is the package's answer; chain the hashes yourself."})
NO_PACKAGE_SPLIT = forbid_names({"prefill_chunk_sizes": "that is the package's answer; split the budget yourself."})


# --- exercise 1: the block hash chain ----------------------------------------------------------------


def package_keys(tokens: Sequence[int], block_size: int) -> list[int]:
    """The keys the package gives the full blocks of ``tokens`` (a fresh manager: only the block size matters)."""
    return BlockManager(1, block_size, prefix_caching=True).prefix_keys(tokens)


def _key_cases() -> list[tuple[tuple[list[int], int], list[int]]]:
    rng = random.Random(12)
    shared = [rng.randrange(49152) for _ in range(40)]
    inputs = [
        ([5, 6, 7, 8, 9, 10, 11, 12, 13], 4),  # two full blocks and a partial one
        ([1, 2] * 6, 2),  # the same block six times over: only the chain tells them apart
        (list(range(100, 116)), 16),  # exactly one full block
        ([3, 1, 4], 4),  # shorter than a block: no key at all
        ([], 4),
        (shared + [rng.randrange(49152) for _ in range(23)], 16),  # a real-looking prompt, 3 blocks + 15
        (shared[:32] + [7] + shared[33:], 8),  # the same prompt with token 32 changed
        ([rng.randrange(49152) for _ in range(64)], 1),  # block size 1: one key per token
    ]
    return [((tokens, bs), package_keys(tokens, bs)) for tokens, bs in inputs]


def _full_blocks(tokens: Sequence[int], block_size: int) -> list[tuple[int, ...]]:
    return [tuple(tokens[i : i + block_size]) for i in range(0, len(tokens) - block_size + 1, block_size)]


def _keys_unchained(tokens: Sequence[int], block_size: int) -> list[int]:
    return [hash((None, block)) for block in _full_blocks(tokens, block_size)]


def _keys_unchained_plain(tokens: Sequence[int], block_size: int) -> list[int]:
    return [hash(block) for block in _full_blocks(tokens, block_size)]


def _keys_with_partial(tokens: Sequence[int], block_size: int) -> list[int]:
    keys, previous = [], None
    for i in range(0, len(tokens), block_size):
        previous = hash((previous, tuple(tokens[i : i + block_size])))
        keys.append(previous)
    return keys


def _keys_whole_prefix(tokens: Sequence[int], block_size: int) -> list[int]:
    return [hash(tuple(tokens[: i + block_size])) for i in range(0, len(tokens) - block_size + 1, block_size)]


def _keys_chained_on_tokens(tokens: Sequence[int], block_size: int) -> list[int]:
    blocks = _full_blocks(tokens, block_size)
    return [hash((blocks[i - 1] if i else None, block)) for i, block in enumerate(blocks)]


def _chain(start: object, pair: Callable[[object, tuple[int, ...]], tuple[object, object]]
           ) -> Callable[[Sequence[int], int], list[int]]:
    def keys(tokens: Sequence[int], block_size: int) -> list[int]:
        out: list[int] = []
        previous = start
        for block in _full_blocks(tokens, block_size):
            key = hash(pair(previous, block))
            out.append(key)
            previous = key
        return out

    return keys


UNCHAINED = ("each key hashes only its own block: two prompts that differ in block 0 but hold the same tokens in "
             "block 1 would share block 1's key, and a request would reuse K/V that were computed attending to "
             "another prefix. Chain it: hash((previous_key, block)).")

KEY_MISTAKES = [
    Mistake(_keys_unchained, UNCHAINED),
    Mistake(_keys_unchained_plain, UNCHAINED),
    Mistake(_keys_with_partial, "the partial last block got a key: its next tokens are still to be written, and a "
                                "longer prompt with the same start would find a block that holds only part of its "
                                "tokens. Key full blocks only (len(tokens) // block_size keys)."),
    Mistake(_keys_whole_prefix, "each key hashes the whole prefix from token 0: equal keys do mean equal prefixes, "
                                "but the work grows with the square of the prompt length, and these are not the "
                                "package's keys. Hash the previous *key* with this block: hash((previous, block))."),
    Mistake(_keys_chained_on_tokens, "each key is chained on the previous block's tokens, not on its key: a key "
                                     "must name the whole prefix, and two prompts that differ in block 0 only would "
                                     "share block 2's key. Chain on the previous key."),
    Mistake(_chain(0, lambda prev, block: (prev, block)),
            "the chain starts from 0: the first block has no previous key, which the package writes as None "
            "(hash((None, block)))."),
    Mistake(_chain(None, lambda prev, block: (block, prev)),
            "the pair is in the other order: hash((previous, block)), the previous key first (a tuple's hash depends "
            "on its order)."),
]

KEY_HINTS = [
    "Cut the tokens into blocks of block_size and drop the last one if it is not full. Each full block's key "
    "hashes its tokens *together with the key of the block before it*, so the key names the whole prefix.",
    "Walk the full blocks with `previous = None`; for each, `previous = hash((previous, tuple(block)))` and keep "
    "it. A list cannot be hashed: make the block a tuple.",
    "keys, previous = [], None\n"
    "for start in range(0, len(tokens) - block_size + 1, block_size):\n"
    "    previous = hash((previous, tuple(tokens[start : start + block_size])))\n"
    "    keys.append(previous)\n"
    "return keys",
]


def check_prefix_keys(fn: Callable[[list[int], int], list[int]], hint: int = 0) -> bool:
    """``fn(tokens, block_size)`` -> one key per *full* block, ``key_i = hash((key_{i-1}, tuple(block_i)))``
    with ``key_{-1} = None``: the package's ``BlockManager.prefix_keys``."""
    return check("prefix_keys", fn, _key_cases(), hint=hint, hints=KEY_HINTS, mistakes=KEY_MISTAKES,
                 rules=[NO_PACKAGE_KEYS])


# --- exercise 2: one step of a token-budget scheduler -----------------------------------------------------

Prefilling = Sequence[tuple[str, int]]  # (request, prompt tokens still to compute), in arrival order


def package_step(decoding: Sequence[str], prefilling: Prefilling, budget: int | None) -> dict[str, int]:
    """Tokens each request computes this step, by the engine's rule: one per running request, and
    the prompt chunks of ``prefill_chunk_sizes`` (0 for a prompt that waits)."""
    chunks = prefill_chunk_sizes([n for _, n in prefilling], budget)
    return {name: 1 for name in decoding} | {name: n for (name, _), n in zip(prefilling, chunks)}


def _step_cases() -> list[tuple[tuple[list[str], list[tuple[str, int]], int | None], dict[str, int]]]:
    inputs = [
        (["a", "b", "c"], [("long", 900)], 256),  # a long prompt arrives while three requests stream
        (["a", "b"], [("p", 300), ("q", 200)], 128),  # two long prompts: p takes the budget, q waits
        (["a", "b"], [("p", 100), ("q", 50), ("r", 30)], 128),  # the budget runs out inside q; r waits
        ([], [("p", 40), ("q", 30)], 64),  # nothing decoding yet
        (["a"], [("p", 40), ("q", 30)], 100),  # both prompts fit, budget left over
        (["a", "b", "c", "d"], [("p", 3), ("q", 300)], 2),  # a budget smaller than the decodes
        (["a", "b"], [("p", 700), ("q", 20)], None),  # no budget: every prompt whole (no chunking)
        (["a", "b", "c"], [], 64),  # only decodes
        (["a"], [("p", 64), ("q", 64)], 64),  # p takes the budget exactly; q waits
    ]
    return [((list(d), list(p), b), package_step(d, p, b)) for d, p, b in inputs]


def _limit(budget: int | None) -> float:
    return float("inf") if budget is None else budget


def _step_whole_prompts(decoding: Sequence[str], prefilling: Prefilling, budget: int | None) -> dict[str, int]:
    return {d: 1 for d in decoding} | {p: n for p, n in prefilling}


def _step_budget_each(decoding: Sequence[str], prefilling: Prefilling, budget: int | None) -> dict[str, int]:
    return {d: 1 for d in decoding} | {p: int(min(n, _limit(budget))) for p, n in prefilling}


def _step_first_only(decoding: Sequence[str], prefilling: Prefilling, budget: int | None) -> dict[str, int]:
    return {d: 1 for d in decoding} | {p: int(min(n, _limit(budget))) if i == 0 else 0
                                      for i, (p, n) in enumerate(prefilling)}


def _step_newest_first(decoding: Sequence[str], prefilling: Prefilling, budget: int | None) -> dict[str, int]:
    order = list(prefilling)[::-1]
    chunks = dict(zip([p for p, _ in order], prefill_chunk_sizes([n for _, n in order], budget)))
    return {d: 1 for d in decoding} | {p: chunks[p] for p, _ in prefilling}


def _step_prefill_before_decodes(decoding: Sequence[str], prefilling: Prefilling, budget: int | None) -> dict[str, int]:
    chunks = prefill_chunk_sizes([n for _, n in prefilling], budget)
    left = _limit(budget) - sum(chunks)
    decodes = {}
    for d in decoding:
        decodes[d] = 1 if left >= 1 else 0
        left -= decodes[d]
    return decodes | {p: n for (p, _), n in zip(prefilling, chunks)}


def _step_decodes_in_budget(decoding: Sequence[str], prefilling: Prefilling, budget: int | None) -> dict[str, int]:
    left = _limit(budget) - len(decoding)
    chunks = prefill_chunk_sizes([n for _, n in prefilling], None if budget is None else max(int(left), 0))
    return {d: 1 for d in decoding} | {p: n for (p, _), n in zip(prefilling, chunks)}


def _step_equal_split(decoding: Sequence[str], prefilling: Prefilling, budget: int | None) -> dict[str, int]:
    share = _limit(budget) / max(len(prefilling), 1)
    return {d: 1 for d in decoding} | {p: int(min(n, share)) for p, n in prefilling}


def _step_no_decodes(decoding: Sequence[str], prefilling: Prefilling, budget: int | None) -> dict[str, int]:
    return {p: n for (p, _), n in zip(prefilling, prefill_chunk_sizes([n for _, n in prefilling], budget))}


def _step_waiting_left_out(decoding: Sequence[str], prefilling: Prefilling, budget: int | None) -> dict[str, int]:
    return {k: v for k, v in package_step(decoding, prefilling, budget).items() if v > 0}


STEP_MISTAKES = [
    Mistake(_step_no_decodes, "the running requests are missing: each one decodes its next token every step "
                              "(1 each), before any prompt is computed."),
    Mistake(_step_whole_prompts, "the budget was ignored: every prompt got all its remaining tokens, so a long "
                                 "prompt stalls the step again. A step computes at most `budget` prompt tokens."),
    Mistake(_step_budget_each, "each prompt got up to the whole budget, so the step exceeds it: the budget is the "
                               "step's, shared — what the first prompt takes, the next one cannot."),
    Mistake(_step_first_only, "only the oldest prompt got tokens: when it needs less than the budget, what is left "
                              "goes to the next prompt in arrival order."),
    Mistake(_step_newest_first, "the newest prompt went first: prompts are served in arrival order (first come, "
                                "first served), so the oldest one finishes first and none waits forever."),
    Mistake(_step_prefill_before_decodes, "the decodes were starved: the prompts took the budget first and the "
                                          "running requests got what was left. Every running request decodes one "
                                          "token each step, whatever the budget; the budget is for prompt tokens."),
    Mistake(_step_decodes_in_budget, "the decodes were counted against the budget: that is vLLM's rule "
                                     "(max_num_batched_tokens counts every token of the step); this engine's "
                                     "prefill_chunk_tokens caps the prompt tokens only, the decodes come on top."),
    Mistake(_step_equal_split, "the budget was split evenly between the prompts: fair, but then every prompt "
                               "finishes late. The engine fills the budget in arrival order, so the oldest prompt "
                               "gets its first token soonest."),
    Mistake(_step_waiting_left_out, "a prompt that waits this step is missing: every request appears in the "
                                    "answer, with 0 when it gets no tokens this step."),
]

STEP_HINTS = [
    "Two parts. The running requests: 1 token each, always. The prompts: walk them in arrival order with a "
    "budget that shrinks by what each one takes; a prompt takes min(what it still needs, what is left).",
    "left = budget (float('inf') when budget is None); for each (name, n) in prefilling: take = min(n, left); "
    "left -= take. Prompts after the budget is spent get 0 — keep them in the answer.",
    "plan = {name: 1 for name in decoding}\n"
    "left = float('inf') if budget is None else budget\n"
    "for name, n in prefilling:\n"
    "    plan[name] = int(min(n, left))\n"
    "    left -= plan[name]\n"
    "return plan",
]


def check_token_budget_step(fn: Callable[[list[str], list[tuple[str, int]], int | None], dict[str, int]],
                            hint: int = 0) -> bool:
    """``fn(decoding, prefilling, budget)`` -> ``{request: tokens this step}``: 1 for each running request, and the
    prompts' chunks in arrival order within ``budget`` (None: no limit), 0 for a prompt that waits."""
    return check("token_budget_step", fn, _step_cases(), hint=hint, hints=STEP_HINTS, mistakes=STEP_MISTAKES,
                 rules=[NO_PACKAGE_SPLIT])
