"""NFA -> DFA over bytes: the subset construction, then minimization (notebook 13, step 2).

An NFA can be in many states at once; running it costs a set operation per byte. A DFA is in
exactly one state, and one byte is one table lookup: ``state = table[state, class_of[byte]]``.
The subset construction gets there by making *each set of NFA states the NFA can be in* a
single DFA state, discovered breadth-first from the start set.

Three ideas keep it small and fast:

* **byte classes**: bytes that no transition of the NFA tells apart (every range edge contains
  both or neither) behave identically, so the table has one column per class, not per byte.
  ``[a-z]+@[a-z]+`` has 4 classes: ``a-z``, ``@``, and the bytes below and above.
* **the dead state**: row 0 of the table is the state from which nothing can be accepted; it
  loops to itself. After the construction every state that cannot reach an accepting state
  (``trim``) is sent there, so "is this prefix still viable?" is just ``state != 0``: this is
  what the token index asks of every token.
* **minimization** (Hopcroft's partition refinement): start from two blocks, accepting and
  not, and split a block whenever two of its states go to different blocks on some class; when
  no block splits, states of one block are interchangeable and merge. Schemas with repeated
  sub-structures (the same string rule for every property) shrink a lot, and every state the
  index never has to explore is vocabulary walks saved.

The subset construction can blow up exponentially (``(a|b)*a(a|b){20}`` needs 2**21 states:
the DFA must remember the last 21 bytes). It stops at ``MAX_DFA_STATES`` with a
``GrammarTooLarge`` naming the limit, and the work per state is bounded by the NFA size, so
a hostile pattern costs at most a second or two before it is refused.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass

import numpy as np

from minillm.structured.nfa import MAX_NFA_STATES, NFA, pattern_to_nfa
from minillm.structured.regex import GrammarTooLarge

MAX_DFA_STATES = 10_000
# The subset construction's work: NFA states visited, summed over the DFA states it makes. A
# pattern with few DFA states can still make each one a set of thousands of NFA states
# ("[a-z]{1,400}" forty times over: after k letters the input may be in any of the 40 parts), and
# the time goes with the sum. Bounding it bounds the time (about a second) whatever the pattern.
MAX_SUBSET_WORK = 2_000_000
DEAD = 0


@dataclass(frozen=True, eq=False)
class DFA:
    """A deterministic automaton over bytes.

    ``table[state, byte_class[b]]`` is the state after byte ``b``; row ``DEAD`` (0) is the dead
    state; ``accepting[state]`` says whether the bytes read so far form a whole match.
    """

    table: np.ndarray  # int32 [n_states, n_classes]
    byte_class: np.ndarray  # int32 [256]
    accepting: np.ndarray  # bool [n_states]
    start: int

    @property
    def n_states(self) -> int:
        return self.table.shape[0]

    def step(self, state: int, byte: int) -> int:
        return int(self.table[state, self.byte_class[byte]])

    def walk(self, data: bytes, state: int | None = None) -> int:
        """The state after reading ``data`` from ``state`` (the start by default)."""
        state = self.start if state is None else state
        for byte in data:
            state = int(self.table[state, self.byte_class[byte]])
            if state == DEAD:
                break
        return state

    def matches(self, data: bytes) -> bool:
        return bool(self.accepting[self.walk(data)])

    def is_prefix(self, data: bytes) -> bool:
        """Whether ``data`` can still be completed into a match."""
        return self.walk(data) != DEAD


# ------------------------------------------------------------------------------ construction
def byte_classes(nfa: NFA) -> np.ndarray:
    """Class id of each byte: bytes between the same range boundaries share a class."""
    cuts = np.zeros(257, dtype=bool)
    for edge in nfa.edge:
        if edge is not None:
            cuts[edge[0]] = cuts[edge[1] + 1] = True
    cuts[0] = False
    return np.cumsum(cuts[:256]).astype(np.int32)


def determinize(nfa: NFA, max_states: int = MAX_DFA_STATES, max_work: int = MAX_SUBSET_WORK) -> DFA:
    """The subset construction (untrimmed, unminimized): DFA state ``k`` is a set of NFA states."""
    classes = byte_classes(nfa)
    n_classes = int(classes[-1]) + 1
    # Each range edge covers a contiguous run of classes (classes are intervals, in byte order).
    moves = [None if e is None else (int(classes[e[0]]), int(classes[e[1]]), e[2]) for e in nfa.edge]
    closures: dict[int, frozenset[int]] = {}

    def closure(state: int) -> frozenset[int]:
        """The NFA states reachable from ``state`` by epsilon moves, keeping those that matter:
        the ones with a byte move, and the accepting one."""
        if state not in closures:
            seen, todo = {state}, [state]
            while todo:
                for nxt in nfa.eps[todo.pop()]:
                    if nxt not in seen:
                        seen.add(nxt)
                        todo.append(nxt)
            closures[state] = frozenset(s for s in seen if moves[s] is not None or s == nfa.accept)
        return closures[state]

    start = closure(nfa.start)
    ids: dict[frozenset[int], int] = {frozenset(): DEAD, start: 1}
    sets = [frozenset(), start]
    rows: list[list[int]] = [[DEAD] * n_classes]
    todo = deque([start])
    work = 0
    while todo:
        current = todo.popleft()
        work += len(current)
        if work > max_work:
            raise GrammarTooLarge("the pattern's subset construction (NFA states visited)", work,
                                  "MAX_SUBSET_WORK", max_work)
        targets: list[set[int]] = [set() for _ in range(n_classes)]
        for s in current:
            move = moves[s]
            if move is not None:
                lo, hi, target = move
                for c in range(lo, hi + 1):
                    targets[c].add(target)
        row, made = [], {}
        for found in targets:
            key = frozenset(found)
            if key not in made:  # many classes share one target set: close it once
                nxt = frozenset().union(*(closure(t) for t in key)) if key else frozenset()
                work += len(nxt)
                if nxt not in ids:
                    if len(ids) >= max_states:
                        raise GrammarTooLarge("the pattern's DFA", len(ids) + 1, "MAX_DFA_STATES", max_states)
                    ids[nxt] = len(sets)
                    sets.append(nxt)
                    todo.append(nxt)
                made[key] = ids[nxt]
            row.append(made[key])
        rows.append(row)
    table = np.array(rows, dtype=np.int32)
    accepting = np.array([nfa.accept in s for s in sets], dtype=bool)
    return DFA(table, classes, accepting, 1)


def trim(dfa: DFA) -> DFA:
    """Send every state that cannot reach an accepting state to ``DEAD``."""
    n, n_classes = dfa.table.shape
    live = dfa.accepting.copy()
    live[DEAD] = False
    # The edges backwards: the predecessors of q are sources[starts[q]:starts[q + 1]].
    targets = dfa.table.reshape(-1)
    order = np.argsort(targets, kind="stable")
    sources, starts = order // n_classes, np.searchsorted(targets[order], np.arange(n + 1))
    todo = np.flatnonzero(live).tolist()
    while todo:  # backwards from the accepting states
        q = todo.pop()
        for p in sources[starts[q] : starts[q + 1]].tolist():
            if not live[p]:
                live[p] = True
                todo.append(p)
    table = np.where(live[dfa.table], dfa.table, DEAD).astype(np.int32)
    table[~live] = DEAD
    return DFA(table, dfa.byte_class, dfa.accepting & live, dfa.start if live[dfa.start] else DEAD)


def minimize(dfa: DFA) -> DFA:
    """Hopcroft's partition refinement, then states renumbered breadth-first (dead = 0, start = 1).

    Start from two blocks, accepting and not. A block A and a class c *split* a block Y when
    some states of Y go into A on c and others do not: those cannot be the same state. Each
    split queues the *smaller* half as a new splitter (the larger half's information follows
    from the old block and the smaller one), which bounds the work by C n log n. When the queue
    is empty, the states of each block are interchangeable and merge.
    """
    n, n_classes = dfa.table.shape
    predecessors = []  # per class: the states p with table[p, c] == q are order[starts[q]:starts[q + 1]]
    for c in range(n_classes):
        column = dfa.table[:, c]
        order = np.argsort(column, kind="stable")
        predecessors.append((order.tolist(), np.searchsorted(column[order], np.arange(n + 1)).tolist()))
    accepting = set(np.flatnonzero(dfa.accepting).tolist())
    blocks = [b for b in (accepting, set(range(n)) - accepting) if b]
    block_of = [0] * n
    for k, members in enumerate(blocks):
        for s in members:
            block_of[s] = k
    smallest = min(range(len(blocks)), key=lambda k: len(blocks[k]))
    queue = {(smallest, c) for c in range(n_classes)} if len(blocks) == 2 else set()
    while queue:
        splitter, c = queue.pop()
        order, starts = predecessors[c]
        touched: dict[int, list[int]] = {}
        for q in blocks[splitter]:
            for p in order[starts[q] : starts[q + 1]]:
                touched.setdefault(block_of[p], []).append(p)
        for y, inside in touched.items():
            if len(inside) == len(blocks[y]):
                continue
            new = len(blocks)
            blocks.append(set(inside))
            blocks[y] -= blocks[new]
            for p in inside:
                block_of[p] = new
            smaller = new if len(blocks[new]) <= len(blocks[y]) else y
            for d in range(n_classes):
                queue.add((new, d) if (y, d) in queue else (smaller, d))
    block = np.array(block_of, dtype=np.int64)
    # One representative per block; renumber breadth-first from the start so the result is canonical.
    representative = np.array([min(members) for members in blocks], dtype=np.int64)
    number = {int(block[DEAD]): DEAD}  # block -> its new state number
    numbered = [int(block[DEAD])]
    todo = deque([int(block[dfa.start])])
    if todo[0] not in number:
        number[todo[0]] = len(numbered)
        numbered.append(todo[0])
    while todo:
        b = todo.popleft()
        for nxt in block[dfa.table[representative[b]]].tolist():
            if nxt not in number:
                number[nxt] = len(numbered)
                numbered.append(nxt)
                todo.append(nxt)
    remap = np.zeros(len(blocks), dtype=np.int32)
    for b, k in number.items():
        remap[b] = k
    rows = representative[numbered]
    table = remap[block[dfa.table[rows]]]
    return DFA(table.astype(np.int32), dfa.byte_class, dfa.accepting[rows], number[int(block[dfa.start])])


def nfa_to_dfa(nfa: NFA, max_states: int = MAX_DFA_STATES, minimized: bool = True) -> DFA:
    dfa = trim(determinize(nfa, max_states))
    return minimize(dfa) if minimized else dfa


_COMPILED: OrderedDict[tuple[str, int, int], DFA] = OrderedDict()
_COMPILED_MAX = 64


def compile_regex(pattern: str, max_nfa_states: int = MAX_NFA_STATES, max_dfa_states: int = MAX_DFA_STATES) -> DFA:
    """The minimal DFA of ``pattern`` (whole-string match), cached per pattern and limits.

    Raises ``RegexError`` for what the parser refuses, ``GrammarTooLarge`` past a limit, and a
    ``ValueError`` when the pattern matches no string at all (a constraint nothing satisfies).
    """
    key = (pattern, max_nfa_states, max_dfa_states)
    if key in _COMPILED:
        _COMPILED.move_to_end(key)
        return _COMPILED[key]
    dfa = nfa_to_dfa(pattern_to_nfa(pattern, max_nfa_states), max_dfa_states)
    if dfa.start == DEAD:
        raise ValueError(f"the pattern {pattern[:80]!r} matches no string at all")
    _COMPILED[key] = dfa
    while len(_COMPILED) > _COMPILED_MAX:
        _COMPILED.popitem(last=False)
    return dfa


# ------------------------------------------------------------------------------ comparing
def find_difference(a: DFA, b: DFA, one_way: bool = False) -> bytes | None:
    """A shortest byte string that one DFA accepts and the other does not (with ``one_way``:
    that ``a`` accepts and ``b`` does not); None if there is none, e.g. when both accept the same
    language. Breadth-first over pairs of states (the product automaton)."""
    start = (a.start, b.start)
    parent: dict[tuple[int, int], tuple[tuple[int, int], int] | None] = {start: None}
    todo = deque([start])
    while todo:
        pair = todo.popleft()
        if a.accepting[pair[0]] and not b.accepting[pair[1]] or (
                not one_way and b.accepting[pair[1]] and not a.accepting[pair[0]]):
            out = []
            while parent[pair] is not None:
                pair, byte = parent[pair]  # type: ignore[misc]
                out.append(byte)
            return bytes(reversed(out))
        if pair[0] == DEAD and (one_way or pair[1] == DEAD):
            continue
        for byte in range(256):
            nxt = (int(a.table[pair[0], a.byte_class[byte]]), int(b.table[pair[1], b.byte_class[byte]]))
            if nxt not in parent:
                parent[nxt] = (pair, byte)
                todo.append(nxt)
    return None
