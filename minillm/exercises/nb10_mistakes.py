"""Classic wrong answers to notebook 10's scheduler exercises, written out as a learner writes them.

``minillm.exercises.nb10`` names the admit and preempt mistakes when a learner's answer equals
one of these; the wrong scheduler loops are what ``tests/10_engine_on_gpu/test_exercises.py``
feeds its check, which must fail each with a message that names the mistake (the loop check
judges behaviour — the steps run and the requests preempted — not these functions' code).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from typing import Any

# ------------------------------------------------------------------ admit(waiting, n_running, free_blocks, block_size, max_batch_size)


def admit_without_spares(waiting: list[int], n_running: int, free_blocks: int, block_size: int, max_batch_size: int) -> int:
    blocks, rows, n = 0, n_running, 0
    for length in waiting:
        need = math.ceil(length / block_size)
        if rows and (rows + 1 > max_batch_size or blocks + need > free_blocks):
            break
        blocks, rows, n = blocks + need, rows + 1, n + 1
    return n


def admit_spares_for_newcomers_only(waiting: list[int], n_running: int, free_blocks: int, block_size: int,
                                    max_batch_size: int) -> int:
    blocks, rows, n = 0, n_running, 0
    for length in waiting:
        need = math.ceil(length / block_size)
        if rows and (rows + 1 > max_batch_size or blocks + need + n + 1 > free_blocks):
            break
        blocks, rows, n = blocks + need, rows + 1, n + 1
    return n


def admit_overtaking(waiting: list[int], n_running: int, free_blocks: int, block_size: int, max_batch_size: int) -> int:
    blocks, rows, n = 0, n_running, 0
    for length in waiting:
        need = math.ceil(length / block_size)
        if rows and rows + 1 > max_batch_size:
            break
        if rows and blocks + need + rows + 1 > free_blocks:
            continue  # skip it and try the next one
        blocks, rows, n = blocks + need, rows + 1, n + 1
    return n


def admit_floor_blocks(waiting: list[int], n_running: int, free_blocks: int, block_size: int, max_batch_size: int) -> int:
    blocks, rows, n = 0, n_running, 0
    for length in waiting:
        need = length // block_size
        if rows and (rows + 1 > max_batch_size or blocks + need + rows + 1 > free_blocks):
            break
        blocks, rows, n = blocks + need, rows + 1, n + 1
    return n


def admit_ignoring_seats(waiting: list[int], n_running: int, free_blocks: int, block_size: int, max_batch_size: int) -> int:
    blocks, rows, n = 0, n_running, 0
    for length in waiting:
        need = math.ceil(length / block_size)
        if rows and blocks + need + rows + 1 > free_blocks:
            break
        blocks, rows, n = blocks + need, rows + 1, n + 1
    return n


def admit_strict_when_empty(waiting: list[int], n_running: int, free_blocks: int, block_size: int,
                            max_batch_size: int) -> int:
    blocks, rows, n = 0, n_running, 0
    for length in waiting:
        need = math.ceil(length / block_size)
        if rows + 1 > max_batch_size or blocks + need + rows + 1 > free_blocks:
            break
        blocks, rows, n = blocks + need, rows + 1, n + 1
    return n


# ------------------------------------------------------------------ preempt(lengths, free_blocks, block_size)


def _needed(rows: list[int], block_size: int) -> int:
    return sum(n % block_size == 0 for n in rows)


def preempt_oldest(lengths: list[int], free_blocks: int, block_size: int) -> int:
    rows, n = list(lengths), 0
    while _needed(rows, block_size) > free_blocks and len(rows) > 1:
        free_blocks += math.ceil(rows.pop(0) / block_size)
        n += 1
    return n


def preempt_the_last_row_too(lengths: list[int], free_blocks: int, block_size: int) -> int:
    rows, n = list(lengths), 0
    while rows and _needed(rows, block_size) > free_blocks:
        free_blocks += math.ceil(rows.pop() / block_size)
        n += 1
    return n


def preempt_counting_every_row(lengths: list[int], free_blocks: int, block_size: int) -> int:
    rows, n = list(lengths), 0
    while len(rows) > free_blocks and len(rows) > 1:
        free_blocks += math.ceil(rows.pop() / block_size)
        n += 1
    return n


def preempt_without_freeing(lengths: list[int], free_blocks: int, block_size: int) -> int:
    rows, n = list(lengths), 0
    while _needed(rows, block_size) > free_blocks and len(rows) > 1:
        rows.pop()
        n += 1
    return n


def preempt_floor_blocks(lengths: list[int], free_blocks: int, block_size: int) -> int:
    rows, n = list(lengths), 0
    while _needed(rows, block_size) > free_blocks and len(rows) > 1:
        free_blocks += rows.pop() // block_size
        n += 1
    return n


# ------------------------------------------------------------------ my_generate(runner, prompts, max_new_tokens, max_batch_size)


def _admit(waiting: list[int], n_running: int, free_blocks: int, block_size: int, max_batch_size: int) -> int:
    """The right admission (as in ``nb10.admit_solution``), for the loops below."""
    blocks, rows, n = 0, n_running, 0
    for length in waiting:
        need = math.ceil(length / block_size)
        if rows and (rows + 1 > max_batch_size or blocks + need + rows + 1 > free_blocks):
            break
        blocks, rows, n = blocks + need, rows + 1, n + 1
    return n


def _preempt(lengths: list[int], free_blocks: int, block_size: int) -> int:
    rows, n = list(lengths), 0
    while _needed(rows, block_size) > free_blocks and len(rows) > 1:
        free_blocks += math.ceil(rows.pop() / block_size)
        n += 1
    return n


def scheduler_loop(admit: Callable[..., int] = _admit, preempt: Callable[..., int] = _preempt,
                   victim: str = "newest", free_victim: bool = True, static: bool = False,
                   free_finished: bool = True) -> Callable[..., list[list[int]]]:
    """The notebook's scheduler loop with the given ``admit`` and ``preempt``; ``victim`` says which
    row a preemption takes ("newest" or "oldest"), ``free_victim`` whether its blocks are freed,
    ``static`` whether newcomers wait until the whole batch has finished (static batching), and
    ``free_finished`` whether a finished request's blocks go back to the pool."""

    def my_generate(runner: Any, prompts: list[list[int]], max_new_tokens: list[int],
                    max_batch_size: int) -> list[list[int]]:
        manager = runner.cache.manager
        outputs: list[list[int]] = [[] for _ in prompts]
        waiting, running = deque(range(len(prompts))), []
        seq_of = {i: 10_000 + i for i in range(len(prompts))}

        def to_prefill(i: int) -> list[int]:
            return prompts[i] + outputs[i][:-1]

        def retire() -> None:  # right after each forward: a finished request's seat and blocks are free at once
            for i in [i for i in running if len(outputs[i]) == max_new_tokens[i]]:
                if free_finished:
                    manager.free_sequence(seq_of[i])
                running.remove(i)

        while waiting or running:
            n = 0 if static and running else admit(
                [len(to_prefill(i)) for i in waiting], len(running), manager.allocator.num_free,
                manager.block_size, max_batch_size)
            new = [waiting.popleft() for _ in range(n)]
            if new:
                for i in new:
                    manager.add_sequence(seq_of[i])
                manager.reserve([seq_of[i] for i in new], [len(to_prefill(i)) for i in new])
                logits = runner.prefill([seq_of[i] for i in new], [to_prefill(i) for i in new])
                for i, row in zip(new, logits):
                    if not outputs[i]:
                        outputs[i].append(int(row.argmax()))
                running += new
                retire()
            if not running:
                continue
            for _ in range(preempt([manager.lengths[seq_of[i]] for i in running], manager.allocator.num_free,
                                   manager.block_size)):
                gone = running.pop() if victim == "newest" else running.pop(0)
                if free_victim:
                    manager.free_sequence(seq_of[gone])
                else:
                    seq_of[gone] += 1000  # a fresh sequence next time; the old one keeps its blocks
                waiting.appendleft(gone)
            manager.reserve([seq_of[i] for i in running], [1] * len(running))
            logits = runner.decode([seq_of[i] for i in running], [outputs[i][-1] for i in running])
            for i, row in zip(running, logits):
                outputs[i].append(int(row.argmax()))
            retire()
        return outputs

    return my_generate


def one_at_a_time(runner: Any, prompts: list[list[int]], max_new_tokens: list[int],
                  max_batch_size: int) -> list[list[int]]:
    """Each request alone, start to finish: the same tokens (a request's tokens do not depend on
    what shares its steps), none of the batching."""
    manager = runner.cache.manager
    outputs = []
    for i, (prompt, n_new) in enumerate(zip(prompts, max_new_tokens)):
        manager.add_sequence(i)
        manager.reserve([i], [len(prompt)])
        out = [int(runner.prefill([i], [prompt])[0].argmax())]
        while len(out) < n_new:
            manager.reserve([i], [1])
            out.append(int(runner.decode([i], [out[-1]])[0].argmax()))
        manager.free_sequence(i)
        outputs.append(out)
    return outputs


LOOP_MISTAKES: dict[str, Callable[..., list[list[int]]]] = {
    "does not batch": one_at_a_time,
    "static batching": scheduler_loop(static=True),
    "beyond the block budget": scheduler_loop(admit=admit_without_spares),
    "max_batch_size": scheduler_loop(admit=admit_ignoring_seats),
    "the oldest": scheduler_loop(victim="oldest"),
    "without freeing": scheduler_loop(free_victim=False),
    "never frees": scheduler_loop(free_finished=False),
}
