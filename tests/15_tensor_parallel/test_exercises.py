"""Notebook 15's exercises: the solutions pass, every classic mistake fails with the message naming it,
an unfinished stub reports ⏳ without raising, and ranks out of step are named instead of hanging."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from minillm.distributed.layers import RowParallel
from minillm.exercises import nb15
from minillm.exercises import nb15_mistakes as wrong

CHECKS = {
    "row": (nb15.check_row_parallel, nb15.row_parallel_linear_solution, nb15.ROW_MISTAKES),
    "heads": (nb15.check_rank_heads, nb15.rank_heads_solution, nb15.HEAD_MISTAKES),
}

NAMED = [
    ("row", wrong.no_all_reduce, "no all-reduce"),
    ("row", wrong.bias_on_every_rank, "the bias went in before the all-reduce"),
    ("row", wrong.no_bias, "the bias is missing"),
    ("heads", wrong.query_heads_split_alone, "split on their own"),
    ("heads", wrong.remainder_to_the_last, "gave the extra group to the last ranks"),
    ("heads", wrong.remainder_dropped, "drops the remainder"),
    ("heads", wrong.query_heads_are_kv_heads, "numbered apart from the KV heads"),
    ("heads", wrong.round_robin, "round robin"),
    ("heads", wrong.no_error_for_too_many_ranks, "must raise a ValueError"),
]


@pytest.mark.parametrize("name", CHECKS)
def test_the_solution_passes(name, capsys):
    check, solution, _ = CHECKS[name]
    assert check(solution)
    assert "✅" in capsys.readouterr().out


def test_every_mistake_is_fed():
    fed = {fn.__name__ for _, fn, _ in NAMED}
    for _, _, mistakes in CHECKS.values():
        for m in mistakes:
            # the row exercise's mistakes are wrapped to run on threads; their names are the learner's
            inner = m.wrong.__closure__[0].cell_contents if m.wrong.__closure__ else m.wrong
            assert inner.__name__ in fed, inner.__name__


@pytest.mark.parametrize("name, fn, words", NAMED, ids=[fn.__name__ for _, fn, _ in NAMED])
def test_a_classic_mistake_is_named(name, fn, words, capsys):
    check = CHECKS[name][0]
    assert not check(fn)
    out = capsys.readouterr().out
    assert "❌" in out and "🔎" in out and words in out, out


@pytest.mark.parametrize("fn", [wrong.input_rows, wrong.whole_input])
def test_slicing_the_input_wrongly_says_which_columns(fn, capsys):
    assert not nb15.check_row_parallel(fn)
    out = capsys.readouterr().out
    assert "❌" in out and "x[:, cols]" in out and "x[cols] takes some tokens" in out, out


def test_a_rank_that_skips_the_all_reduce_is_named_not_hung(capsys):
    def only_rank_zero_talks(x, weight_shard, bias, cols, all_reduce):
        partial = x[:, cols] @ weight_shard.T
        return (all_reduce(partial) if cols.start == 0 else partial) + bias

    assert not nb15.check_row_parallel(only_rank_zero_talks)
    out = capsys.readouterr().out
    assert "RanksOutOfStep" in out and "same number of times" in out, out


def test_the_cases_are_what_one_process_computes():
    for (x, weight, bias, parts), want in nb15.row_parallel_cases():
        assert [i for p in parts for i in p] == list(range(x.shape[1]))  # the ranks' columns tile the input
        assert torch.allclose(want[0], torch.nn.functional.linear(x, weight, bias), atol=1e-12)
    assert nb15.package_layout(9, 3, 2) == [([0, 1, 2, 3, 4, 5], [0, 1]), ([6, 7, 8], [2])]
    assert nb15.package_layout(9, 3, 4) == nb15.REFUSED


def test_thread_ranks_run_the_packages_row_parallel_layer():
    """The exercise's threads are a group the package's ``RowParallel`` runs on, and agree with the solution."""
    (x, weight, bias, parts), want = nb15.row_parallel_cases()[3]  # SmolLM2's o_proj shape, 2 + 1 groups

    def package(x, weight_shard, bias, cols, all_reduce):
        layer = torch.nn.Linear(weight_shard.shape[1], weight_shard.shape[0], bias=False, dtype=x.dtype)
        layer.weight.data = weight_shard
        return RowParallel(layer, SimpleNamespace(all_reduce=all_reduce))(x[:, cols]) + bias

    cols = [slice(p.start, p.stop) for p in parts]
    outputs = nb15.ThreadRanks(len(parts)).run(package, lambda r: (x, weight[:, cols[r]], bias, cols[r]))
    for out in outputs:
        assert torch.allclose(out, want[0], atol=1e-12)


@pytest.mark.parametrize("name", CHECKS)
def test_an_unfinished_stub_waits(name, capsys):
    def stub(*args):
        raise NotImplementedError
    assert not CHECKS[name][0](stub)
    assert "⏳" in capsys.readouterr().out


@pytest.mark.parametrize("name", CHECKS)
def test_hints_are_tiered(name, capsys):
    def broken(*args):
        raise TypeError("oops")
    CHECKS[name][0](broken, hint=3)
    assert "Hint 3/3" in capsys.readouterr().out
