"""Notebook 15's figures (tensor parallelism): what each rank holds, the predicted cost of a decode step
per link and world size, and a pipeline's schedule beside tensor parallelism's.

Each function takes what the notebook computed and draws it; matplotlib is imported when a
function draws.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

RANK_COLORS = ("#8dd3c7", "#fdb462", "#bebada", "#fb8072")


def shard_layout(layouts: Mapping[int, Mapping[str, Sequence[range]]], totals: Mapping[str, int]) -> None:
    """One row per (world size, dimension): the dimension's indices as a bar, each rank's range in its
    colour and labelled. ``layouts[world][dimension]`` lists the ranks' ranges; ``totals`` the sizes."""
    import matplotlib.pyplot as plt

    rows = [(world, dim) for world in layouts for dim in totals]
    fig, ax = plt.subplots(figsize=(10, 0.42 * len(rows) + 0.6))
    for y, (world, dim) in enumerate(reversed(rows)):
        for rank, part in enumerate(layouts[world][dim]):
            width = len(part) / totals[dim]
            ax.barh(y, width, left=part.start / totals[dim], color=RANK_COLORS[rank % len(RANK_COLORS)],
                    edgecolor="k", linewidth=0.6)
            ax.text((part.start + len(part) / 2) / totals[dim], y, f"rank {rank}: {len(part):,}", ha="center",
                    va="center", fontsize=7.5)
    ax.set_yticks(range(len(rows)), [f"W={world}  {dim} ({totals[dim]:,})" for world, dim in reversed(rows)],
                  fontsize=8)
    ax.set(xlim=(0, 1), xticks=[], title="what each rank holds: whole GQA groups, feed-forward channels, vocabulary rows")
    ax.title.set_fontsize(10)
    for side in ("top", "right", "bottom"):
        ax.spines[side].set_visible(False)
    fig.tight_layout()
    plt.show()


def step_cost_bars(parts: Mapping[str, Mapping[int, tuple[float, float]]], title: str) -> None:
    """Grouped stacked bars: for each link, each world size's predicted (compute, communication)
    seconds per decode step, in milliseconds."""
    import matplotlib.pyplot as plt
    import numpy as np

    links = list(parts)
    worlds = sorted({w for p in parts.values() for w in p})
    fig, ax = plt.subplots(figsize=(9, 3.4))
    width = 0.8 / len(worlds)
    for i, world in enumerate(worlds):
        x = np.arange(len(links)) + (i - (len(worlds) - 1) / 2) * width
        compute = np.array([1000 * parts[link][world][0] for link in links])
        comm = np.array([1000 * parts[link][world][1] for link in links])
        ax.bar(x, compute, width, color=RANK_COLORS[i], edgecolor="k", linewidth=0.5, label=f"W={world}: compute")
        ax.bar(x, comm, width, bottom=compute, color=RANK_COLORS[i], hatch="///", edgecolor="k", linewidth=0.5,
               label=f"W={world}: communication")
    ax.set_xticks(range(len(links)), links, fontsize=8.5)
    ax.set(ylabel="ms per decode step", title=title)
    ax.title.set_fontsize(10)
    ax.legend(fontsize=7.5, ncol=len(worlds))
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    plt.show()


def pipeline_schedule(stages: int, micro_batches: Sequence[int]) -> None:
    """Rank against time, one panel per schedule, a time unit being one stage's layers for one batch:
    tensor parallelism (every rank computes a 1/W slice of every layer, then talks: a batch takes
    about one unit), and a pipeline of ``stages`` stages with 1, 2, ... batches in flight (stage s
    works on batch m at time s + m: each batch still takes ``stages`` units; the empty cells are the
    bubble, ``(stages - 1) / (m + stages - 1)`` of the time)."""
    import matplotlib.pyplot as plt

    panels = 1 + len(micro_batches)
    fig, axes = plt.subplots(1, panels, figsize=(3.6 * panels, 0.45 * stages + 1.4), sharey=True)
    tensor, talk = axes[0], 0.08  # a layer block's all-reduce, in the same units
    for rank in range(stages):
        for block in range(stages):  # the pipeline's stages' layers, a 1/W slice of each on every rank
            left = block * (1 / stages + talk)
            tensor.barh(rank, 1 / stages, left=left, color=RANK_COLORS[0], edgecolor="k", linewidth=0.5)
            tensor.barh(rank, talk, left=left + 1 / stages, color="#444")
    tensor.set(title=f"tensor parallel, {stages} ranks: a slice of\nevery layer each, then an all-reduce (dark)",
               xlabel="time", xlim=(0, stages + max(micro_batches) - 1))
    for ax, m in zip(axes[1:], micro_batches):
        for stage in range(stages):
            for mb in range(m):
                ax.barh(stage, 1, left=stage + mb, color=RANK_COLORS[mb % len(RANK_COLORS)], edgecolor="k",
                        linewidth=0.5)
                ax.text(stage + mb + 0.5, stage, str(mb), ha="center", va="center", fontsize=7)
        bubble = (stages - 1) / (m + stages - 1)
        ax.set(title=f"pipeline, {stages} stages, {m} batch{'es' if m > 1 else ''} in flight:\nidle {bubble:.0%} of the time",
               xlabel="time", xlim=(0, stages + max(micro_batches) - 1))
    for ax in axes:
        ax.title.set_fontsize(9)
        ax.set_xticks([])
    axes[0].invert_yaxis()  # shared: every panel's rank 0 on top
    axes[0].set_yticks(range(stages), [f"rank {r}" for r in range(stages)])
    fig.tight_layout()
    plt.show()
