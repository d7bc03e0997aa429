"""The classic wrong answers of notebook 15's exercises, written as a learner would write them.

``minillm.exercises.nb15`` names each one when a learner's answer equals its result.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

AllReduce = Callable[[torch.Tensor], torch.Tensor]


# ------------------------------------------------------------------ a row-parallel linear layer
def no_all_reduce(x: torch.Tensor, weight_shard: torch.Tensor, bias: torch.Tensor, cols: slice,
                  all_reduce: AllReduce) -> torch.Tensor:
    return x[:, cols] @ weight_shard.T + bias


def bias_on_every_rank(x: torch.Tensor, weight_shard: torch.Tensor, bias: torch.Tensor, cols: slice,
                       all_reduce: AllReduce) -> torch.Tensor:
    return all_reduce(x[:, cols] @ weight_shard.T + bias)


def no_bias(x: torch.Tensor, weight_shard: torch.Tensor, bias: torch.Tensor, cols: slice,
            all_reduce: AllReduce) -> torch.Tensor:
    return all_reduce(x[:, cols] @ weight_shard.T)


def input_rows(x: torch.Tensor, weight_shard: torch.Tensor, bias: torch.Tensor, cols: slice,
               all_reduce: AllReduce) -> torch.Tensor:
    return all_reduce(x[cols] @ weight_shard.T) + bias  # some tokens, every feature


def whole_input(x: torch.Tensor, weight_shard: torch.Tensor, bias: torch.Tensor, cols: slice,
                all_reduce: AllReduce) -> torch.Tensor:
    return all_reduce(x @ weight_shard.T) + bias


# ------------------------------------------------------------------ which heads a rank holds
def _split(total: int, parts: int, rank: int, larger_first: bool = True) -> range:
    base, extra = divmod(total, parts)
    sizes = [base + (i < extra) for i in range(parts)]
    if not larger_first:
        sizes.reverse()
    start = sum(sizes[:rank])
    return range(start, start + sizes[rank])


def query_heads_split_alone(n_heads: int, n_kv_heads: int, world: int, rank: int) -> tuple[range, range]:
    if world > n_kv_heads:
        raise ValueError("too many ranks")
    return _split(n_heads, world, rank), _split(n_kv_heads, world, rank)


def remainder_to_the_last(n_heads: int, n_kv_heads: int, world: int, rank: int) -> tuple[range, range]:
    if world > n_kv_heads:
        raise ValueError("too many ranks")
    group = n_heads // n_kv_heads
    kv = _split(n_kv_heads, world, rank, larger_first=False)
    return range(kv.start * group, kv.stop * group), kv


def remainder_dropped(n_heads: int, n_kv_heads: int, world: int, rank: int) -> tuple[range, range]:
    if world > n_kv_heads:
        raise ValueError("too many ranks")
    group, per_rank = n_heads // n_kv_heads, n_kv_heads // world
    kv = range(rank * per_rank, (rank + 1) * per_rank)
    return range(kv.start * group, kv.stop * group), kv


def query_heads_are_kv_heads(n_heads: int, n_kv_heads: int, world: int, rank: int) -> tuple[range, range]:
    if world > n_kv_heads:
        raise ValueError("too many ranks")
    kv = _split(n_kv_heads, world, rank)
    return kv, kv


def round_robin(n_heads: int, n_kv_heads: int, world: int, rank: int) -> tuple[list[int], list[int]]:
    if world > n_kv_heads:
        raise ValueError("too many ranks")
    group = n_heads // n_kv_heads
    kv = list(range(rank, n_kv_heads, world))
    return [h * group + i for h in kv for i in range(group)], kv


def no_error_for_too_many_ranks(n_heads: int, n_kv_heads: int, world: int, rank: int) -> tuple[range, range]:
    group = n_heads // n_kv_heads
    kv = _split(n_kv_heads, world, rank)  # an empty range for the ranks past the KV heads
    return range(kv.start * group, kv.stop * group), kv
