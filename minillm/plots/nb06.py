"""Figures of notebook 06 (real weights): the value grid of quantized blocks, logits against
transformers', and the spread of every weight matrix layer by layer.

Each function takes what the notebook computed and draws it; the numbers stay in the notebook.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch


def _plt() -> Any:
    import matplotlib.pyplot as plt

    return plt


def value_grid(q4_block: np.ndarray, d4: float, m4: float, q8_block: np.ndarray, d8: float) -> None:
    """Each weight of a Q4_1 block on its 16 levels m + d·q; all 32 weights of a Q8_0 block, whose 255
    levels d·q are too dense to draw at full height; and a zoom on the three consecutive Q8_0 weights
    that lie closest together, where the levels can be seen apart."""
    plt = _plt()
    fig, axes = plt.subplots(1, 3, figsize=(13.5, 3.8), gridspec_kw={"width_ratios": [1, 1, 0.45]})
    for level in range(16):
        axes[0].axhline(m4 + d4 * level, c="gray", lw=0.6, alpha=0.6)
    axes[0].plot(q4_block, "o", c="C3")
    axes[0].set_title(f"Q4_1 block (layer 0 W_q): 16 levels m + d·q\nd = {d4:.4f}, m = {m4:.4f}", fontsize=10)
    axes[1].plot(q8_block, "o", c="C0")
    axes[1].set_title(f"Q8_0 block (' Paris' embedding): 255 levels d·q\nd = {d8:.5f}, too dense to draw here", fontsize=10)
    q = np.rint(q8_block / d8).astype(int)
    start = min(range(len(q) - 2), key=lambda j: q[j:j + 3].max() - q[j:j + 3].min())
    low, high = q[start:start + 3].min() - 2, q[start:start + 3].max() + 2
    axes[1].axvspan(start - 0.4, start + 2.4, color="gray", alpha=0.15)
    for level in range(low, high + 1):
        axes[2].axhline(d8 * level, c="gray", lw=0.6, alpha=0.6)
    axes[2].plot(range(start, start + 3), q8_block[start:start + 3], "o", c="C0")
    axes[2].set_xlim(start - 0.6, start + 2.6); axes[2].set_ylim((low - 0.5) * d8, (high + 0.5) * d8)
    axes[2].set_xticks(range(start, start + 3))
    axes[2].set_title(f"zoom (shaded): elements {start}-{start + 2},\nlevels q = {low}..{high}", fontsize=10)
    for ax in axes:
        ax.set_xlabel("element of the block"); ax.set_ylabel("weight value")
    plt.tight_layout(); plt.show()


def logits_vs_reference(panels: Sequence[tuple[str, torch.Tensor]], reference: torch.Tensor) -> None:
    """One scatter per (title, logits): each logit against transformers' logit for the same token."""
    plt = _plt()
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), sharey=True)
    low, high = float(reference.min()) - 2, float(reference.max()) + 2
    for ax, (title, logits) in zip(axes, panels):
        ax.plot(logits, reference, ",", alpha=0.4)
        ax.plot([low, high], [low, high], c="gray", lw=0.5)
        ax.set_xlabel("logit (model under test)"); ax.set_title(title, fontsize=10)
    axes[0].set_ylabel("logit (transformers)")
    plt.tight_layout(); plt.show()


def weight_stds(stds: Mapping[str, Sequence[float]], init_std: float) -> None:
    """The std of every weight matrix, layer by layer, against the random-initialisation scale."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(10, 3.5))
    for kind, values in stds.items():
        ax.plot(values, "o-", ms=3, label=kind.split(".")[1])
    n_layers = len(next(iter(stds.values())))
    ax.axhline(init_std, c="gray", ls="--", lw=1)
    ax.text(n_layers - 1, init_std * 1.15, "random init", ha="right", fontsize=8, color="gray")
    ax.set_xlabel("layer"); ax.set_ylabel("std of the weights"); ax.set_ylim(0, None); ax.legend(ncol=4, fontsize=8)
    ax.set_title("std of every matrix, layer by layer: none zero, none at random init; layer 0 stands apart")
    plt.show()
