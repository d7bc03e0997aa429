"""Helpers of the constrained-decoding tests (notebook 13): sampling strings from a DFA, the
outlines-core reference built on the same vocabulary, and the random walks that compare the two."""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from minillm.structured import DEAD, DFA


# --------------------------------------------------------------------------- strings from a DFA
def distances_to_accept(dfa: DFA) -> np.ndarray:
    """The fewest bytes from each state to an accepting one (a large number for the dead state)."""
    far = 1 << 30
    dist = np.where(dfa.accepting, 0, far)
    changed = True
    while changed:  # Bellman-Ford on a small table
        best = dist[dfa.table].min(axis=1) + 1
        new = np.minimum(dist, best)
        changed = bool((new != dist).any())
        dist = new
    return dist


def sample_match(dfa: DFA, rng: random.Random, max_len: int = 40, stop: float = 0.15) -> bytes:
    """A random byte string the DFA accepts: a random walk over live bytes that, past ``max_len``
    bytes, heads for the nearest accepting state."""
    dist = distances_to_accept(dfa)
    live_bytes = {}
    state, out = dfa.start, bytearray()
    while True:
        if state not in live_bytes:
            live_bytes[state] = [b for b in range(256) if dfa.table[state, dfa.byte_class[b]] != DEAD]
        options = live_bytes[state]
        if dfa.accepting[state] and (not options or rng.random() < stop or len(out) >= max_len):
            return bytes(out)
        if len(out) >= max_len:
            options = [b for b in options if dist[dfa.table[state, dfa.byte_class[b]]] < dist[state]]
        byte = rng.choice(options)
        out.append(byte)
        state = int(dfa.table[state, dfa.byte_class[byte]])


# --------------------------------------------------------------------------- the outlines reference
def outlines_vocabulary(tokenizer):
    """outlines-core's ``Vocabulary`` of the same tokens the index matches: every ordinary token
    by its *bytes* (a str key would be read as its UTF-8, not through GPT-2's byte map), the
    special tokens and the eos id left out (outlines adds eos itself)."""
    from outlines_core import Vocabulary

    special = set(tokenizer.special_tokens.values())
    tokens: dict[bytes, list[int]] = {}
    for i, data in tokenizer.vocab.items():
        if i not in special and i != tokenizer.eos_id and data:
            tokens.setdefault(data, []).append(i)
    return Vocabulary(tokenizer.eos_id, tokens)


_ASCII_CLASSES = {"d": ("0-9", "[0-9]"), "w": ("0-9A-Za-z_", "[0-9A-Za-z_]"),
                  "s": (r"\t\n\x0B\x0C\r ", r"[\t\n\x0B\x0C\r ]")}


def for_rust(pattern: str) -> str:
    """``pattern`` for Rust's regex, which outlines-core uses: there ``\\d \\w \\s`` are Unicode
    classes, here ASCII (the module docstring of ``minillm.structured.regex`` says why)."""
    out, i, in_class = [], 0, False
    while i < len(pattern):
        c = pattern[i]
        if c == "\\" and i + 1 < len(pattern):
            e = pattern[i + 1]
            out.append(_ASCII_CLASSES[e][0 if in_class else 1] if e in _ASCII_CLASSES else pattern[i : i + 2])
            i += 2
            continue
        if c == "[" and not in_class:
            in_class = True
            out.append(c)
            if pattern[i + 1 : i + 2] == "^":
                out.append("^")
                i += 1
            if pattern[i + 1 : i + 2] == "]":
                out.append("]")
                i += 1
        elif c == "]" and in_class:
            in_class = False
            out.append(c)
        else:
            out.append(c)
        i += 1
    return "".join(out)


@dataclass
class WalkReport:
    """What ``compare_walks`` saw: the comparisons, the distinct states, and the tokens only
    minillm allowed (each explained: see ``compare_walks``)."""

    checks: int = 0
    equal: int = 0
    states: set = field(default_factory=set)
    only_ours: int = 0
    only_theirs: list = field(default_factory=list)
    unexplained: list = field(default_factory=list)
    extra_texts: list = field(default_factory=list)  # the output after each such token, when it is whole UTF-8


def compare_walks(index, reference, tokenizer, walks: int = 20, steps: int = 40, seed: int = 0) -> WalkReport:
    """Seeded random walks through tokens both indexes allow, comparing the allowed sets at every
    step. Each walk prefers tokens that reach a state it has not seen, so walks spread out.

    outlines-core 0.2.x allows a subset: its DFA (Rust's ``regex-automata``) reports matches one
    byte late and with leftmost-first priority, so a token is refused when the output just
    before the token's last byte already matches (``(ab)+`` after ``ab``: no ``a``; ``-?\\d+(\\.\\d+)?``
    after ``1``: no ``.``) or a higher-priority alternative matched earlier (``cat|category``).
    Every token only minillm allows must be of that kind: some prefix of the output before its
    last byte is a whole match. Anything else is reported as unexplained.
    """
    rng = random.Random(seed)
    report = WalkReport()
    eos = tokenizer.eos_id
    for _ in range(walks):
        ours, theirs, text = index.start, reference.get_initial_state(), b""
        for _ in range(steps):
            nxt = index.next_states(ours)
            mine = nxt != DEAD
            other = np.zeros_like(mine)
            other[reference.get_allowed_tokens(theirs)] = True
            report.checks += 1
            report.equal += np.array_equal(mine, other)
            report.states.add(ours)
            report.only_theirs += np.flatnonzero(other & ~mine).tolist()
            for token in np.flatnonzero(mine & ~other).tolist():
                report.only_ours += 1
                full = text + tokenizer.vocab[token]
                if not any(index.dfa.matches(full[:k]) for k in range(len(full))):
                    report.unexplained.append((text, token))
                try:
                    report.extra_texts.append(full.decode("utf-8"))
                except UnicodeDecodeError:
                    pass
            both = mine & other
            eos_allowed = eos is not None and both[eos]
            if eos is not None:
                both[eos] = False
            both = np.flatnonzero(both)
            if not len(both) or (eos_allowed and rng.random() < 0.2):
                break
            fresh = both[~np.isin(nxt[both], np.array(sorted(report.states)))]
            token = int(rng.choice(fresh if len(fresh) and rng.random() < 0.7 else both))
            text += tokenizer.vocab[token]
            ours, theirs = int(nxt[token]), reference.get_next_state(theirs, token)
    return report


def walk_tokens(index, ids: list[int]) -> tuple[int, int | None]:
    """Advance through ``ids``: (the final state, None) or (the state, the first refused position)."""
    state = index.start
    for pos, token in enumerate(ids):
        nxt = index.next_state(state, token)
        if nxt == DEAD:
            return state, pos
        state = nxt
    return state, None


def shortest_path_accepts(dfa: DFA) -> bool:
    """Whether some string is accepted (breadth-first from the start)."""
    seen, todo = {dfa.start}, deque([dfa.start])
    while todo:
        s = todo.popleft()
        if dfa.accepting[s]:
            return True
        for t in set(dfa.table[s].tolist()) - seen:
            seen.add(t)
            todo.append(t)
    return False
