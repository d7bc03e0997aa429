"""The tree of a pattern -> a Thompson NFA over **bytes** (notebook 13, step 1b).

Every node becomes a fragment with one entry and one exit, glued with epsilon (empty) moves:

* a set of code points becomes the byte automaton of its UTF-8 encodings (``utf8_sequences``),
  its sequences sharing their common suffixes;
* ``Concat`` chains its parts, ``Alt`` forks to each and joins after them;
* ``Repeat(x, n, m)`` is n copies of x in a row, then either a loop (``m`` unbounded) or
  ``m - n`` optional copies *nested* (``x{0,3}`` = ``(x(x(x)?)?)?``), so each optional copy is
  only reachable after the one before it and the subset construction never mixes copies
  (the flat ``x?x?x?`` gives the same language with far larger DFA state sets).

The NFA is never run directly: ``dfa.py`` determinizes it.

Bounding the work: ``(a{1000}){1000}`` is 15 characters and four million NFA states. The size
is computed from the tree *before* anything is built (``nfa_size``), and a pattern over
``MAX_NFA_STATES`` is refused with a ``GrammarTooLarge`` naming the limit, in microseconds.
"""

from __future__ import annotations

from dataclasses import dataclass

from minillm.structured.regex import Alt, Chars, Concat, GrammarTooLarge, Node, parse

MAX_NFA_STATES = 200_000


# ------------------------------------------------------------------------------ UTF-8
def utf8_sequences(lo: int, hi: int) -> list[tuple[tuple[int, int], ...]]:
    """The code points ``lo..hi`` (no surrogates) as byte-range sequences, one per piece.

    Every piece covers code points whose encodings have the same length and share their
    leading bytes up to where the remaining bytes run over full ranges, so the piece is exactly
    the product of its byte ranges: U+0080..U+07FF -> ``[C2-DF][80-BF]``.
    """
    out, todo = [], [(lo, hi)]
    while todo:
        lo, hi = todo.pop()
        pieces = _split(lo, hi)
        if pieces:
            todo += reversed(pieces)
            continue
        first, last = chr(lo).encode("utf-8"), chr(hi).encode("utf-8")
        out.append(tuple(zip(first, last)))
    return out


def _split(lo: int, hi: int) -> list[tuple[int, int]] | None:
    for top in (0x7F, 0x7FF, 0xFFFF):  # where the encoded length changes
        if lo <= top < hi:
            return [(lo, top), (top + 1, hi)]
    if hi <= 0x7F:
        return None
    for trailing in (1, 2, 3):  # the low 6 bits of each trailing byte
        mask = (1 << (6 * trailing)) - 1
        if lo & ~mask != hi & ~mask:
            if lo & mask:
                return [(lo, lo | mask), ((lo | mask) + 1, hi)]
            if hi & mask != mask:
                return [(lo, (hi & ~mask) - 1), (hi & ~mask, hi)]
    return None


# ------------------------------------------------------------------------------ the NFA
@dataclass
class NFA:
    """Thompson's NFA: state ``s`` has epsilon moves ``eps[s]`` and at most one byte move
    ``edge[s] = (lo, hi, target)``. It accepts at ``accept``, which has no moves."""

    eps: list[list[int]]
    edge: list[tuple[int, int, int] | None]
    start: int
    accept: int

    def new(self) -> int:
        self.eps.append([])
        self.edge.append(None)
        return len(self.eps) - 1


def nfa_size(node: Node) -> int:
    """The number of states ``compile_nfa`` will create for ``node`` (an upper bound)."""
    if isinstance(node, Chars):
        return 2 + sum(len(seq) for lo, hi in node.ranges for seq in utf8_sequences(lo, hi))
    if isinstance(node, (Concat, Alt)):
        return 2 + sum(nfa_size(item) for item in node.items)
    copies = node.min + 1 if node.max is None else max(node.max, 1)
    return 2 + copies * (nfa_size(node.item) + 1)


def compile_nfa(node: Node, max_states: int = MAX_NFA_STATES) -> NFA:
    """The Thompson NFA of ``node``; refused before building when it would pass ``max_states``."""
    size = nfa_size(node)
    if size > max_states:
        raise GrammarTooLarge("the pattern's NFA", size, "MAX_NFA_STATES", max_states)
    nfa = NFA([], [], 0, 0)
    nfa.start, nfa.accept = _fragment(nfa, node)
    return nfa


def _fragment(nfa: NFA, node: Node) -> tuple[int, int]:
    """Build ``node`` into ``nfa``: (entry, exit)."""
    start, end = nfa.new(), nfa.new()
    if isinstance(node, Chars):
        # Built from the end, sharing suffixes: every sequence ending in [80-BF] goes through one
        # state, every one ending in [80-BF][80-BF] through the next... (Rust's regex does the
        # same). Without it each sequence has its own chain, and the DFA keeps them apart: about
        # twice the states per character of a length-bounded string.
        made: dict[tuple[int, int, int], int] = {}
        for lo, hi in node.ranges:
            for seq in utf8_sequences(lo, hi):
                target = end
                for a, b in reversed(seq):
                    if (a, b, target) not in made:
                        state = nfa.new()
                        nfa.edge[state] = (a, b, target)
                        made[(a, b, target)] = state
                    target = made[(a, b, target)]
                if target not in nfa.eps[start]:
                    nfa.eps[start].append(target)
    elif isinstance(node, Concat):
        at = start
        for item in node.items:
            entry, exit_ = _fragment(nfa, item)
            nfa.eps[at].append(entry)
            at = exit_
        nfa.eps[at].append(end)
    elif isinstance(node, Alt):
        for item in node.items:
            entry, exit_ = _fragment(nfa, item)
            nfa.eps[start].append(entry)
            nfa.eps[exit_].append(end)
    else:  # Repeat: min copies in a row, then a loop or nested optional copies
        at = start
        for _ in range(node.min):
            entry, exit_ = _fragment(nfa, node.item)
            nfa.eps[at].append(entry)
            at = exit_
        if node.max is None:  # x{2,} = x x x*: the loop's hub is where the last fixed copy ends
            entry, exit_ = _fragment(nfa, node.item)
            nfa.eps[at].append(entry)
            nfa.eps[exit_].append(at)
        else:  # x{0,3} = (x(x(x)?)?)?: each optional copy only after the one before it
            for _ in range(node.max - node.min):
                entry, exit_ = _fragment(nfa, node.item)
                nfa.eps[at] += [entry, end]
                at = exit_
        nfa.eps[at].append(end)
    return start, end


def pattern_to_nfa(pattern: str, max_states: int = MAX_NFA_STATES) -> NFA:
    """Parse and compile in one call."""
    return compile_nfa(parse(pattern), max_states)
