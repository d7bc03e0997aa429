"""Exercises of notebook 10 (the engine): three back-of-the-envelope numbers an inference engineer
computes before buying hardware, then the scheduler itself — admit, preempt, and the loop.

The expected answers come from the package: the roofline and the KV budget from its formulas
(``minillm.cache.kv_bytes_per_token``), who is admitted and how many rows are preempted from
``minillm.engine.scheduler.Scheduler`` itself, and the scheduler loop from the package's
scheduler run on the same fake model. The loop is judged by what it *does*, not only by the
tokens it returns: a request's tokens do not depend on what shares its steps, so a loop that
runs each request alone returns the right tokens too. The check records every forward the
learner's loop runs (prefill or decode, and for which requests) and every preemption, and
compares them with the package's, step by step; the first difference is named.
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from collections.abc import Callable
from typing import Any

import torch

from minillm.cache import BlockManager, OutOfBlocksError, kv_bytes_per_token
from minillm.engine.scheduler import Scheduler
from minillm.exercises import Mistake, _print_hints, check
from minillm.exercises import nb10_mistakes as wrong
from minillm.exercises.nb10_loop import SCENARIOS, Unit, diagnose, package_run, run_learner
from minillm.model import ModelConfig

# ------------------------------------------------------------------ exercise 1: the decode roofline

ROOF_CASES_IN = [(4.8e12, 270e6), (3.35e12, 16.06e9), (35.0e9, 538e6)]  # H200 + 135M bf16, H100 + 8B bf16, a CPU


def roofline_tokens_per_s_solution(bandwidth_bytes_s: float, weight_bytes: float) -> float:
    return bandwidth_bytes_s / weight_bytes


ROOF_MISTAKES = [
    Mistake(lambda b, w: w / b, "that is seconds per token (bytes / bytes per second): tokens per second is its inverse."),
    Mistake(lambda b, w: 2 * b / w, "2 flops per weight is the compute side; the memory roof counts only the bytes read."),
    Mistake(lambda b, w: 8 * b / w, "bandwidth and weights are both in bytes: no factor 8 for bits."),
]
ROOF_HINTS = [
    "A decode step at batch 1 produces one token and reads every weight byte once.",
    "How many times per second can the memory deliver `weight_bytes` bytes?",
    "return bandwidth_bytes_s / weight_bytes",
]


def check_roofline_tokens_per_s(fn: Callable[[float, float], float], hint: int = 0) -> bool:
    """``fn(bandwidth_bytes_s, weight_bytes)`` -> the highest possible batch-1 decode speed, tokens/s."""
    cases = [(args, roofline_tokens_per_s_solution(*args)) for args in ROOF_CASES_IN]
    return check("roofline_tokens_per_s", fn, cases, hint=hint, hints=ROOF_HINTS, mistakes=ROOF_MISTAKES,
                 equal=_close)


def _close(got: Any, want: float) -> bool:
    return isinstance(got, (int, float)) and not isinstance(got, bool) and math.isclose(got, want, rel_tol=1e-9)


# ------------------------------------------------------------------ exercise 2: how many tokens of KV cache fit

SMOLLM2_135M = ModelConfig(vocab_size=49152, hidden_size=576, n_layers=30, n_heads=9, n_kv_heads=3,
                           intermediate_size=1536, max_position_embeddings=8192, tie_word_embeddings=True)
QWEN25_05B = ModelConfig(vocab_size=151936, hidden_size=896, n_layers=24, n_heads=14, n_kv_heads=2,
                         intermediate_size=4864, max_position_embeddings=32768, attention_bias=True,
                         architecture="qwen2")
LLAMA32_1B = ModelConfig(vocab_size=128256, hidden_size=2048, n_layers=16, n_heads=32, n_kv_heads=8,
                         intermediate_size=8192, max_position_embeddings=131072)
KV_CASES_IN = [
    (2**30, SMOLLM2_135M, torch.float32),
    (2**30, SMOLLM2_135M, torch.bfloat16),
    (8 * 2**30, QWEN25_05B, torch.bfloat16),
    (130 * 2**30, LLAMA32_1B, torch.bfloat16),  # most of an H200
    (40_000, SMOLLM2_135M, torch.float32),  # not even one token
]


def kv_cache_tokens_that_fit_solution(free_bytes: int, config: ModelConfig, dtype: torch.dtype) -> int:
    return free_bytes // kv_bytes_per_token(config, dtype)


def _by_hand(free: int, c: ModelConfig, dtype: torch.dtype, kv: int = 2, heads: str = "n_kv_heads") -> int:
    return free // (kv * c.n_layers * getattr(c, heads) * c.head_dim * (torch.finfo(dtype).bits // 8))


KV_MISTAKES = [
    Mistake(lambda f, c, d: f / kv_bytes_per_token(c, d), "only whole tokens fit: use `//`, not `/` (an int, not a float)."),
    Mistake(lambda f, c, d: -(-f // kv_bytes_per_token(c, d)), "rounded up: a token that does not fit whole does not fit."),
    Mistake(lambda f, c, d: _by_hand(f, c, d, heads="n_heads"),
            "you counted the query heads: the cache holds only the K/V heads (grouped-query attention, n_kv_heads)."),
    Mistake(lambda f, c, d: _by_hand(f, c, d, kv=1), "the cache holds K *and* V for every token: a factor 2."),
]
KV_HINTS = [
    "One token of cache costs the same number of bytes everywhere: notebook 07 computed it.",
    "minillm.cache.kv_bytes_per_token(config, dtype) is that size; how many whole ones fit in free_bytes?",
    "return free_bytes // kv_bytes_per_token(config, dtype)",
]


def check_kv_cache_tokens_that_fit(fn: Callable[[int, ModelConfig, torch.dtype], int], hint: int = 0) -> bool:
    """``fn(free_bytes, config, dtype)`` -> how many whole tokens of KV cache fit in ``free_bytes``."""
    cases = [(args, kv_cache_tokens_that_fit_solution(*args)) for args in KV_CASES_IN]
    return check("kv_cache_tokens_that_fit", fn, cases, hint=hint, hints=KV_HINTS, mistakes=KV_MISTAKES)


# ------------------------------------------------------------------ exercise 3: the arithmetic intensity of a decode step

AI_CASES_IN = [(1, 4), (1, 2), (8, 2), (256, 2), (1, 0.5), (3, 4)]
H200_FLOPS, H200_BYTES_S = 989e12, 4.8e12  # dense bfloat16; HBM3e


def decode_arithmetic_intensity_solution(batch_size: int, bytes_per_param: float) -> float:
    return 2 * batch_size / bytes_per_param


AI_MISTAKES = [
    Mistake(lambda b, p: b / p, "a multiply-add is 2 flops: 2 × batch_size flops per parameter."),
    Mistake(lambda b, p: 2 / p, "each of the batch_size rows uses every weight: the flops grow with the batch, the bytes do not."),
    Mistake(lambda b, p: 2 * b * p, "intensity is flops *per byte*: divide by the bytes per parameter."),
    Mistake(lambda b, p: 2 * b / (p * b), "the weights are read once per step, not once per row."),
]
AI_HINTS = [
    "Intensity = flops / bytes, both counted per parameter for one step.",
    "Per parameter, a step does one multiply-add (2 flops) per row, and reads it once.",
    "return 2 * batch_size / bytes_per_param",
]


def check_decode_arithmetic_intensity(fn: Callable[[int, float], float], hint: int = 0) -> bool:
    """``fn(batch_size, bytes_per_param)`` -> flops per byte of weights of one decode step; on success,
    the answer to the notebook's question (from which batch size on an H200 is compute-bound)."""
    cases = [(args, decode_arithmetic_intensity_solution(*args)) for args in AI_CASES_IN]
    ok = check("decode_arithmetic_intensity", fn, cases, hint=hint, hints=AI_HINTS, mistakes=AI_MISTAKES, equal=_close)
    if ok:
        ridge = H200_FLOPS / H200_BYTES_S
        print(f"   The H200's ridge: {ridge:.0f} flop/byte. bfloat16 decode reaches it where 2B/2 = {ridge:.0f}, "
              f"at ~{ridge:.0f} rows: below that, more rows per step are nearly free.")
    return ok


# ------------------------------------------------------------------ exercise 4: admit

ADMIT_CASES_IN = [  # (waiting prompt lengths, n_running, free_blocks, block_size, max_batch_size)
    ([10, 20, 5], 0, 10, 16, 8),
    ([27, 38, 18, 10], 1, 8, 16, 5),
    ([10, 20, 5], 0, 6, 16, 8),
    ([10, 20, 5], 7, 100, 16, 8),
    ([21], 0, 2, 4, 6),
    ([24, 36], 2, 3, 8, 6),
    ([27, 13, 5, 18], 2, 3, 16, 4),
    ([11, 11, 33, 15], 0, 14, 4, 6),
    ([23, 1, 35, 35], 4, 14, 16, 4),
    ([], 0, 5, 16, 8),
]


def admit_solution(waiting: list[int], n_running: int, free_blocks: int, block_size: int, max_batch_size: int) -> int:
    blocks, rows, admitted = 0, n_running, 0
    for length in waiting:
        need = math.ceil(length / block_size)
        if rows and (rows + 1 > max_batch_size or blocks + need + rows + 1 > free_blocks):
            break  # (an empty batch takes the head whatever its size: alone, it has the whole pool)
        blocks, rows, admitted = blocks + need, rows + 1, admitted + 1
    return admitted


def _package_admit(waiting: list[int], n_running: int, free_blocks: int, block_size: int, max_batch_size: int) -> int:
    """How many of ``waiting`` the package's ``Scheduler`` admits in this situation."""
    ids = itertools.count()
    scheduler = Scheduler(BlockManager(free_blocks, block_size), max_batch_size)
    scheduler.running = [Unit(ids, [0]) for _ in range(n_running)]  # they hold no blocks: all are free
    for length in waiting:
        scheduler.add(Unit(ids, [0] * length))
    return len(scheduler._admit())


ADMIT_MISTAKES = [
    Mistake(wrong.admit_strict_when_empty, "an empty batch must take the head of the queue whatever its size: "
            "alone it has the whole pool (the engine refuses larger requests up front). Refusing it, the engine "
            "would wait forever."),
    Mistake(wrong.admit_without_spares, "you left no spare block per row: the next decode step would find the "
            "pool full and preempt at once. Count one spare block for every row, running and admitted."),
    Mistake(wrong.admit_spares_for_newcomers_only, "the running rows need a spare block too (they write their "
            "next token in the same decode step): count one for every row, not only the newcomers."),
    Mistake(wrong.admit_overtaking, "you skipped a request that did not fit and admitted one behind it: no "
            "overtaking, or a long prompt would starve. Stop at the first one that does not fit."),
    Mistake(wrong.admit_floor_blocks, "a prompt of 17 tokens takes 2 blocks of 16: round up (math.ceil), not down."),
    Mistake(wrong.admit_ignoring_seats, "the batch has at most max_batch_size rows, running ones included."),
]
ADMIT_HINTS = [
    ("Walk the queue from the front with a running total of blocks and of rows; stop at the first request that "
    "does not fit (no overtaking)."),
    ("A request fits if rows + 1 <= max_batch_size and blocks + its blocks + (rows + 1) spare blocks <= "
    "free_blocks, where its blocks = ceil(length / block_size) and rows counts the running ones too."),
    "The one exception: when rows == 0 (nobody running, nobody admitted yet), admit the head whatever its size.",
]


def check_admit(fn: Callable[[list[int], int, int, int, int], int], hint: int = 0) -> bool:
    """``fn(waiting, n_running, free_blocks, block_size, max_batch_size)`` -> how many of the
    waiting prompts (their lengths, front first) the scheduler admits this step."""
    cases = [(args, _package_admit(*args)) for args in ADMIT_CASES_IN]
    return check("admit", fn, cases, hint=hint, hints=ADMIT_HINTS, mistakes=ADMIT_MISTAKES)


# ------------------------------------------------------------------ exercise 5: preempt

PREEMPT_CASES_IN = [  # (lengths of the running rows, oldest first; free_blocks; block_size)
    ([5, 16, 32], 2, 16),
    ([5, 16, 32], 1, 16),
    ([12, 4, 4], 0, 4),
    ([18], 0, 1),
    ([4, 4, 5, 14], 3, 8),
    ([3, 12, 1, 5], 2, 1),
    ([16, 29, 16, 7, 18], 0, 16),
    ([16, 16], 0, 16),
]


def preempt_solution(lengths: list[int], free_blocks: int, block_size: int) -> int:
    rows, preempted = list(lengths), 0
    while sum(n % block_size == 0 for n in rows) > free_blocks and len(rows) > 1:
        free_blocks += math.ceil(rows.pop() / block_size)  # the newest goes, its blocks back to the pool
        preempted += 1
    return preempted


def _package_preempt(lengths: list[int], free_blocks: int, block_size: int) -> int:
    """How many of these running rows (oldest first) the package's ``Scheduler`` preempts so that each
    can store one more token, with ``free_blocks`` free."""
    held = sum(math.ceil(n / block_size) for n in lengths)
    manager = BlockManager(held + free_blocks, block_size)
    scheduler = Scheduler(manager, max_batch_size=len(lengths))
    ids = itertools.count()
    for n in lengths:
        unit = Unit(ids, [0])
        manager.add_sequence(unit.seq_id)
        manager.reserve([unit.seq_id], [n])
        manager.advance([unit.seq_id], [n])
        scheduler.running.append(unit)
    try:
        scheduler._reserve_or_preempt()
    except OutOfBlocksError:  # one row alone that cannot grow: the engine reports its pool too small
        pass
    return scheduler.preemptions


PREEMPT_MISTAKES = [
    Mistake(wrong.preempt_oldest, "you preempted the oldest row: the scheduler preempts the *newest* (the last of "
            "`lengths`): the oldest has waited longest and computed the most."),
    Mistake(wrong.preempt_the_last_row_too, "never preempt the last row: alone it always fits (the engine refuses "
            "requests larger than the pool), and a step must make progress."),
    Mistake(wrong.preempt_counting_every_row, "only a row whose last block is full (length % block_size == 0) "
            "needs a new block; the others write into the room left in theirs."),
    Mistake(wrong.preempt_without_freeing, "a preempted row's blocks go back to the pool: add them to free_blocks."),
    Mistake(wrong.preempt_floor_blocks, "a row of 17 tokens in blocks of 16 holds 2 blocks: ceil, not floor."),
]
PREEMPT_HINTS = [
    "First count the rows that need a new block this step; if that is at most free_blocks, nobody is preempted.",
    ("A row needs a block when length % block_size == 0. Preempting a row removes its need and gives its "
    "ceil(length / block_size) blocks back; repeat (recounting) until the step fits."),
    "Which row: the last of `lengths` (the newest), and never the only one left.",
]


def check_preempt(fn: Callable[[list[int], int, int], int], hint: int = 0) -> bool:
    """``fn(lengths, free_blocks, block_size)`` -> how many of the running rows (oldest first) are
    preempted so that every remaining row can store one more token."""
    cases = [(args, _package_preempt(*args)) for args in PREEMPT_CASES_IN]
    return check("preempt", fn, cases, hint=hint, hints=PREEMPT_HINTS, mistakes=PREEMPT_MISTAKES)


# ------------------------------------------------------------------ exercise 6: the scheduler loop


def my_generate_solution(runner: Any, prompts: list[list[int]], max_new_tokens: list[int],
                         max_batch_size: int) -> list[list[int]]:
    manager = runner.cache.manager
    seq = lambda i: 50_000 + i
    outputs: list[list[int]] = [[] for _ in prompts]
    waiting, running = deque(range(len(prompts))), []

    def to_prefill(i: int) -> list[int]:  # a preempted request recomputes all but its last token
        return prompts[i] + outputs[i][:-1]

    def retire() -> None:  # at once: the seat and the blocks are free for the next step's admission
        for i in [i for i in running if len(outputs[i]) == max_new_tokens[i]]:
            manager.free_sequence(seq(i))
            running.remove(i)

    while waiting or running:
        n = admit_solution([len(to_prefill(i)) for i in waiting], len(running), manager.allocator.num_free,
                           manager.block_size, max_batch_size)
        new = [waiting.popleft() for _ in range(n)]
        if new:  # one packed prefill for the newcomers
            for i in new:
                manager.add_sequence(seq(i))
            manager.reserve([seq(i) for i in new], [len(to_prefill(i)) for i in new])
            logits = runner.prefill([seq(i) for i in new], [to_prefill(i) for i in new])
            for i, row in zip(new, logits):
                if not outputs[i]:
                    outputs[i].append(int(row.argmax()))
            running += new
            retire()
        if not running:
            continue
        lengths = [manager.lengths[seq(i)] for i in running]
        for _ in range(preempt_solution(lengths, manager.allocator.num_free, manager.block_size)):
            victim = running.pop()  # the newest, back to the front of the queue
            manager.free_sequence(seq(victim))
            waiting.appendleft(victim)
        manager.reserve([seq(i) for i in running], [1] * len(running))
        logits = runner.decode([seq(i) for i in running], [outputs[i][-1] for i in running])
        for i, row in zip(running, logits):
            outputs[i].append(int(row.argmax()))
        retire()
    return outputs


LOOP_HINTS = [
    ("Keep outputs[i] per request, a deque of waiting request indices and a list of running ones (oldest first). "
    "Each step: admit + one prefill for the newcomers, retire, then preempt + reserve + one decode for all "
    "running rows, retire."),
    ("Retire right after each forward (free the sequence, drop it from running), so its seat and blocks serve the "
    "next admission. A newcomer takes its first token from its prefill's logits; decode feeds each row outputs[i][-1]."),
    ("preempt(...) tells how many: pop them from the *end* of running, free their sequences, and appendleft them to "
    "waiting. Re-admitted, a request prefills prompts[i] + outputs[i][:-1] and takes no token from that prefill."),
]


def check_my_generate(fn: Callable[..., list[list[int]]], hint: int = 0, engine: Any = None,
                      prompts: list[list[int]] | None = None) -> bool:
    """``fn(runner, prompts, max_new_tokens, max_batch_size)`` -> each prompt's new tokens (greedy).

    Runs it on a fake model in the situations of ``nb10_loop.SCENARIOS`` and compares every
    forward and preemption with the package's scheduler on the same fake. With ``engine`` and
    ``prompts``, a loop that passes then runs on the engine's real model and must return the
    tokens the engine generates itself.
    """
    for scenario in SCENARIOS:
        want, want_events = package_run(scenario)
        try:
            got, error, runner = run_learner(fn, scenario, limit=10 * len(want_events) + 20)
        except NotImplementedError:
            print("⏳ my_generate: not attempted yet — replace the `raise NotImplementedError` with your code.")
            return False
        problem = diagnose(scenario, got, error, runner, want, want_events)
        if problem:
            print(f"❌ my_generate ({scenario.name}): {problem}")
            _print_hints("my_generate", hint, LOOP_HINTS)
            return False
    n = sum(e.kind != "preempt" for s in SCENARIOS for e in package_run(s)[1])
    print(f"✅ my_generate: the same {n} forwards and the same preemptions as the package's scheduler, "
          f"in {len(SCENARIOS)} scenarios.")
    if engine is not None and prompts is not None:
        from minillm.sampling import SamplingParams

        n_new = [24] * len(prompts)
        expected = [c.token_ids for c in engine.generate(prompts, SamplingParams(max_new_tokens=24, ignore_eos=True))]
        same = fn(engine.runner, prompts, n_new, engine.scheduler.max_batch_size) == expected
        print(f"   on the real model: {len(prompts)} requests, {'the same tokens as' if same else 'NOT the tokens of'} "
              f"engine.generate (which preempted {engine.preemptions} time(s)).")
        return same
    return True

