"""Notebook 11's figures (quantization): ceilings per format, quantization grids, the packed block
layouts, error per layer, outlier channels, KL per position, speed against quality; and
two sources side by side.

Each function takes what the notebook computed and draws it; matplotlib is imported on first use.
"""

from __future__ import annotations

import html
from collections.abc import Sequence
from typing import Any

import numpy as np


def _plt() -> Any:
    import matplotlib.pyplot as plt

    return plt


def two_ceilings(formats: Sequence[str], memory: dict[str, float], compute: dict[str, dict[str, float]]) -> None:
    """Bars per format: the memory ceiling (bandwidth ÷ bytes per token) and each compute ceiling
    (``compute[label][fmt]``, tokens/s if every matrix ran at its measured rate)."""
    plt = _plt()
    xs = np.arange(len(formats))
    width = 0.8 / (1 + len(compute))
    _, ax = plt.subplots(figsize=(8, 3.4))
    ax.bar(xs - width, [memory[f] for f in formats], width, color="C0",
           label="memory ceiling: bandwidth ÷ bytes per token")
    for k, (label, ceiling) in enumerate(compute.items()):
        ax.bar(xs + width * k, [ceiling[f] for f in formats], width, color=["C3", "C2", "C4"][k],
               label=f"compute ceiling, {label}")
    ax.set_xticks(xs, formats)
    ax.set_ylabel("tokens / s, one core")
    ax.set_title("Two ceilings per format (measured in this run, one core)", fontsize=10)
    ax.legend(fontsize=8)
    plt.show()


def block_grids(x: Any, panels: Sequence[tuple[str, Any, Any, float]], title: str) -> None:
    """One block's weights ``x`` [32] against each grid: ``(name, levels, quantized values, rel. error)``."""
    plt = _plt()
    fig, axes = plt.subplots(1, len(panels), figsize=(11, 3.4), sharey=True)
    for ax, (name, levels, quantized, error) in zip(axes, panels):
        for level in levels:
            ax.axhline(float(level), color="gray", lw=0.6, alpha=0.6)
        ax.plot(x, "o", color="C0", label="weight")
        ax.plot(quantized, "_", color="C3", ms=12, mew=2, label="quantized")
        ax.set_title(f"{name}: {len(levels)} levels, rel. error {error:.1%}", fontsize=10)
        ax.set_xlabel("weight in the block")
    axes[0].set_ylabel("value")
    axes[0].legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    plt.show()


def group_sweep(groups: Sequence[int], bits: dict[str, Sequence[float]], errors: dict[str, Sequence[float]],
                names: dict[str, str]) -> None:
    """Relative error against bits per weight (scales included), one curve per scheme, points
    labelled with their group size."""
    plt = _plt()
    _, ax = plt.subplots(figsize=(7, 3.6))
    for k, (fmt, name) in enumerate(names.items()):
        ax.plot(bits[fmt], errors[fmt], "o-", color=f"C{k}", label=name)
        for g, b, e in zip(groups, bits[fmt], errors[fmt]):  # labels above one curve, below the other
            ax.annotate(f"{g}", (b, e), textcoords="offset points", xytext=(4, 5) if k == 0 else (-4, -12),
                        fontsize=7, color=f"C{k}")
    ax.margins(y=0.12)
    ax.set_xlabel("bits per weight, scales included")
    ax.set_ylabel("relative RMS error")
    ax.set_title("4-bit codes on 4,096 rows of the table; labels: group size", fontsize=10)
    ax.legend(fontsize=8)
    plt.show()


def block_layouts() -> None:
    """One block of Q8_0, Q4_0 and Q4_1 byte by byte, as a GGUF file stores it."""
    plt = _plt()
    _, ax = plt.subplots(figsize=(12, 2.6))
    for y, fmt in [(2.2, "q8_0"), (1.1, "q4_0"), (0.0, "q4_1")]:
        x0 = 0
        for name in ["d", "m"] if fmt == "q4_1" else ["d"]:  # the float16 scale (and minimum)
            ax.add_patch(plt.Rectangle((x0, y), 2, 0.8, fc="C1", ec="k", lw=0.6))
            ax.text(x0 + 1, y + 0.4, f"{name} f16", ha="center", va="center", fontsize=7)
            x0 += 2
        for j in range(32 if fmt == "q8_0" else 16):
            if fmt == "q8_0":
                ax.add_patch(plt.Rectangle((x0 + j, y), 1, 0.8, fc="C0", alpha=0.5, ec="k", lw=0.4))
                ax.text(x0 + j + 0.5, y + 0.4, str(j), ha="center", va="center", fontsize=6)
                continue
            for half, weight, color in [(0.0, j, "C2"), (0.4, j + 16, "C4")]:  # low nibble below, high above
                ax.add_patch(plt.Rectangle((x0 + j, y + half), 1, 0.4, fc=color, alpha=0.5, ec="k", lw=0.4))
                ax.text(x0 + j + 0.5, y + half + 0.2, str(weight), ha="center", va="center", fontsize=6)
        size = x0 + (32 if fmt == "q8_0" else 16)
        ax.text(-0.5, y + 0.4, f"{fmt.upper()}  {size} bytes", ha="right", va="center", fontsize=9)
    ax.set_xlim(-9, 35)
    ax.set_ylim(-0.6, 3.2)
    ax.axis("off")
    ax.set_title("one block of 32 weights; each box a byte, its numbers the weights it holds "
                 "(4-bit: low nibble below, high nibble above)", fontsize=9)
    plt.show()


def errors_per_layer(errors: dict[str, Any], kinds: Sequence[str]) -> None:
    """``errors[fmt]`` [kinds, layers]: relative error of each matrix, one panel per format."""
    plt = _plt()
    _, axes = plt.subplots(1, len(errors), figsize=(12, 3.4), sharex=True)
    for ax, (fmt, e) in zip(axes, errors.items()):
        for k, kind in enumerate(kinds):
            ax.plot(100 * e[k], label=kind.split(".")[-1], lw=1)
        ax.set_title(f"{fmt.upper()} re-quantized from the Q4_1 weights", fontsize=10)
        ax.set_xlabel("layer")
        ax.set_ylabel("relative RMS error, %")
    axes[-1].legend(fontsize=7, ncol=2)
    plt.show()


def outlier_channels(h: Any, layer: int) -> None:
    """A residual stream ``h`` [tokens, channels]: the largest |h| per channel (token 0 left out)
    and per token."""
    plt = _plt()
    _, axes = plt.subplots(1, 2, figsize=(12, 3.2))
    axes[0].semilogy(h[1:].abs().amax(0), lw=0.8)
    axes[0].set_title(f"layer {layer} residual: max |h| per channel, tokens 1-{len(h) - 1}", fontsize=10)
    axes[0].set_xlabel("channel")
    axes[1].semilogy(h.abs().amax(-1), lw=0.8, color="C3")
    axes[1].set_title(f"layer {layer} residual: max |h| per token", fontsize=10)
    axes[1].set_xlabel("position")
    for ax in axes:
        ax.set_ylabel("max |h|")
    plt.show()


def kl_histogram(kl: Any, name: str) -> None:
    """The KL of each position, on a log scale (0 drawn at 1e-6)."""
    plt = _plt()
    _, ax = plt.subplots(figsize=(8, 2.8))
    ax.hist(np.log10(np.maximum(np.asarray(kl, dtype=float), 1e-6)), bins=40, color="C3")
    ax.set_xlabel(f"log10 KL per position ({name} vs float32)")
    ax.set_ylabel("positions")
    plt.show()


def speed_vs_quality(rows: dict[str, dict[str, float]], chosen: str, floor: float = 1e-5) -> Any:
    """Decode speed against KL, one marker per format (area ~ MB), ``chosen`` highlighted; the axes
    fit every row (a KL of 0 is drawn at ``floor``). Returns the figure, not shown."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.5, 3.4))
    speeds = [r["tok_s"] for r in rows.values()]
    for fmt, r in rows.items():
        kl = max(r["kl"], floor)
        ax.scatter(r["tok_s"], kl, s=40 + r["mb"] / 3, color="C3" if fmt == chosen else "C0",
                   alpha=1.0 if fmt == chosen else 0.45, zorder=3)
        ax.annotate(fmt, (r["tok_s"], kl), textcoords="offset points", xytext=(6, 4), fontsize=8)
    span = max(speeds) - min(speeds)
    ax.set_xlim(min(speeds) - 0.15 * span - 1, max(speeds) + 0.3 * span + 1)  # room for the labels
    ax.set_yscale("log")
    ax.set_ylim(floor / 2, max(max(r["kl"] for r in rows.values()) * 5, floor * 10))
    ax.set_xlabel("decode tokens / s (this run, one core)")
    ax.set_ylabel(f"KL vs float32, nats (0 drawn at {floor:g})")
    r = rows[chosen]
    ax.set_title(f"{chosen}: {r['mb']:.0f} MB, {r['tok_s']:.0f} tok/s, KL {r['kl']:.4f}; "
                 "marker area ~ MB", fontsize=10)
    return fig


def side_by_side(left: str, right: str, titles: tuple[str, str]) -> None:
    """Two sources (C++ here) in two columns, with a plain-text fallback of one after the other."""
    from IPython.display import display

    cells = "".join(f'<td style="vertical-align:top;text-align:left"><b>{html.escape(title)}</b>'
                    f'<pre style="font-size:11px">{html.escape(text)}</pre></td>'
                    for title, text in zip(titles, (left, right)))
    plain = "\n\n".join(f"--- {title}\n{text}" for title, text in zip(titles, (left, right)))
    display({"text/html": f"<table><tr>{cells}</tr></table>", "text/plain": plain}, raw=True)
