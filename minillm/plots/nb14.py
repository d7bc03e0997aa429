"""Notebook 14's figures (speculative decoding): the cost of a k-token step per backend, the
acceptance rule's histogram, expected tokens and speed-up (the widget), which tokens a step kept,
and the rollback in the paged cache.

Each function takes what the notebook computed and draws it; matplotlib is imported when a
function draws. ``speedup_figure`` returns its figure, for the notebook's widget.
"""

from __future__ import annotations

import html
from collections.abc import Callable, Mapping, Sequence
from typing import Any

BACKEND_COLORS = {"eager": "C0", "compiled": "C1", "packed-cpu": "C2"}


def step_costs(costs: Mapping[str, Mapping[int, float]], title: str) -> None:
    """Relative cost (seconds of a verify step over k drafts / seconds of a 1-token decode step)
    against k, one line per backend, with the ideal (free) and the linear (pay per row) lines."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 3.6))
    ks = sorted({k for c in costs.values() for k in c})
    ax.plot(ks, [1] * len(ks), ":", color="grey", label="free: every row for the price of one")
    ax.plot(ks, [k + 1 for k in ks], "--", color="grey", label="linear: k + 1 rows, k + 1 times the cost")
    for name, c in costs.items():
        ax.plot(list(c), list(c.values()), "o-", color=BACKEND_COLORS.get(name), label=name)
    ax.set(xlabel="k drafts verified (the step feeds k + 1 tokens)", ylabel="cost / one decode step", xticks=ks,
           title=title)
    ax.title.set_fontsize(10)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    plt.show()


def acceptance_histogram(p: Sequence[float], q: Sequence[float], counts: Sequence[int], labels: Sequence[str]) -> None:
    """Bars of the target's p, the draft's q and the frequencies of the tokens speculative
    sampling output (first token of each run)."""
    import matplotlib.pyplot as plt
    import numpy as np

    x, n = np.arange(len(p)), sum(counts)
    fig, ax = plt.subplots(figsize=(8, 3))
    ax.bar(x - 0.27, p, 0.27, label="target p", color="C0")
    ax.bar(x, q, 0.27, label="draft q", color="C7")
    ax.bar(x + 0.27, np.asarray(counts) / n, 0.27, label=f"speculative output ({n:,} runs)", color="C2")
    ax.set(xticks=x, xticklabels=labels, ylabel="probability",
           title="the output follows p, not q: accepted drafts + draws from the residual")
    ax.title.set_fontsize(10)
    ax.legend(fontsize=8)
    plt.show()


def speedup_figure(alpha: float, k: int, costs: Mapping[str, Mapping[int, float]],
                   expected: Callable[[float, int], float], simulated: Mapping[int, float] | None = None) -> Any:
    """Left: expected tokens per step against k at acceptance rate ``alpha`` (and a simulation's
    dots). Right: speed-up = expected tokens / relative step cost, per backend, at each measured k,
    the chosen ``k`` outlined."""
    import matplotlib.pyplot as plt
    import numpy as np

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 3.4))
    ks = np.arange(1, 9)
    left.plot(ks, [expected(alpha, int(j)) for j in ks], "-", color="C3", label="(1 - α^(k+1)) / (1 - α)")
    if simulated:
        left.plot(list(simulated), list(simulated.values()), "o", color="k", ms=4, label="simulated")
    left.axvline(k, color="grey", lw=0.8)
    left.set(xlabel="k", ylabel="tokens per step", ylim=(0, 9.5), title=f"α = {alpha:.2f}: tokens per step")
    left.legend(fontsize=8, loc="upper left")
    width = 0.8 / max(len(costs), 1)
    for i, (name, c) in enumerate(costs.items()):
        measured = sorted(c)
        gains = [expected(alpha, j) / c[j] for j in measured]
        bars = right.bar(np.arange(len(measured)) + (i - (len(costs) - 1) / 2) * width, gains, width,
                         color=BACKEND_COLORS.get(name), label=name)
        for j, bar in zip(measured, bars):
            if j == k:
                bar.set_edgecolor("k")
                bar.set_linewidth(2)
    right.axhline(1, color="k", lw=0.8)
    first = next(iter(costs.values()), {})
    right.set(xticks=range(len(first)), xticklabels=[f"k={j}" for j in sorted(first)], ylabel="speed-up",
              title="speed-up = tokens per step / relative step cost")
    right.legend(fontsize=8)
    for ax in (left, right):
        ax.title.set_fontsize(10)
    fig.tight_layout()
    return fig


def kept_tokens_html(tok: Any, steps: Sequence[tuple[Sequence[int], Sequence[int]]], title: str) -> str:
    """The generated text, one coloured run per step: accepted drafts green, the target's own
    token (its correction, or the bonus after k accepted drafts) orange; a bar between steps."""
    spans = []
    for drafts, kept in steps:
        accepted = len(kept) - 1
        for i, token in enumerate(kept):
            color = "#a6dba0" if i < accepted else "#fdc086"
            text = html.escape(tok.decode([token])).replace("\n", "⏎")
            spans.append(f'<span style="background:{color}">{text}</span>')
        spans.append('<span style="color:#888">|</span>')
    legend = ('<span style="background:#a6dba0">accepted draft</span> '
              '<span style="background:#fdc086">the target\'s own token</span> | a step')
    return (f'<div style="font-family:monospace;font-size:12px;line-height:1.7"><b>{html.escape(title)}</b> '
            f'({legend})<br>{"".join(spans)}</div>')


def draw_rollback(states: Sequence[tuple[str, Sequence[int], Sequence[str], Sequence[str]]], block_size: int,
                  freed: Sequence[int] = ()) -> None:
    """One row per state of a sequence in the paged cache: its block table as boxes of
    ``block_size`` slots, each slot labelled with its token's text and coloured by ``kinds``:
    "kept", "draft" (written by the verify step), "stale" (a rejected draft past the length, still
    in a kept block), "new" (written by the next step), "" (empty). ``freed`` blocks are drawn
    dashed at the end of the row that follows the truncation, returned to the free list."""
    import matplotlib.pyplot as plt

    colors = {"kept": "#bcd6f0", "draft": "#fdc086", "stale": "#f4a3a3", "new": "#a6dba0", "": "white"}
    fig, ax = plt.subplots(figsize=(12, 1.25 * len(states) + 0.4))
    for r, (label, table, texts, kinds) in enumerate(states):
        y = -1.6 * r
        for b, block in enumerate(table):
            x0 = b * (block_size + 0.6)
            for s in range(block_size):
                i = b * block_size + s
                kind = kinds[i] if i < len(kinds) else ""
                ax.add_patch(plt.Rectangle((x0 + s, y), 1, 1, fc=colors[kind], ec="grey", lw=0.5,
                                           hatch="//" if kind == "stale" else None))
                if i < len(texts) and kind:
                    ax.text(x0 + s + 0.5, y + 0.5, texts[i][:6], ha="center", va="center", fontsize=7)
            ax.add_patch(plt.Rectangle((x0, y), block_size, 1, fc="none", ec="k", lw=1.2))
            ax.text(x0 + block_size / 2, y + 1.12, f"block {block}", ha="center", fontsize=7)
        if r > 0 and len(table) < len(states[r - 1][1]):
            for j, block in enumerate(freed):
                x0 = (len(table) + j) * (block_size + 0.6)
                ax.add_patch(plt.Rectangle((x0, y), block_size, 1, fc="none", ec="grey", ls="--"))
                ax.text(x0 + block_size / 2, y + 0.5, f"block {block}\nback to the free list", ha="center",
                        va="center", fontsize=7, color="grey")
        ax.text(-0.4, y + 0.5, label, ha="right", va="center", fontsize=8)
    widest = max(len(t) for _, t, _, _ in states) + 1
    ax.set(xlim=(-6, widest * (block_size + 0.6)), ylim=(-1.6 * (len(states) - 1) - 0.2, 1.4))
    handles = [plt.Rectangle((0, 0), 1, 1, fc=c, ec="grey", hatch="//" if k == "stale" else None)
               for k, c in colors.items() if k]
    ax.legend(handles, ["kept text", "verified this step", "rejected, past the length (stale)", "written next step"],
              fontsize=7, loc="upper center", ncol=4, bbox_to_anchor=(0.5, 0.02))
    ax.axis("off")
    plt.show()
