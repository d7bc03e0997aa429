"""Notebook 12's figures: the block hash chain, the chunked-prefill timeline, latency under load."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from minillm.cache import BlockManager


def draw_chain(rows: Mapping[str, Sequence[int]], tok: Any, block_size: int, title: str) -> Any:
    """One row of blocks per request (label -> token ids): a box per block with the last four hex
    digits of its key and the start of its text, an arrow where a key feeds the next block's hash.
    Green: a key another row also has (one shared physical block); orange: the row's own; dashed:
    the partial last block, which has no key."""
    import matplotlib.pyplot as plt

    keys = {label: BlockManager(1, block_size).prefix_keys(ids) for label, ids in rows.items()}
    fig, ax = plt.subplots(figsize=(12, 0.3 + 1.1 * len(rows)))
    for r, (label, ids) in enumerate(rows.items()):
        y, mine = -1.5 * r, keys[label]
        others = {key for other, theirs in keys.items() if other != label for key in theirs}
        for b in range(-(-len(ids) // block_size)):
            full = b < len(mine)
            color = ("#a6dba0" if mine[b] in others else "#fdc086") if full else "w"
            ax.add_patch(plt.Rectangle((1.6 * b, y), 1.3, 1, fc=color, ec="k", ls="-" if full else "--"))
            ax.text(1.6 * b + 0.65, y + 0.66, f"…{mine[b] & 0xFFFF:04x}" if full else "no key", ha="center",
                    fontsize=8, family="monospace")
            text = tok.decode(list(ids[b * block_size : (b + 1) * block_size])).replace("\n", "⏎")
            ax.text(1.6 * b + 0.65, y + 0.22, text[:13], ha="center", fontsize=7)
            if b:
                ax.annotate("", (1.6 * b, y + 0.5), (1.6 * b - 0.3, y + 0.5), arrowprops={"arrowstyle": "->"})
        ax.text(-0.2, y + 0.5, label, ha="right", va="center", fontsize=9)
    width = max(len(ids) for ids in rows.values()) // block_size + 1
    ax.set(xlim=(-2.6, 1.6 * width), ylim=(-1.5 * len(rows) + 1.3, 1.1))
    ax.set_title(title, fontsize=10)
    ax.axis("off")
    return fig


def stall_timeline(runs: Mapping[str, Mapping[str, Any]]) -> Any:
    """Section 5: one row of token marks per stream and one for the long prompt, per prefill mode,
    the long prompt's prefill shaded."""
    import matplotlib.pyplot as plt
    import numpy as np

    fig, axes = plt.subplots(len(runs), 1, figsize=(11, 2.2 * len(runs)), sharex=True)
    for ax, (name, run) in zip(axes, runs.items()):
        for s, t in enumerate(run["streams"]):
            ax.plot(t, np.full_like(t, s), "|", ms=10, color="C0")
        n = len(run["streams"])
        ax.plot(run["long"], np.full_like(run["long"], n), "|", ms=10, color="C3")
        ax.axvspan(run["arrival"], run["long"][0], color="C3", alpha=0.15, label="the long prompt's prefill")
        ax.set(yticks=range(n + 1), yticklabels=[f"stream {s + 1}" for s in range(n)] + ["long prompt"],
               ylim=(-0.7, n + 0.7), title=f"prefill {name}: worst gap {1000 * run['worst_gap']:.0f} ms")
        ax.title.set_fontsize(9)
    axes[0].legend(fontsize=8, loc="upper right")
    axes[-1].set_xlabel("time (s): one mark per token")
    fig.tight_layout()
    return fig


def latency_under_load(load: Mapping[float, Sequence[Mapping[str, float]]],
                       percentile: Callable[[Sequence[float], float], float]) -> Any:
    """Section 7: the busiest rate's requests on a time line (waiting + prefill grey, decoding blue),
    and p50/p99 TTFT and TPOT per rate."""
    import matplotlib.pyplot as plt
    import numpy as np

    rates = list(load)
    fig, (ax_g, ax_ttft, ax_tpot) = plt.subplots(1, 3, figsize=(12, 3.6), gridspec_kw={"width_ratios": [1.6, 1, 1]})
    for i, row in enumerate(sorted(load[rates[-1]], key=lambda row: row["sent"])):
        ax_g.plot([row["sent"], row["first"]], [i, i], color="C7", lw=4, solid_capstyle="butt")
        ax_g.plot([row["first"], row["last"]], [i, i], color="C0", lw=4, solid_capstyle="butt")
    ax_g.set(xlabel="time (s)", ylabel="request",
             title=f"{rates[-1]:.0f} req/s: waiting + prefill (grey), decoding (blue)")
    xs = np.arange(len(rates))
    for ax, metric in ((ax_ttft, "ttft"), (ax_tpot, "tpot")):
        for k, p in enumerate((50, 99)):
            ax.bar(xs + 0.4 * k - 0.2, [1000 * percentile([r[metric] for r in load[rate]], p) for rate in rates],
                   0.4, label=f"p{p}")
        ax.set(xticks=xs, xticklabels=[f"{rate:.0f} req/s" for rate in rates], ylabel="ms", title=metric.upper())
    ax_ttft.legend(fontsize=8)
    for ax in (ax_g, ax_ttft, ax_tpot):
        ax.title.set_fontsize(9)
    fig.tight_layout()
    return fig
