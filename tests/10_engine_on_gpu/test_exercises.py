"""Notebook 10's exercises: each reference solution passes, each classic wrong answer fails with a
message that names it. The scheduler loop is judged by its behaviour (the forwards it runs and the
requests it preempts) against the package's scheduler, so a loop that returns the right tokens the
wrong way — one request at a time, say — fails too."""

from __future__ import annotations

import math
from collections import deque

import pytest

from minillm.exercises import nb10, nb10_mistakes


def _run(capsys: pytest.CaptureFixture[str], check, fn, **kwargs) -> tuple[bool, str]:
    ok = check(fn, **kwargs)
    return ok, capsys.readouterr().out


SOLUTIONS = [
    (nb10.check_roofline_tokens_per_s, nb10.roofline_tokens_per_s_solution),
    (nb10.check_kv_cache_tokens_that_fit, nb10.kv_cache_tokens_that_fit_solution),
    (nb10.check_decode_arithmetic_intensity, nb10.decode_arithmetic_intensity_solution),
    (nb10.check_admit, nb10.admit_solution),
    (nb10.check_preempt, nb10.preempt_solution),
    (nb10.check_my_generate, nb10.my_generate_solution),
]


@pytest.mark.parametrize(("check", "solution"), SOLUTIONS, ids=lambda x: getattr(x, "__name__", ""))
def test_the_solution_passes(capsys, check, solution):
    ok, out = _run(capsys, check, solution)
    assert ok and "✅" in out, out


@pytest.mark.parametrize(("check", "solution"), SOLUTIONS, ids=lambda x: getattr(x, "__name__", ""))
def test_an_unfinished_stub_is_reported_not_raised(capsys, check, solution):
    def stub(*args):
        raise NotImplementedError

    ok, out = _run(capsys, check, stub)
    assert not ok and "not attempted yet" in out


MISTAKES = [
    (nb10.check_roofline_tokens_per_s, lambda b, w: w / b, "seconds per token"),
    (nb10.check_roofline_tokens_per_s, lambda b, w: 8 * b / w, "bits"),
    (nb10.check_kv_cache_tokens_that_fit, lambda f, c, d: f / nb10.kv_bytes_per_token(c, d), "whole tokens"),
    (nb10.check_kv_cache_tokens_that_fit,
     lambda f, c, d: f // (2 * c.n_layers * c.n_heads * c.head_dim * (4 if str(d) == "torch.float32" else 2)),
     "query heads"),
    (nb10.check_kv_cache_tokens_that_fit,
     lambda f, c, d: f // (c.n_layers * c.n_kv_heads * c.head_dim * (4 if str(d) == "torch.float32" else 2)),
     "K *and* V"),
    (nb10.check_decode_arithmetic_intensity, lambda b, p: b / p, "2 flops"),
    (nb10.check_decode_arithmetic_intensity, lambda b, p: 2 / p, "grow with the batch"),
    (nb10.check_admit, nb10_mistakes.admit_strict_when_empty, "empty batch"),
    (nb10.check_admit, nb10_mistakes.admit_without_spares, "no spare block"),
    (nb10.check_admit, nb10_mistakes.admit_spares_for_newcomers_only, "running rows need a spare"),
    (nb10.check_admit, nb10_mistakes.admit_overtaking, "overtaking"),
    (nb10.check_admit, nb10_mistakes.admit_floor_blocks, "round up"),
    (nb10.check_admit, nb10_mistakes.admit_ignoring_seats, "max_batch_size"),
    (nb10.check_preempt, nb10_mistakes.preempt_oldest, "oldest"),
    (nb10.check_preempt, nb10_mistakes.preempt_the_last_row_too, "never preempt the last row"),
    (nb10.check_preempt, nb10_mistakes.preempt_counting_every_row, "only a row whose last block is full"),
    (nb10.check_preempt, nb10_mistakes.preempt_without_freeing, "go back to the pool"),
    (nb10.check_preempt, nb10_mistakes.preempt_floor_blocks, "ceil, not floor"),
] + [(nb10.check_my_generate, fn, name) for name, fn in nb10_mistakes.LOOP_MISTAKES.items()]


@pytest.mark.parametrize(("check", "wrong", "named"), MISTAKES, ids=[m[2] for m in MISTAKES])
def test_each_classic_mistake_fails_by_name(capsys, check, wrong, named):
    ok, out = _run(capsys, check, wrong)
    assert not ok and "❌" in out, out
    assert named in out, out


def test_hints_are_tiered_and_the_first_does_not_give_the_answer(capsys):
    for hints in (nb10.ROOF_HINTS, nb10.KV_HINTS, nb10.AI_HINTS, nb10.ADMIT_HINTS, nb10.PREEMPT_HINTS, nb10.LOOP_HINTS):
        assert len(hints) >= 3
        assert "return" not in hints[0] and "pop" not in hints[0]
    _, out = _run(capsys, nb10.check_admit, nb10_mistakes.admit_without_spares)
    assert "Hint" not in out and "hint=1" in out
    _, out = _run(capsys, nb10.check_admit, nb10_mistakes.admit_without_spares, hint=2)
    assert "Hint 1/3" in out and "Hint 2/3" in out and "Hint 3/3" not in out


def _loop_feeding_a_wrong_token(runner, prompts, max_new_tokens, max_batch_size):
    """The right schedule, but each decode row is fed its first token instead of its last."""
    manager = runner.cache.manager
    outputs = [[] for _ in prompts]
    waiting, running = deque(range(len(prompts))), []

    def retire():
        for i in [i for i in running if len(outputs[i]) == max_new_tokens[i]]:
            manager.free_sequence(i)
            running.remove(i)

    while waiting or running:
        todo = [prompts[i] + outputs[i][:-1] for i in waiting]
        n = nb10.admit_solution([len(t) for t in todo], len(running), manager.allocator.num_free,
                                manager.block_size, max_batch_size)
        new = [waiting.popleft() for _ in range(n)]
        if new:
            for i in new:
                manager.add_sequence(i)
            manager.reserve(new, [len(prompts[i] + outputs[i][:-1]) for i in new])
            for i, row in zip(new, runner.prefill(new, [prompts[i] + outputs[i][:-1] for i in new])):
                if not outputs[i]:
                    outputs[i].append(int(row.argmax()))
            running += new
            retire()
        if not running:
            continue
        for _ in range(nb10.preempt_solution([manager.lengths[i] for i in running], manager.allocator.num_free,
                                             manager.block_size)):
            victim = running.pop()
            manager.free_sequence(victim)
            waiting.appendleft(victim)
        manager.reserve(running, [1] * len(running))
        for i, row in zip(running, runner.decode(running, [outputs[i][0] for i in running])):
            outputs[i].append(int(row.argmax()))
        retire()
    return outputs


def test_the_right_schedule_with_wrong_tokens_fails_on_the_tokens(capsys):
    ok, out = _run(capsys, nb10.check_my_generate, _loop_feeding_a_wrong_token)
    assert not ok and "Feed decode each row's last token" in out, out


def test_a_loop_that_spins_without_calling_the_runner_is_stopped(capsys, monkeypatch):
    monkeypatch.setattr("minillm.exercises.nb10_loop.DEADLINE_S", 0.5)

    def spins(runner, prompts, max_new_tokens, max_batch_size):
        while True:
            math.sqrt(2.0)

    ok, out = _run(capsys, nb10.check_my_generate, spins)
    assert not ok and "did not finish" in out, out
