"""Drawings for notebook 13 (structured output): automata as circles and labelled arrows.

``draw_nfa`` and ``draw_dfa`` lay the states out left to right by their distance from the start
(breadth-first), so a pattern reads in the order it is written; edges are labelled with the byte
ranges they read (``0-9``, ``.``, ``\\xc3``), epsilon moves are dashed and unlabelled.
"""

from __future__ import annotations

from collections import deque

import numpy as np

from minillm.structured import DEAD, DFA, NFA


def byte_label(lo: int, hi: int) -> str:
    """``0-9`` for a printable range, ``\\xc3-\\xdf`` otherwise; one byte alone as itself."""
    def one(b: int) -> str:
        return chr(b) if 0x21 <= b < 0x7F else f"\\x{b:02x}"
    return f"'{one(lo)}'" if lo == hi else f"{one(lo)}-{one(hi)}"


def _layout(n: int, start: int, successors: dict[int, list[int]]) -> dict[int, tuple[float, float]]:
    depth = {start: 0}
    todo = deque([start])
    while todo:
        s = todo.popleft()
        for t in successors.get(s, []):
            if t not in depth:
                depth[t] = depth[s] + 1
                todo.append(t)
    columns: dict[int, list[int]] = {}
    for s in sorted(depth, key=lambda s: (depth[s], s)):
        columns.setdefault(depth[s], []).append(s)
    return {s: (float(d), (len(col) - 1) / 2 - i) for d, col in columns.items() for i, s in enumerate(col)}


def _draw(edges: list[tuple[int, int, str, bool]], start: int, accepting: set[int], title: str,
          names: dict[int, str] | None = None, figsize: tuple[float, float] = (10, 3.2)) -> None:
    import matplotlib.pyplot as plt

    successors: dict[int, list[int]] = {}
    for a, b, _, _ in edges:
        successors.setdefault(a, []).append(b)
    pos = _layout(0, start, successors)
    fig, ax = plt.subplots(figsize=figsize)
    for a, b, label, dashed in edges:
        (x0, y0), (x1, y1) = pos[a], pos[b]
        if a == b:  # a loop: a small arc above the state
            ax.annotate("", xy=(x0 + 0.12, y0 + 0.2), xytext=(x0 - 0.12, y0 + 0.2),
                        arrowprops=dict(arrowstyle="->", connectionstyle="arc3,rad=-1.6", color="0.3"))
            ax.text(x0, y0 + 0.52, label, ha="center", va="bottom", fontsize=8, color="tab:blue")
            continue
        bend = 0.25 if x1 <= x0 else 0.0  # backward edges curve so they do not hide forward ones
        ax.annotate("", xy=(x1, y1), xytext=(x0, y0),
                    arrowprops=dict(arrowstyle="->", color="0.45" if dashed else "0.2", linestyle="--" if dashed else "-",
                                    shrinkA=11, shrinkB=11, connectionstyle=f"arc3,rad={bend}"))
        if label:
            ax.text((x0 + x1) / 2, (y0 + y1) / 2 + 0.08 + (0.25 if bend else 0), label, ha="center", va="bottom",
                    fontsize=8, color="tab:blue")
    for s, (x, y) in pos.items():
        ax.add_patch(plt.Circle((x, y), 0.17, fill=True, color="#dbe9f6" if s != start else "#c7e9c0", ec="0.2"))
        if s in accepting:
            ax.add_patch(plt.Circle((x, y), 0.13, fill=False, ec="0.2"))
        ax.text(x, y, (names or {}).get(s, str(s)), ha="center", va="center", fontsize=8)
    xs, ys = [p[0] for p in pos.values()], [p[1] for p in pos.values()]
    ax.set_xlim(min(xs) - 0.5, max(xs) + 0.5)
    ax.set_ylim(min(ys) - 0.6, max(ys) + 0.9)
    ax.set_aspect("equal")
    ax.axis("off")
    ax.set_title(title, fontsize=10)
    plt.show()


def draw_nfa(nfa: NFA, title: str = "", figsize: tuple[float, float] = (12, 3.4)) -> None:
    """Thompson's NFA: byte moves solid and labelled, epsilon moves dashed; green = start, double circle = accept."""
    edges = [(s, t, "", True) for s, targets in enumerate(nfa.eps) for t in targets]
    edges += [(s, e[2], byte_label(e[0], e[1]), False) for s, e in enumerate(nfa.edge) if e is not None]
    _draw(edges, nfa.start, {nfa.accept}, title, figsize=figsize)


def dfa_edges(dfa: DFA) -> list[tuple[int, int, int, int]]:
    """``(state, target, lo, hi)``: the DFA's moves as byte ranges, the dead state left out."""
    out = []
    for s in range(dfa.n_states):
        if s == DEAD:
            continue
        targets = dfa.table[s, dfa.byte_class]  # the target of each of the 256 bytes
        lo = 0
        for b in range(1, 257):
            if b == 256 or targets[b] != targets[lo]:
                if targets[lo] != DEAD:
                    out.append((s, int(targets[lo]), lo, b - 1))
                lo = b
    return out


def draw_dfa(dfa: DFA, title: str = "", figsize: tuple[float, float] = (9, 2.6)) -> None:
    """The DFA without its dead state (every byte not drawn goes there)."""
    merged: dict[tuple[int, int], list[str]] = {}
    for s, t, lo, hi in dfa_edges(dfa):
        merged.setdefault((s, t), []).append(byte_label(lo, hi))
    edges = [(s, t, " ".join(labels), False) for (s, t), labels in merged.items()]
    _draw(edges, dfa.start, set(np.flatnonzero(dfa.accepting).tolist()), title, figsize=figsize)


def regex_growth(depths: list[int], lengths: list[int], states: list[int]) -> None:
    """The bounded-depth JSON object regex: its length and its minimal DFA's states against the depth."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3))
    ax.semilogy(depths, lengths, "o-", label="regex length (characters)")
    ax.semilogy(depths, states, "s-", label="minimal DFA states")
    ax.set_xlabel("nesting depth allowed")
    ax.set_xticks(depths)
    ax.legend()
    ax.grid(alpha=0.3)
    ax.set_title("a regex for nested JSON grows with every level it allows", fontsize=10)
    plt.show()
