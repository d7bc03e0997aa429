"""Notebook 15's exercises: a row-parallel linear layer's forward, and which heads a rank holds.

The first runs the learner's function the way ranks run it: one thread per rank, each with its
own shard, meeting in an ``all_reduce`` that really waits for every rank and sums what they bring
(``ThreadRanks``; the package's ``Group.all_reduce`` over gloo does the same between processes).
A rank that skips the collective, or calls it once too often, leaves the others waiting: the
check says so instead of hanging.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

from minillm.distributed.shard import plan, split
from minillm.exercises import Mistake, check
from minillm.exercises import nb15_mistakes as wrong
from minillm.model.config import ModelConfig

AllReduce = Callable[[torch.Tensor], torch.Tensor]
WAIT_SECONDS = 2.0  # how long a rank waits in all_reduce for the others before the check gives up


class RanksOutOfStep(RuntimeError):
    """The ranks did not all reach the same collective."""


class ThreadRanks:
    """``world`` ranks as threads of this process, with a real all-reduce between them.

    ``all_reduce_for(rank)`` is rank ``rank``'s collective: it waits until every rank has brought
    its tensor, then each gets the sum (in rank order, so every rank's result is the same), written
    into its tensor in place and returned, as ``Group.all_reduce`` does.
    """

    def __init__(self, world: int) -> None:
        self.world = world
        self.barrier = threading.Barrier(world, timeout=WAIT_SECONDS)
        self.slots: list[torch.Tensor | None] = [None] * world
        self.calls = [0] * world

    def all_reduce_for(self, rank: int) -> AllReduce:
        def all_reduce(t: torch.Tensor) -> torch.Tensor:
            self.calls[rank] += 1
            self.slots[rank] = t.detach().clone()
            self.barrier.wait()  # every rank has brought its tensor
            total = self.slots[0].clone()
            for other in self.slots[1:]:
                total += other
            self.barrier.wait()  # every rank has read them all: the slots may be reused
            return t.copy_(total)

        return all_reduce

    def run(self, fn: Callable[..., Any], args_for: Callable[[int], tuple]) -> list[Any]:
        """``fn(*args_for(rank), all_reduce)`` on every rank at once; their results in rank order."""
        results: list[Any] = [None] * self.world
        errors: list[tuple[int, BaseException]] = []

        def rank_main(rank: int) -> None:
            try:
                results[rank] = fn(*args_for(rank), self.all_reduce_for(rank))
            except Exception as err:  # noqa: BLE001 (the learner's code may fail in any way: reported below)
                errors.append((rank, err))
                self.barrier.abort()  # the others stop waiting for this rank

        threads = [threading.Thread(target=rank_main, args=(r,), daemon=True) for r in range(self.world)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        real = [(r, e) for r, e in errors if not isinstance(e, threading.BrokenBarrierError)]
        if real:
            raise real[0][1]
        if errors:
            raise RanksOutOfStep(f"the ranks called all_reduce {self.calls} times (rank 0, 1, ...): each rank waits in "
                                 "a collective until every rank reaches it, so every rank must call it the same number "
                                 "of times, in the same order (a real run would hang until the group's timeout)")
        return results


# ------------------------------------------------------------------ exercise 1: a row-parallel linear layer
# ``fn(x, weight_shard, bias, cols, all_reduce)`` on every rank -> the layer's whole output
# x @ weight.T + bias [tokens, out]: the rank holds weight[:, cols] (its input columns), every rank
# sees the whole input x, and all_reduce sums a tensor over the ranks.

SHAPE_HELP = ("the rank's weight_shard is weight[:, cols]: [out, {k}], {k} input columns. Multiply it by the same "
              "columns of the input, x[:, cols] (every token, the rank's features): x[cols] takes some tokens (rows), "
              "and x alone has every feature.")


def run_row_parallel(fn: Callable[..., torch.Tensor], x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                     parts: Sequence[range]) -> torch.Tensor:
    """Every rank's output of ``fn``, stacked [world, tokens, out]: rank r holds input columns ``parts[r]``."""
    cols = [slice(p.start, p.stop) for p in parts]

    def args_for(rank: int) -> tuple:
        return x.clone(), weight[:, cols[rank]].clone(), bias.clone(), cols[rank]

    try:
        outputs = ThreadRanks(len(parts)).run(fn, args_for)
    except RuntimeError as err:
        if "cannot be multiplied" in str(err):  # a product of mismatched slices
            raise RuntimeError(f"{err}. 🔎 {SHAPE_HELP.format(k=len(parts[0]))}") from None
        raise
    if not all(isinstance(o, torch.Tensor) for o in outputs):
        return outputs  # the check says what came back instead
    try:
        return torch.stack(outputs)
    except RuntimeError:  # the ranks disagree on the shape
        return outputs


def row_parallel_cases() -> list[tuple[tuple, torch.Tensor]]:
    g = torch.Generator().manual_seed(15)
    cases = []
    # (tokens, in, out, the ranks' column ranges): even; three ranks; uneven; SmolLM2's o_proj over two ranks
    # (its 2 + 1 GQA groups: 384 + 192 columns); one rank (no talking at all)
    smol = plan(SMOLLM2, 2)
    for tokens, d_in, d_out, parts in [(3, 8, 5, split(8, 2)), (2, 9, 4, split(9, 3)), (4, 7, 6, split(7, 2)),
                                       (2, 576, 576, [range(s.q_rows.start, s.q_rows.stop) for s in smol]),
                                       (2, 6, 3, split(6, 1))]:
        x = torch.randn(tokens, d_in, generator=g, dtype=torch.float64)
        weight = torch.randn(d_out, d_in, generator=g, dtype=torch.float64) / d_in**0.5
        bias = torch.randn(d_out, generator=g, dtype=torch.float64)
        whole = x @ weight.T + bias
        cases.append(((x, weight, bias, parts), whole.expand(len(parts), -1, -1).clone()))
    return cases


def row_parallel_linear_solution(x: torch.Tensor, weight_shard: torch.Tensor, bias: torch.Tensor, cols: slice,
                                 all_reduce: AllReduce) -> torch.Tensor:
    partial = x[:, cols] @ weight_shard.T  # this rank's input features times its columns: a partial sum
    return all_reduce(partial) + bias  # the sum over ranks is the whole product; the bias once, after it


def _on_ranks(fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    def row_parallel_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, parts: Sequence[range]):
        return run_row_parallel(fn, x, weight, bias, parts)

    return row_parallel_linear


ROW_MISTAKES = [
    Mistake(_on_ranks(wrong.no_all_reduce), "no all-reduce: each rank returned its own partial sum (its input columns "
            "only); the layer's output is the sum of every rank's partial product: all_reduce it."),
    Mistake(_on_ranks(wrong.bias_on_every_rank), "the bias went in before the all-reduce, on every rank, so the sum "
            "holds it world times: add it once, after the all-reduce (or on rank 0 only, before it)."),
    Mistake(_on_ranks(wrong.no_bias), "the bias is missing: add it once, after the all-reduce."),
]

ROW_HINTS = [
    "x @ weight.T sums over the input features; the rank holds the features `cols` of that sum: x[:, cols] @ weight_shard.T.",
    "That partial sum is the rank's share of the output: all_reduce adds the ranks' shares, and every rank gets the total.",
    "return all_reduce(x[:, cols] @ weight_shard.T) + bias",
]


def check_row_parallel(fn: Callable[..., torch.Tensor], hint: int = 0) -> bool:
    """``fn(x, weight_shard, bias, cols, all_reduce)``, run on every rank at once, must give every
    rank the whole layer's output."""
    return check("row_parallel_linear", _on_ranks(fn), row_parallel_cases(), hint=hint, hints=ROW_HINTS,
                 mistakes=ROW_MISTAKES, atol=1e-9)


# ------------------------------------------------------------------ exercise 2: which heads a rank holds
# ``fn(n_heads, n_kv_heads, world, rank)`` -> (query heads, KV heads) of the rank, two ranges of
# head indices: whole GQA groups, consecutive, the larger shares first; ValueError when a rank
# would get no whole group.

SMOLLM2 = ModelConfig(vocab_size=49152, hidden_size=576, n_layers=30, n_heads=9, n_kv_heads=3,
                      intermediate_size=1536, tie_word_embeddings=True)
# (n_heads, n_kv_heads, world): SmolLM2 over 2 (2 + 1 groups), over 3, alone; Llama-3-8B's 32/8 over 3;
# multi-head attention (groups of 1); groups of 4 over 2; too many ranks twice
HEAD_CASES = [(9, 3, 2), (9, 3, 3), (9, 3, 1), (32, 8, 3), (4, 4, 3), (8, 2, 2), (9, 3, 4), (6, 3, 5)]
REFUSED = "ValueError"


def package_layout(n_heads: int, n_kv_heads: int, world: int) -> list[tuple[list[int], list[int]]] | str:
    """``shard.plan``'s answer: each rank's (query heads, KV heads), or "ValueError" if it refuses."""
    config = ModelConfig(vocab_size=4096, hidden_size=8 * n_heads, n_layers=1, n_heads=n_heads,
                         n_kv_heads=n_kv_heads, intermediate_size=256)
    try:
        return [(list(s.q_heads), list(s.kv_heads)) for s in plan(config, world)]
    except ValueError:
        return REFUSED


def _layout_of(fn: Callable[[int, int, int, int], tuple]) -> Callable[[int, int, int], Any]:
    def layout(n_heads: int, n_kv_heads: int, world: int) -> list[tuple[list[int], list[int]]] | str:
        try:
            answers = [fn(n_heads, n_kv_heads, world, rank) for rank in range(world)]
        except ValueError:
            return REFUSED
        return [(list(q), list(kv)) for q, kv in answers]

    layout.__name__ = getattr(fn, "__name__", "rank_heads")
    return layout


def rank_heads_solution(n_heads: int, n_kv_heads: int, world: int, rank: int) -> tuple[range, range]:
    if world > n_kv_heads:
        raise ValueError(f"{n_kv_heads} KV heads cannot give {world} ranks a whole GQA group each")
    group = n_heads // n_kv_heads  # query heads per KV head
    base, extra = divmod(n_kv_heads, world)  # the first `extra` ranks take one more group
    start = rank * base + min(rank, extra)
    kv = range(start, start + base + (rank < extra))
    return range(kv.start * group, kv.stop * group), kv


HEAD_MISTAKES = [
    Mistake(_layout_of(wrong.query_heads_split_alone), "the query heads were split on their own: a rank's query "
            "heads must be exactly the ones its KV heads serve (KV head h serves query heads h*g .. h*g + g - 1, "
            "g = n_heads // n_kv_heads), or its attention would need another rank's keys. Split the KV heads, then "
            "take their groups of query heads."),
    Mistake(_layout_of(wrong.remainder_to_the_last), "the uneven split gave the extra group to the last ranks; the "
            "package gives it to the first ones (shard.split: 3 over 2 is 2 + 1), and every rank and the loader must "
            "agree on one layout."),
    Mistake(_layout_of(wrong.remainder_dropped), "n_kv_heads // world groups per rank drops the remainder: the last "
            "KV heads (and their query heads) belong to no rank. The first n_kv_heads % world ranks take one more."),
    Mistake(_layout_of(wrong.query_heads_are_kv_heads), "the query heads are numbered apart from the KV heads: KV "
            "heads a..b serve query heads a*g .. b*g (g = n_heads // n_kv_heads query heads per group)."),
    Mistake(_layout_of(wrong.round_robin), "round robin (KV head h to rank h % world) keeps groups whole, but a rank's "
            "heads must be one consecutive block: its slice of q_proj and k/v_proj is then one range of rows."),
    Mistake(_layout_of(wrong.no_error_for_too_many_ranks), "more ranks than KV heads must raise a ValueError: some "
            "rank would get no whole group (an empty range), and a GQA group cannot be cut between ranks."),
]

HEAD_HINTS = [
    ("Split the KV heads first, in consecutive blocks whose sizes differ by at most one, the larger first; "
     "raise ValueError when world > n_kv_heads."),
    "base, extra = divmod(n_kv_heads, world): rank r gets base + (r < extra) KV heads, starting at r * base + min(r, extra).",
    "With g = n_heads // n_kv_heads, KV heads range(a, b) serve query heads range(a * g, b * g).",
]


def check_rank_heads(fn: Callable[[int, int, int, int], tuple], hint: int = 0) -> bool:
    """``fn(n_heads, n_kv_heads, world, rank)`` -> (query heads, KV heads); compared, rank by rank,
    with ``minillm.distributed.shard.plan``."""
    cases = [(args, package_layout(*args)) for args in HEAD_CASES]
    return check("rank_heads", _layout_of(fn), cases, hint=hint, hints=HEAD_HINTS, mistakes=HEAD_MISTAKES)
