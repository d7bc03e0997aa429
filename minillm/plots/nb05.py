"""Figures of notebook 05 (blocks): the norms' geometry, the block diagram, the residual stream,
parameter shares (drawn for the notebook's widget) and bytes per decode step.

Each function takes what the notebook computed and draws it; the numbers stay in the notebook.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

NORM, ATTN, FFN, IO = "#dde8f5", "#f9dcc4", "#d5ecd4", "#eeeeee"


def _plt() -> Any:
    import matplotlib.pyplot as plt

    return plt


def norm_geometry(pts: torch.Tensor, angle: np.ndarray, rms_out: torch.Tensor, ln_out: torch.Tensor,
                  scales: torch.Tensor, out_rms: list[float], eps: float) -> None:
    """2-D points before/after RMSNorm and LayerNorm, and RMSNorm's output RMS against the input's."""
    plt = _plt()
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    titles = ["RMSNorm: same direction, radius √2 (less when |x| ≲ √ε)",
              "LayerNorm: onto the line x₂ = −x₁; ±(1, −1)\nexcept near x₁ = x₂, where ε pulls it to 0"]
    for ax, title, out in zip(axes[:2], titles, [rms_out, ln_out]):
        ax.scatter(pts[:, 0], pts[:, 1], c=angle, cmap="hsv", s=8, alpha=0.35)
        ax.scatter(out[:, 0], out[:, 1], c=angle, cmap="hsv", s=40, edgecolor="k", linewidth=0.4)
        ax.set_aspect("equal"); ax.set_xlim(-3.2, 3.2); ax.set_ylim(-3.2, 3.2); ax.set_title(title, fontsize=9)
        ax.set_xlabel("x₁"); ax.set_ylabel("x₂")
    axes[0].text(-3, 2.8, "faint: inputs, bold: outputs", fontsize=8)
    axes[2].semilogx(scales, out_rms)
    axes[2].axvline(eps ** 0.5, ls="--", c="gray"); axes[2].text(eps ** 0.5 * 1.3, 0.4, "√ε", color="gray")
    axes[2].set_xlabel("input RMS"); axes[2].set_ylabel("output RMS")
    axes[2].set_title(f"RMSNorm (γ = 1, ε = {eps:g})", fontsize=10)
    plt.tight_layout(); plt.show()


def _box(ax: Any, x: float, y: float, w: float, h: float, text: str, color: str, fontsize: float = 9) -> None:
    from matplotlib.patches import FancyBboxPatch

    ax.add_patch(FancyBboxPatch((x - w / 2, y - h / 2), w, h, boxstyle="round,pad=0.02,rounding_size=0.08",
                                fc=color, ec="black", lw=0.8))
    ax.text(x, y, text, ha="center", va="center", fontsize=fontsize)


def _arrow(ax: Any, x0: float, y0: float, x1: float, y1: float) -> None:
    ax.annotate("", (x1, y1), (x0, y0), arrowprops={"arrowstyle": "-|>", "lw": 1.1, "shrinkA": 0, "shrinkB": 0})


def _add(ax: Any, x: float, y: float) -> None:  # the residual addition
    ax.plot(x, y, "o", ms=15, mfc="white", mec="black", mew=1.1, zorder=3)
    ax.text(x, y, "+", ha="center", va="center", fontsize=12, zorder=4)


def _branch(ax: Any, sx: float, y_from: float, y_add: float, boxes: list[tuple[float, float, float, str, str]]) -> None:
    """A sub-layer off the stream at x = sx: a branch point, boxes [(y, w, h, text, color)], the add."""
    ax.plot([sx, 2.6], [y_from, y_from], c="black", lw=1.1); ax.plot(sx, y_from, "o", c="black", ms=4)
    y = y_from
    for yb, w, h, text, color in boxes:
        _arrow(ax, 2.6, y, 2.6, yb - h / 2); _box(ax, 2.6, yb, w, h, text, color, 8.5); y = yb + h / 2
    ax.plot([2.6, 2.6], [y, y_add], c="black", lw=1.1); _arrow(ax, 2.6, y_add, sx + 0.16, y_add); _add(ax, sx, y_add)


def block_diagram(cfg: Any) -> None:
    """The whole model, one pre-norm block in detail (minillm's module names), and post-norm for contrast."""
    from matplotlib.patches import FancyBboxPatch

    plt = _plt()
    fig, axes = plt.subplots(1, 3, figsize=(13, 6.2), gridspec_kw={"width_ratios": [0.8, 1.45, 1.0]})
    for ax in axes:
        ax.set_xlim(0, 4); ax.set_ylim(-0.4, 9.6); ax.axis("off")

    ax = axes[0]  # the whole model
    ax.set_title("the model", fontsize=11)
    for y, text, color in [(0.4, "token ids [seq]", IO), (1.6, f"embed_tokens\n{cfg.vocab_size} × {cfg.hidden_size}", IO),
                           (5.7, "norm (RMSNorm)", NORM),
                           (7.0, f"lm_head {cfg.hidden_size} → {cfg.vocab_size}\n(= embed_tokens, tied)", IO),
                           (8.4, f"logits [seq, {cfg.vocab_size}]", IO)]:
        _box(ax, 2, y, 3.0, 0.75, text, color, 8.5)
    ax.add_patch(FancyBboxPatch((0.5, 2.55), 3.0, 2.1, boxstyle="round,pad=0.02,rounding_size=0.1", fc="#fff6d6",
                                ec="black", lw=1.2))
    ax.text(2, 3.6, f"block × {cfg.n_layers}\n(middle)", ha="center", va="center", fontsize=10, weight="bold")
    for y0, y1 in [(0.78, 1.22), (1.98, 2.55), (4.65, 5.32), (6.08, 6.55), (7.45, 8.02)]:
        _arrow(ax, 2, y0, 2, y1)

    sx = 0.9  # the residual stream runs up this line
    ax = axes[1]  # pre-norm, as in SmolLM2
    ax.set_title("one block, pre-norm (Llama, SmolLM2)", fontsize=11)
    ax.text(sx, -0.25, f"x  [seq, {cfg.hidden_size}]\n(residual stream)", ha="center", va="center", fontsize=8.5)
    for y0, y1 in [(0.1, 4.24), (4.56, 8.24), (8.56, 9.5)]:
        _arrow(ax, sx, y0, sx, y1)
    ax.text(sx + 0.1, 9.45, "to the next block", ha="left", va="center", fontsize=8)
    _branch(ax, sx, 0.85, 4.4, [(1.6, 2.6, 0.6, "input_layernorm (RMSNorm)", NORM),
                                (3.0, 2.6, 0.9, f"self_attn\nRoPE · {cfg.n_heads} q / {cfg.n_kv_heads} kv heads (GQA)", ATTN)])
    _branch(ax, sx, 4.85, 8.4, [(5.6, 2.6, 0.6, "post_attention_layernorm (RMSNorm)", NORM),
                                (7.0, 2.6, 0.9, f"mlp (SwiGLU)\ngate, up {cfg.hidden_size} → {cfg.intermediate_size}\n"
                                                f"down {cfg.intermediate_size} → {cfg.hidden_size}", FFN)])
    ax.text(sx - 0.12, 6.9, "identity path:\nnever normalized", rotation=90, ha="right", va="center", fontsize=8, color="C0")

    ax = axes[2]  # post-norm, the 2017 Transformer
    ax.set_title("for contrast: post-norm (2017)", fontsize=11)
    ax.text(sx, -0.25, f"x  [seq, {cfg.hidden_size}]\n(residual stream)", ha="center", va="center", fontsize=8.5)
    _branch(ax, sx, 1.0, 3.3, [(2.0, 2.0, 0.8, "self_attn", ATTN)])
    _branch(ax, sx, 4.9, 7.2, [(5.9, 2.0, 0.8, "FFN", FFN)])
    for y in (4.2, 8.2):
        _box(ax, sx, y, 1.5, 0.55, "LayerNorm", NORM, 8.5)
    for y0, y1 in [(0.1, 3.14), (3.46, 3.92), (4.48, 7.04), (7.36, 7.92), (8.48, 9.5)]:
        _arrow(ax, sx, y0, sx, y1)
    ax.text(2.2, 9.2, "the stream itself is normalized\nafter every sub-layer", ha="left", va="center", fontsize=8, color="C3")
    plt.tight_layout(); plt.show()


def residual_stream(rms_stream: torch.Tensor, attn_ratio: torch.Tensor, mlp_ratio: torch.Tensor) -> None:
    """The stream's RMS after each block ([blocks + 1, tokens]) and each update relative to the stream."""
    plt = _plt()
    n = rms_stream.shape[0]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12.5, 3.8))
    a1.semilogy(rms_stream[:, 0], "o-", ms=3, label="token 0 (first)")
    a1.semilogy(rms_stream[:, 1:].median(-1).values, "o-", ms=3, label="other tokens (median)")
    a1.fill_between(range(n), rms_stream[:, 1:].min(-1).values, rms_stream[:, 1:].max(-1).values, alpha=0.2, color="C1")
    a1.set_xlabel("after block (0 = embeddings)"); a1.set_ylabel("RMS of the residual stream"); a1.legend()
    a1.set_title("the residual stream grows by two orders of magnitude")
    layers = range(1, n)
    a2.plot(layers, attn_ratio[:, 1:].median(-1).values, "o-", ms=3, label="attention update")
    a2.plot(layers, mlp_ratio[:, 1:].median(-1).values, "o-", ms=3, label="FFN update")
    a2.axhline(1, c="gray", lw=0.5); a2.set_yscale("log")
    a2.set_xlabel("block"); a2.set_ylabel("RMS(update) / RMS(stream)"); a2.legend()
    a2.set_title("each update relative to the stream (median over tokens 1..)")
    plt.tight_layout(); plt.show()


PART_COLORS = {"embeddings": "C0", "attention": "C1", "FFN (SwiGLU)": "C2", "norms": "C7", "lm_head": "C4"}


def param_breakdown_bars(models: Mapping[str, Mapping[str, int]], ax: Any = None, title: str = "") -> Any:
    """One stacked bar per model: each part's share of its parameters, the total at the right."""
    plt = _plt()
    if ax is None:
        fig, ax = plt.subplots(figsize=(10, 0.6 + 0.55 * len(models) + (0.4 if title else 0)))
    for row, (name, parts) in enumerate(models.items()):
        total, left = sum(parts.values()), 0.0
        for part, n in parts.items():
            ax.barh(row, n / total, left=left, color=PART_COLORS[part], label=part if row == 0 else None)
            if n / total > 0.07:
                ax.text(left + n / total / 2, row, f"{n / total:.0%}", ha="center", va="center", color="white", fontsize=9)
            left += n / total
        ax.text(1.01, row, f"{total / 1e6:,.0f}M", va="center")
    ax.set_yticks(range(len(models)), list(models)); ax.invert_yaxis(); ax.set_xlim(0, 1)
    ax.set_xlabel("share of parameters")
    ax.legend(ncol=5, loc="lower center", bbox_to_anchor=(0.5, 1.0), fontsize=8, frameon=False)
    if title:
        ax.set_title(title, fontsize=10, pad=22)
    return ax


def bytes_per_step(t: np.ndarray, weight_mb: float, kv_per_token: int, n_params: int, context: int) -> None:
    """MB read per decode step in bfloat16: the weights (flat) against the KV cache of batch 1 and 8."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8, 3.6))
    ax.axhline(weight_mb, c="k", lw=1.5, label="weights, read once per step")
    for batch, color in [(1, "C0"), (8, "C1")]:
        ax.plot(t, 2 * batch * t * kv_per_token / 1e6, c=color, label=f"KV cache of a batch of {batch}")
        cross = n_params / (batch * kv_per_token)
        ax.axvline(cross, c=color, ls=":", lw=1)
        ax.text(cross * 1.06, 0.05, f"{cross:,.0f}", color=color, fontsize=8)
    ax.axvspan(context, t[-1], color="gray", alpha=0.15, label="past SmolLM2's context window")
    ax.set_xscale("log"); ax.set_yscale("log"); ax.set_ylim(0.02, 2000)
    ax.set_xlabel("context length per sequence (tokens)"); ax.set_ylabel("MB read per decode step (bfloat16)")
    ax.legend(fontsize=8, loc="upper left"); ax.set_title("bytes per decode step: weights vs KV cache"); plt.show()
