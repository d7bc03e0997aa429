"""Drawing helpers of notebook 04 (RoPE).

Each function takes what the notebook computed and draws it.
"""

from __future__ import annotations

import cmath
import math
from collections.abc import Sequence
from typing import Any

import torch


def _unit_circle(ax: Any) -> None:
    import matplotlib.pyplot as plt
    ax.add_patch(plt.Circle((0, 0), 1, fill=False, ls=":", color="gray"))
    ax.set_aspect("equal")
    ax.set_xticks([])
    ax.set_yticks([])


def pair_trails(inv_freq: torch.Tensor, pairs: Sequence[int], positions: range) -> None:
    """Section 3: one pair's unit vector drawn at each position, one panel per pair."""
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(pairs), figsize=(3.75 * len(pairs), 3.8))
    for ax, pair in zip(axes, pairs):
        colours = plt.cm.viridis(torch.linspace(0, 1, len(positions)).numpy())
        for m, colour in zip(positions, colours):
            w = cmath.exp(1j * m * float(inv_freq[pair]))
            ax.annotate("", xy=(w.real, w.imag), xytext=(0, 0),
                        arrowprops={"arrowstyle": "->", "color": colour, "lw": 1.5})
            ax.text(1.12 * w.real, 1.12 * w.imag, str(m), fontsize=7, ha="center", va="center")
        _unit_circle(ax)
        ax.set_xlim(-1.3, 1.3)
        ax.set_ylim(-1.3, 1.3)
        ax.set_title(f"pair {pair}: {math.degrees(inv_freq[pair]):.1f}° per position", fontsize=9)
    fig.suptitle(f"one pair of q, rotated at positions {positions[0]}…{positions[-1]}")
    plt.show()


def long_range_decay(distances: torch.Tensor, curves: dict[str, torch.Tensor], context: int, head_dim: int) -> None:
    """Section 4: the expected score against the distance, one curve per theta, each averaged over
    distances within ±20% so the trend shows without the fast pairs' wiggles."""
    import matplotlib.pyplot as plt
    centres = torch.logspace(0, math.log10(len(distances)), 300, dtype=torch.float64)
    lo = (centres / 1.2).floor().clamp(min=1).long()
    hi = (centres * 1.2).ceil().clamp(max=len(distances)).long()
    _, ax = plt.subplots(figsize=(7.5, 3.6))
    for label, expected in curves.items():
        running = torch.cat([torch.zeros(1, dtype=torch.float64), expected.cumsum(0)])
        ax.semilogx(centres, (running[hi] - running[lo - 1]) / (hi - lo + 1), lw=1.5, label=f"theta {label}")
    ax.axhline(0, color="k", lw=0.5)
    ax.axvline(context, color="gray", ls=":", lw=1, label="SmolLM2's context")
    ax.set_xlabel("distance m − n (tokens)")
    ax.set_ylabel("relative expected score")
    ax.set_title(f"RoPE's long-range decay, head_dim {head_dim} (averaged over ±20% of the distance)", fontsize=10)
    ax.legend(fontsize=7)
    plt.show()


def rotation(position: int, inv_freq: torch.Tensor, pairs: Sequence[int]) -> Any:
    """Section 6: each pair's unit vector at ``position``, with the trail of the positions before.
    Returns the figure (for the notebook's slider)."""
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(pairs), figsize=(12, 2.8))
    for ax, pair in zip(axes, pairs):
        angles = torch.arange(position + 1) * inv_freq[pair]
        trail = torch.polar(torch.ones(position + 1, dtype=torch.float64), angles)
        ax.plot(trail.real, trail.imag, ".", color="lightsteelblue", ms=3)
        ax.annotate("", xy=(trail[-1].real, trail[-1].imag), xytext=(0, 0),
                    arrowprops={"arrowstyle": "->", "color": "C3", "lw": 2})
        _unit_circle(ax)
        ax.set_xlim(-1.2, 1.2)
        ax.set_ylim(-1.2, 1.2)
        ax.set_title(f"pair {pair}\nangle {math.degrees(position * float(inv_freq[pair])) % 360:.0f}°", fontsize=9)
    fig.suptitle(f"position {position}", y=1.04)
    return fig


def context_extension(schemes: dict[str, torch.Tensor], plain_freqs: torch.Tensor, losses: dict[str, torch.Tensor],
                      gaps: Sequence[int], cold: float, context: int, factor: float) -> None:
    """Section 8: left, what each scaling scheme does to each pair's frequency; right, the copy loss
    across each gap with each scheme, against reading the passage cold."""
    import matplotlib.pyplot as plt
    _, (ax_f, ax_l) = plt.subplots(1, 2, figsize=(13, 3.8))
    for (name, freqs), style in zip(schemes.items(), ["s-", "^-", "o-"]):
        ax_f.plot(freqs / plain_freqs, style, ms=3, label=name)
    slow = int((2 * math.pi / plain_freqs < context).sum())
    ax_f.axvspan(slow - 0.5, len(plain_freqs) - 0.5, color="gray", alpha=0.15,
                 label=f"pairs that never turn fully in {context}")
    ax_f.set_xlabel("pair i (fast → slow)")
    ax_f.set_ylabel("scaled frequency / trained frequency")
    ax_f.set_title(f"what each scheme does to the {len(plain_freqs)} pairs (factor {factor:g})")
    ax_f.legend(fontsize=7)
    for (name, loss), style in zip(losses.items(), ["k.-", "s-", "^-", "o-"]):
        ax_l.plot(gaps, loss, style, ms=4, label=name)
    ax_l.axhline(cold, color="r", ls=":", label="reading it cold")
    ax_l.axvline(context, color="gray", ls="--", lw=1, label="trained context")
    ax_l.set_xlabel("gap between the two copies (tokens)")
    ax_l.set_ylabel("loss on the second copy (nats/token)")
    ax_l.set_title("can the model still copy from that far back? (no fine-tuning)")
    ax_l.set_ylim(0, 9.8)
    ax_l.legend(fontsize=7, ncol=2, loc="upper left")
    plt.show()
