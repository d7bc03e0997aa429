"""The classic wrong answers of notebook 13's exercises, written as a learner would write them.

``minillm.exercises.nb13`` names each one when a learner's answer equals its result.
"""

from __future__ import annotations

import torch

from minillm.structured import DFA, NFA


# ------------------------------------------------------------------ the subset construction
def _subsets(nfa: NFA, close_start: bool = True, close_moves: bool = True, transitive: bool = True,
             accept_all: bool = False) -> tuple[list[list[int]], list[bool]]:
    def closure(states: set[int]) -> frozenset[int]:
        seen, todo = set(states), list(states)
        while todo:
            for t in nfa.eps[todo.pop()]:
                if t not in seen:
                    seen.add(t)
                    if transitive:
                        todo.append(t)
        return frozenset(seen)

    start = closure({nfa.start}) if close_start else frozenset({nfa.start})
    ids, sets, table = {frozenset(): 0, start: 1}, [frozenset(), start], [[0] * 256]
    i = 1
    while i < len(sets):
        row = []
        for byte in range(256):
            moved = {e[2] for s in sets[i] if (e := nfa.edge[s]) is not None and e[0] <= byte <= e[1]}
            target = closure(moved) if close_moves else frozenset(moved)
            if target not in ids:
                ids[target] = len(sets)
                sets.append(target)
            row.append(ids[target])
        table.append(row)
        i += 1
    if accept_all:
        return table, [bool(s) and all(x == nfa.accept for x in s) for s in sets]
    return table, [nfa.accept in s for s in sets]


def start_not_closed(nfa: NFA) -> tuple[list[list[int]], list[bool]]:
    return _subsets(nfa, close_start=False)


def moves_not_closed(nfa: NFA) -> tuple[list[list[int]], list[bool]]:
    return _subsets(nfa, close_moves=False)


def closure_one_step(nfa: NFA) -> tuple[list[list[int]], list[bool]]:
    return _subsets(nfa, transitive=False)


def accept_all_members(nfa: NFA) -> tuple[list[list[int]], list[bool]]:
    return _subsets(nfa, accept_all=True)


# ------------------------------------------------------------------ the allowed tokens
def _eos(dfa: DFA, state: int, eos_id: int) -> list[int]:
    return [eos_id] if dfa.accepting[state] else []


def first_byte_only(dfa: DFA, state: int, vocab: dict[int, bytes], eos_id: int) -> list[int]:
    return sorted([i for i, data in vocab.items() if dfa.step(state, data[0]) != 0] + _eos(dfa, state, eos_id))


def only_completing(dfa: DFA, state: int, vocab: dict[int, bytes], eos_id: int) -> list[int]:
    return sorted([i for i, data in vocab.items() if dfa.accepting[dfa.walk(data, state)]] + _eos(dfa, state, eos_id))


def eos_never(dfa: DFA, state: int, vocab: dict[int, bytes], eos_id: int) -> list[int]:
    return sorted(i for i, data in vocab.items() if dfa.walk(data, state) != 0)


def eos_always(dfa: DFA, state: int, vocab: dict[int, bytes], eos_id: int) -> list[int]:
    return sorted([i for i, data in vocab.items() if dfa.walk(data, state) != 0] + [eos_id])


def characters_not_bytes(dfa: DFA, state: int, vocab: dict[int, bytes], eos_id: int) -> list[int]:
    allowed = []
    for i, data in vocab.items():
        s = state
        for ch in data.decode("utf-8", errors="replace"):
            s = dfa.step(s, ord(ch)) if ord(ch) < 256 else 0
        if s != 0:
            allowed.append(i)
    return sorted(allowed + _eos(dfa, state, eos_id))


# ------------------------------------------------------------------ the mask in the sampler
def _top_k(scores: torch.Tensor, k: int) -> torch.Tensor:
    kth = scores.topk(k, dim=-1).values[:, -1:]
    return scores.masked_fill(scores < kth, float("-inf"))


def mask_after_softmax(logits: torch.Tensor, allowed: torch.Tensor, temperature: float, top_k: int) -> torch.Tensor:
    return _top_k(logits / temperature, top_k).softmax(dim=-1) * allowed


def mask_with_zero(logits: torch.Tensor, allowed: torch.Tensor, temperature: float, top_k: int) -> torch.Tensor:
    return _top_k(logits.masked_fill(~allowed, 0.0) / temperature, top_k).softmax(dim=-1)


def mask_after_top_k(logits: torch.Tensor, allowed: torch.Tensor, temperature: float, top_k: int) -> torch.Tensor:
    return _top_k(logits / temperature, top_k).masked_fill(~allowed, float("-inf")).softmax(dim=-1)
