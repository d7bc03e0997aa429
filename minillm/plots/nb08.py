"""Notebook 08's figures (the paged KV cache): a contiguous reservation, a block pool, waste.

Each function takes what the notebook computed and shows one figure (``paging_figure`` returns
its figure, for the notebook's widget); matplotlib is imported when a function draws.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

SEQ_COLORS = ["C0", "C1", "C2", "C4", "C5"]
SCHEME_STYLES = {"contiguous batch, held to the end": ("C3", ":"), "contiguous per request, freed at its end": ("C3", "--"),
                 "paged, held to the end": ("C2", "--"), "paged, freed at its end": ("C2", "-")}


def contiguous_reservation(prompt_lengths: Sequence[int], max_new: int, stops_after: Sequence[int]) -> None:
    """A left-padded contiguous cache at its last step: one row per request, each slot coloured as
    padding, prompt, generated, or reserved and never used."""
    import matplotlib.pyplot as plt
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Patch

    width = max(prompt_lengths) + max_new  # slots reserved per row
    layout = [[0] * width for _ in prompt_lengths]  # 0 pad, 1 prompt, 2 generated, 3 reserved but never used
    for row, (n_prompt, n_out) in enumerate(zip(prompt_lengths, stops_after)):
        start = width - max_new
        layout[row][start - n_prompt:start] = [1] * n_prompt
        layout[row][start:] = [2] * n_out + [3] * (max_new - n_out)
    colors = ["0.8", "C0", "C2", "mistyrose"]
    _, ax = plt.subplots(figsize=(10, 1.8))
    ax.imshow(layout, cmap=ListedColormap(colors), vmin=-0.5, vmax=3.5, aspect="auto")
    ax.set(yticks=range(len(layout)), yticklabels=[f"request {i}" for i in range(len(layout))],
           xlabel="slot (column of the cache)")
    labels = ["left padding", "prompt", "generated", "reserved, never used"]
    ax.legend(handles=[Patch(color=c, label=label) for c, label in zip(colors, labels)], loc="upper left",
              bbox_to_anchor=(1, 1))
    plt.show()


def draw_pool(cache: Any, title: str = "", figsize: tuple[float, float] = (11, 3.6)) -> None:
    """Each column one block of the pool, each cell one token slot, coloured by the sequence that
    owns it (grey when shared); a cell's number is the token's position in its sequence, the
    label above a column whose block it is and where in that sequence's table it sits."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch, Rectangle

    _, ax = plt.subplots(figsize=figsize)
    bs, ref_counts, n_blocks = cache.block_size, cache.allocator.ref_counts, cache.allocator.num_blocks
    owners: dict[int, list[tuple[int, int]]] = {}  # block -> [(seq, index in its table)]
    for s, table in cache.block_tables.items():
        for i, b in enumerate(table):
            owners.setdefault(b, []).append((s, i))
    for b in range(n_blocks):
        held = owners.get(b, [])
        color = "white" if not held else "0.55" if ref_counts[b] > 1 else SEQ_COLORS[held[0][0] % len(SEQ_COLORS)]
        for off in range(bs):
            filled = [s for s, i in held if i * bs + off < cache.lengths[s]]
            ax.add_patch(Rectangle((b, off), 1, 1, facecolor=color, alpha=0.9 if filled else 0.2, edgecolor="0.85",
                                   lw=0.5))
            if filled:
                ax.text(b + 0.5, off + 0.5, held[0][1] * bs + off, ha="center", va="center", fontsize=6)
        ax.add_patch(Rectangle((b, 0), 1, bs, fill=False, edgecolor="k", lw=1))
        ax.text(b + 0.5, -0.3, "\n".join(f"s{s}[{i}]" for s, i in held), ha="center", va="bottom", fontsize=7)
    ax.set(xlim=(0, n_blocks), ylim=(bs, -0.3 - 0.9 * max(1, *map(len, owners.values()))),
           xticks=[b + 0.5 for b in range(n_blocks)], xticklabels=range(n_blocks),
           yticks=[o + 0.5 for o in range(bs)], yticklabels=range(bs), xlabel="block id", ylabel="offset in block")
    ax.set_title(title, fontsize=10)
    handles = [Patch(color=SEQ_COLORS[s % len(SEQ_COLORS)], label=f"sequence {s}") for s in sorted(cache.block_tables)]
    if any(ref_counts[b] > 1 for b in owners):
        handles.append(Patch(color="0.55", label="shared block"))
    ax.legend(handles=handles + [Patch(facecolor="white", edgecolor="k", label="free block")],
              loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8)
    plt.show()


def waste_vs_block_size(waste: Callable[[int], dict[str, float]], average_mib: dict[str, float]) -> None:
    """Left: each scheme's waste (%) against the block size. Right: the KV memory each scheme holds
    on average per step at block 16 (``average_mib``: "tokens stored" first, then the schemes)."""
    import matplotlib.pyplot as plt

    block_sizes = [2**k for k in range(9)]
    by_size = [waste(bs) for bs in block_sizes]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 3.8), gridspec_kw={"width_ratios": [1.3, 1]})
    for scheme, (color, style) in SCHEME_STYLES.items():
        ax1.plot(block_sizes, [w[scheme] for w in by_size], marker="o" if color == "C2" else "", color=color, ls=style,
                 label=scheme)
    ax1.set(xscale="log", xlabel="block size (tokens)", ylabel="% of reserved slot-steps wasted", ylim=(0, 100),
            title="waste vs. block size (64 requests)")
    ax1.set_xticks(block_sizes, block_sizes)
    ax1.legend(fontsize=7, loc="upper center", ncol=2)
    ax2.barh([s.replace(", ", ",\n") for s in average_mib], list(average_mib.values()),
             color=["C0", "C3", "C3", "C2", "C2"])
    ax2.invert_yaxis()
    ax2.tick_params(axis="y", labelsize=8)
    ax2.set(xlabel="MiB held on average per step (SmolLM2, fp32)", title="KV memory, block 16")
    fig.tight_layout()
    plt.show()


def paging_figure(workload: Sequence[tuple[int, int]], max_new_tokens: int, wasted: dict[str, float],
                  block_size: int) -> Any:
    """Left: one row per request at its last step (stored tokens, the unused tail of its last
    block, a contiguous reservation as an outline). Right: each scheme's waste over the run.
    Returns the figure, not shown."""
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.6), gridspec_kw={"width_ratios": [1.4, 1]})
    for row, (p, n) in enumerate(workload):
        paged = math.ceil((p + n) / block_size) * block_size
        ax1.barh(row, p + max_new_tokens, fill=False, edgecolor="0.5", lw=0.6, height=0.8)
        ax1.barh(row, p + n, color="C2", height=0.8)
        ax1.barh(row, paged - p - n, left=p + n, color="C3", height=0.8)
    ax1.set(xlabel="token slots", ylabel="request")
    ax1.set_title(f"block size {block_size}: stored (green), paging's waste (red),\ncontiguous reservation (outline)",
                  fontsize=10)
    ax2.barh(range(len(wasted)), list(wasted.values()), color=[SCHEME_STYLES[s][0] for s in wasted])
    ax2.set_yticks(range(len(wasted)), [s.replace(", ", ",\n") for s in wasted], fontsize=8)
    ax2.invert_yaxis()
    for y, w in enumerate(wasted.values()):
        ax2.text(w + 1, y, f"{w:.1f}%", va="center", fontsize=8)
    ax2.set(xlabel="% of reserved slot-steps wasted", xlim=(0, 100), title="waste, whole run")
    fig.tight_layout()
    plt.close(fig)  # shown by whoever asked for it, once
    return fig
