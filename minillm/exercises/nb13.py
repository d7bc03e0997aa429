"""Exercises of notebook 13 (structured output): the subset construction, the tokens a DFA state
allows, and the grammar mask in the sampler.

Every expected answer comes from the package: languages are compared with
``minillm.structured.find_difference`` against ``compile_regex`` (two DFAs are right when no byte
string tells them apart, whatever their state numbering), allowed tokens with a ``TokenIndex`` over
the same small vocabulary, and masked distributions with ``apply_grammar`` followed by
``minillm.sampling``'s processors. The classic mistakes live in ``nb13_mistakes``.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from minillm.exercises import Mistake, check
from minillm.exercises import nb13_mistakes as wrong
from minillm.sampling import SamplingParams
from minillm.sampling.sampler import filtered_distribution
from minillm.structured import DFA, NFA, GrammarState, TokenIndex, VocabTrie, apply_grammar, compile_regex, find_difference
from minillm.structured.nfa import pattern_to_nfa

# ------------------------------------------------------------------ exercise 1: the subset construction
# The learner gets a Thompson NFA (``nfa.eps[s]``: epsilon targets, ``nfa.edge[s]``: None or
# ``(lo, hi, target)``, ``nfa.start``, ``nfa.accept``) and returns ``(table, accepting)``:
# ``table[i][b]`` the state after byte ``b`` (a list of 256 ints per state), state 0 the dead
# state (the empty set), state 1 the start; ``accepting[i]`` a bool per state.

SUBSET_PATTERNS = ["a*", "ab", "a|bc", "(ab)*c", r"[0-9]+(\.[0-9]+)?", "x{0,3}y", "(a|)b", "é+|e"]


def as_dfa(result: tuple[list[list[int]], list[bool]]) -> DFA:
    """The learner's ``(table, accepting)`` as a package ``DFA`` (one byte class per byte)."""
    table, accepting = result
    return DFA(np.asarray(table, dtype=np.int32).reshape(len(table), 256), np.arange(256, dtype=np.int32),
               np.asarray(accepting, dtype=bool), 1)


class Automaton:
    """A result of exercise 1 as the check sees it: its DFA, the function that built it, and
    (once compared) a byte string on which it disagrees with the expected language, named in its repr."""

    def __init__(self, dfa: DFA, who: str, fn: Callable[[NFA], DFA] | None = None) -> None:
        self.dfa, self.who, self.fn, self.witness = dfa, who, fn, None

    def __repr__(self) -> str:
        text = f"{self.who} ({self.dfa.n_states} states)"
        if self.witness is not None:
            verdict = "accepts" if self.dfa.matches(self.witness) else "rejects"
            text += f", which {verdict} {self.witness!r} (the pattern does the opposite)"
        return text


def same_language(got: Automaton, want: Automaton) -> bool:
    """Against the expected answer: no byte string is accepted by one and rejected by the other.
    Against a classic mistake (``want.fn`` set): the same states and language on every pattern of
    the exercise (many mistakes give the empty language: the number of subsets tells them apart)."""
    if want.fn is None or got.fn is None:
        got.witness = find_difference(got.dfa, want.dfa)
        return got.witness is None
    for pattern in SUBSET_PATTERNS:
        a, b = got.fn(nfa_of(pattern)), want.fn(nfa_of(pattern))
        if a.n_states != b.n_states or find_difference(a, b) is not None:
            return False
    return True


def _as_automaton(fn: Callable[[NFA], tuple[list[list[int]], list[bool]]]) -> Callable[[NFA], Automaton]:
    def build(nfa: NFA) -> DFA:
        return as_dfa(fn(nfa))

    def run(nfa: NFA) -> Automaton:
        return Automaton(build(nfa), "a DFA", build)
    run.__name__ = getattr(fn, "__name__", "subset_construction")
    return run


class _Pattern(NFA):
    """An NFA that prints as the pattern it was compiled from (for the check's messages)."""

    pattern = ""

    def __repr__(self) -> str:
        return f"pattern_to_nfa({self.pattern!r})"


def nfa_of(pattern: str) -> NFA:
    nfa = pattern_to_nfa(pattern)
    out = _Pattern(nfa.eps, nfa.edge, nfa.start, nfa.accept)
    out.pattern = pattern
    return out


def subset_construction_solution(nfa: NFA) -> tuple[list[list[int]], list[bool]]:
    def closure(states: set[int]) -> frozenset[int]:
        seen, todo = set(states), list(states)
        while todo:  # follow epsilon moves until nothing new: the closure is transitive
            for t in nfa.eps[todo.pop()]:
                if t not in seen:
                    seen.add(t)
                    todo.append(t)
        return frozenset(seen)

    start = closure({nfa.start})
    ids, sets, table = {frozenset(): 0, start: 1}, [frozenset(), start], [[0] * 256]
    i = 1
    while i < len(sets):  # breadth-first: every set discovered gets a row
        row = []
        for byte in range(256):
            moved = {e[2] for s in sets[i] if (e := nfa.edge[s]) is not None and e[0] <= byte <= e[1]}
            target = closure(moved)
            if target not in ids:
                ids[target] = len(sets)
                sets.append(target)
            row.append(ids[target])
        table.append(row)
        i += 1
    return table, [nfa.accept in s for s in sets]


SUBSET_MISTAKES = [
    Mistake(_as_automaton(wrong.start_not_closed), "the start state must be the epsilon-closure of nfa.start: the NFA can "
            "follow epsilon moves before reading any byte."),
    Mistake(_as_automaton(wrong.moves_not_closed), "after each byte move, take the epsilon-closure of the states reached: "
            "a Thompson NFA needs epsilon moves to get from one piece of the pattern to the next."),
    Mistake(_as_automaton(wrong.closure_one_step), "the closure follows only one epsilon move; it must follow them until "
            "nothing new is reached (chains of epsilons: x{0,3} nests three optional copies)."),
    Mistake(_as_automaton(wrong.accept_all_members), "a DFA state accepts when *any* of its NFA states is nfa.accept (the NFA "
            "is in all of them at once, and one path to the end is enough), not when all are."),
]

SUBSET_HINTS = [
    "A DFA state is a frozenset of NFA states. Start from closure({nfa.start}); for each set and each byte, "
    "collect the targets of the edges (lo, hi, target) whose range holds the byte, then close them.",
    "closure(states): a stack, follow nfa.eps[s] until nothing new is seen. Number the sets as you discover "
    "them: frozenset() -> 0 (dead), the start -> 1; process sets[i] for i = 1, 2, ... until none is left.",
    "Row i: [ids[closure({e[2] for s in sets[i] if (e := nfa.edge[s]) and e[0] <= b <= e[1]})] for b in range(256)] "
    "(adding new sets as they appear); accepting[i] = nfa.accept in sets[i].",
]


def check_subset_construction(fn: Callable[[NFA], tuple[list[list[int]], list[bool]]], hint: int = 0) -> bool:
    """``fn(nfa)`` -> ``(table, accepting)`` accepting the language of the NFA's pattern."""
    cases = [((nfa_of(p),), Automaton(compile_regex(p), f"the minimal DFA of {p!r}")) for p in SUBSET_PATTERNS]
    return check("subset_construction", _as_automaton(fn), cases, hint=hint, hints=SUBSET_HINTS, equal=same_language,
                 mistakes=SUBSET_MISTAKES)


# ------------------------------------------------------------------ exercise 2: the allowed tokens of a state
# ``fn(dfa, state, vocab, eos_id)`` -> the sorted list of allowed token ids: an ordinary token
# (``vocab``: id -> bytes) when its bytes walked from ``state`` do not reach the dead state, and
# ``eos_id`` exactly when ``state`` accepts.

VOCAB = {0: b"1", 1: b"2", 2: b"12", 3: b"-", 4: b"1-", 5: b"-1", 6: b"2-1", 7: b"12-",
         8: "é".encode(), 9: "é1".encode(), 10: b"e", 11: b"\xc3", 12: b"a", 13: b"1a"}
EOS = 14
ALLOWED_CASES = [(r"[12]+(-[12]+)?", None), (r"[12]+(-[12]+)?", b"1"), (r"[12]+(-[12]+)?", b"1-"),
                 (r"[12]+(-[12]+)?", b"1-2"), (r"(é|e)[12]", None), (r"(é|e)[12]", b"\xc3"),
                 (r"(é|e)[12]", "é".encode())]


class _State(int):
    """A DFA state that prints as the bytes that lead to it."""

    prefix = b""

    def __repr__(self) -> str:
        return f"state after {self.prefix!r}"


class _Dfa(DFA):
    pattern = ""

    def __repr__(self) -> str:
        return f"compile_regex({self.pattern!r})"


def dfa_of(pattern: str) -> DFA:
    d = compile_regex(pattern)
    out = _Dfa(d.table, d.byte_class, d.accepting, d.start)
    object.__setattr__(out, "pattern", pattern)
    return out


def package_allowed(dfa: DFA, state: int, vocab: dict[int, bytes], eos_id: int) -> list[int]:
    """The package's answer: a ``TokenIndex`` over the vocabulary (eos left out of the trie)."""
    index = TokenIndex(dfa, VocabTrie.build(dict(vocab), max(max(vocab), eos_id) + 1), [eos_id])
    return index.allowed_ids(int(state)).tolist()


def allowed_tokens_solution(dfa: DFA, state: int, vocab: dict[int, bytes], eos_id: int) -> list[int]:
    allowed = [i for i, data in vocab.items() if dfa.walk(data, state) != 0]  # 0: the dead state
    if dfa.accepting[state]:
        allowed.append(eos_id)
    return sorted(allowed)


ALLOWED_MISTAKES = [
    Mistake(wrong.first_byte_only, "you allowed a token whose *first* byte fits but whose later bytes do not: walk "
            "every byte of the token, and allow it only if the state after the last one is not dead."),
    Mistake(wrong.only_completing, "you allowed only tokens that end in an accepting state; a token is allowed "
            "when the output stays a viable *prefix* (state not dead): the rest can come later."),
    Mistake(wrong.eos_never, "eos (end of sequence) is never in your set: allow it in accepting states, or a "
            "finished match can never stop."),
    Mistake(wrong.eos_always, "you allowed eos in every state: it is allowed only where the output so far is a "
            "whole match (dfa.accepting[state]), or the model may stop halfway."),
    Mistake(wrong.characters_not_bytes, "you walked the token's characters (ord of each), not its bytes: 'é' is "
            "two bytes in UTF-8 (0xC3 0xA9), and the DFA reads bytes."),
]

ALLOWED_HINTS = [
    "For each token, walk its bytes through the DFA from `state` (dfa.walk(data, state) or dfa.step byte by "
    "byte) and keep the token if the result is not the dead state 0.",
    "A bytes object iterates as ints (its bytes): no decoding. Then eos: allowed iff dfa.accepting[state].",
    "sorted([i for i, data in vocab.items() if dfa.walk(data, state) != 0] + ([eos_id] if dfa.accepting[state] else []))",
]


def allowed_cases() -> list[tuple[tuple, list[int]]]:
    cases = []
    for pattern, prefix in ALLOWED_CASES:
        dfa = dfa_of(pattern)
        state = _State(dfa.walk(prefix) if prefix is not None else dfa.start)
        state.prefix = prefix or b""
        cases.append(((dfa, state, VOCAB, EOS), package_allowed(dfa, state, VOCAB, EOS)))
    return cases


def check_allowed_tokens(fn: Callable[[DFA, int, dict[int, bytes], int], list[int]], hint: int = 0) -> bool:
    """``fn(dfa, state, vocab, eos_id)`` -> the sorted ids allowed in ``state``."""
    def equal(got: object, want: list[int]) -> bool:
        return isinstance(got, list) and [int(i) for i in got] == want
    return check("allowed_tokens", fn, allowed_cases(), hint=hint, hints=ALLOWED_HINTS, equal=equal,
                 mistakes=ALLOWED_MISTAKES)


# ------------------------------------------------------------------ exercise 3: the mask in the sampler
# ``fn(logits [rows, vocab], allowed bool [rows, vocab], temperature, top_k)`` -> the probabilities
# the sampler draws from: disallowed tokens -inf first, then temperature, then top-k, then softmax.

MASK_PATTERNS = [r"[0-9]+", r"(yes|no)", r"[a-c]{2}"]
MASK_VOCAB = {i: bytes([b]) for i, b in enumerate(b"0123456789abcdefnoysx ")} | {22: b"yes", 23: b"no", 24: b"ab"}


def _grammar(pattern: str) -> GrammarState:
    index = TokenIndex(compile_regex(pattern), VocabTrie.build(MASK_VOCAB, 26), [25])
    return GrammarState(index)


def package_masked_probs(logits: torch.Tensor, grammars: list[GrammarState], temperature: float,
                         top_k: int) -> torch.Tensor:
    """The package's path: ``apply_grammar`` on every row (as ``sample_batch`` calls it), then the processors."""
    masked = apply_grammar(logits, list(range(len(grammars))), grammars)
    params = SamplingParams(temperature=temperature, top_k=top_k)
    return filtered_distribution(masked, torch.empty(len(grammars), 0, dtype=torch.long), params)


def masked_probs_solution(logits: torch.Tensor, allowed: torch.Tensor, temperature: float, top_k: int) -> torch.Tensor:
    scores = logits.masked_fill(~allowed, float("-inf"))  # first: a disallowed token can never come back
    scores = scores / temperature
    kth = scores.topk(top_k, dim=-1).values[:, -1:]  # the k-th best *allowed* score of each row
    return scores.masked_fill(scores < kth, float("-inf")).softmax(dim=-1)


MASK_MISTAKES = [
    Mistake(wrong.mask_after_softmax, "you zeroed the disallowed probabilities after the softmax without "
            "renormalising: each row must sum to 1. Mask the logits with -inf *before* the softmax."),
    Mistake(wrong.mask_with_zero, "you set the disallowed logits to 0, not -inf: a logit of 0 is an ordinary "
            "score (e^0 = 1), so those tokens keep a probability. -inf gives exactly 0."),
    Mistake(wrong.mask_after_top_k, "you masked after top-k: top-k kept the k best of *all* tokens, then the mask "
            "removed some of them, so fewer than k allowed tokens remain. Mask first (the package's order)."),
]

MASK_HINTS = [
    "Order: logits.masked_fill(~allowed, -inf), then / temperature, then top-k, then softmax over the last dim.",
    "Top-k: the k-th largest score per row is scores.topk(k, dim=-1).values[:, -1:]; set every score below it to -inf.",
    "scores = logits.masked_fill(~allowed, float('-inf')) / temperature; kth = scores.topk(top_k, -1).values[:, -1:]; "
    "return scores.masked_fill(scores < kth, float('-inf')).softmax(-1)",
]


def mask_cases() -> list[tuple[tuple, torch.Tensor]]:
    g = torch.Generator().manual_seed(13)
    cases = []
    for temperature, top_k in ((1.0, 3), (0.7, 2), (1.5, 5)):
        logits = torch.randn(len(MASK_PATTERNS), 26, generator=g) * 3
        logits[:, 10:16] += 4.0  # letters the grammars mostly forbid are the model's favourites
        grammars = [_grammar(p) for p in MASK_PATTERNS]
        allowed = torch.from_numpy(np.stack([g.allowed() for g in grammars]))
        want = package_masked_probs(logits, grammars, temperature, top_k)
        cases.append(((logits, allowed, temperature, top_k), want))
    return cases


def check_masked_probs(fn: Callable[[torch.Tensor, torch.Tensor, float, int], torch.Tensor], hint: int = 0) -> bool:
    """``fn(logits, allowed, temperature, top_k)`` -> the probabilities the sampler draws from."""
    return check("masked_probs", fn, mask_cases(), hint=hint, hints=MASK_HINTS, mistakes=MASK_MISTAKES)
