"""Drawing helpers of notebook 03 (attention).

Each function takes what the notebook computed and draws it; none computes anything the lesson
is about. (The notebook's widget comes from :mod:`minillm.plots.widgets`.)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch


def _plt() -> Any:
    import matplotlib.pyplot as plt

    return plt


def reach(moved: dict[str, torch.Tensor]) -> None:
    """Section 0: how much each output moves when token 0 is nudged, one curve per model."""
    plt = _plt()
    _, ax = plt.subplots(figsize=(6, 3.2))
    for name, change in moved.items():
        ax.semilogy(change.clamp_min(1e-12), label=name)
    ax.set_xlabel("position t of the output")
    ax.set_ylabel("‖change of output t‖")
    ax.set_title("nudging token 0: how far does it reach?")
    ax.legend()
    plt.show()


def score_variance(d_ks: Sequence[int], var_raw: Sequence[float], var_scaled: Sequence[float]) -> None:
    """Section 3: the variance of q·k with and without the 1/√d_k, against d_k."""
    plt = _plt()
    _, ax = plt.subplots(figsize=(5.5, 3.6))
    ax.loglog(d_ks, var_raw, "o-", label="q·k")
    ax.loglog(d_ks, var_scaled, "s-", label="q·k / √d_k")
    ax.loglog(d_ks, d_ks, "k:", label="d_k (theory)")
    ax.set_xlabel("d_k (head_dim)")
    ax.set_ylabel("variance of the score")
    ax.set_title("score variance grows like d_k unless scaled")
    ax.legend()
    plt.show()


def saturation(d_ks: Sequence[int], results: dict[bool, list[list[float]]], panels: Sequence[str],
               n_keys: int) -> None:
    """Section 3: one panel per measure of the softmax, scaled and unscaled scores, against d_k."""
    plt = _plt()
    fig, axes = plt.subplots(1, len(panels), figsize=(15, 3.4))
    for i, name in enumerate(panels):
        for scale, style in [(False, "o-"), (True, "s-")]:
            label = "q·k / √d_k" if scale else "q·k"
            axes[i].semilogx(d_ks, [r[i] for r in results[scale]], style, base=2, label=label)
        axes[i].axvline(64, color="gray", lw=0.6, ls="--")
        axes[i].set_xlabel("d_k (dashed: SmolLM2's 64)")
        axes[i].set_title(name, fontsize=10)
    axes[1].axhline(torch.tensor(float(n_keys)).log().item(), color="k", ls=":", label="uniform")
    axes[0].legend()
    axes[1].legend()
    fig.suptitle(f"softmax over {n_keys} keys: unscaled scores saturate as d_k grows", y=1.03)
    plt.show()


def heatmap(weights: torch.Tensor, tokens: Sequence[str], title: str = "", ax: Any = None) -> Any:
    """Attention weights ``[q_len, k_len]``: one row per query (who reads), one column per key (what
    is read), each labelled with its token. Draws into ``ax`` or a new figure, which it returns."""
    plt = _plt()
    fig = None
    if ax is None:
        fig, ax = plt.subplots(figsize=(5, 4.8))
    ax.imshow(weights, cmap="Blues", vmin=0, vmax=1)
    ax.set_xticks(range(len(tokens)), tokens, rotation=90, fontsize=7)
    ax.set_yticks(range(len(tokens)), tokens, fontsize=7)
    ax.set_xlabel("key position: the token read", fontsize=8)
    ax.set_ylabel("query position: the token reading", fontsize=8)
    ax.set_title(title, fontsize=9)
    return fig


def head_gallery(weights_of: Callable[[int], torch.Tensor], examples: Sequence[tuple[int, int, str]],
                 tokens: Sequence[str]) -> None:
    """Section 8: a grid of real heads, ``(layer, head, what it does)`` each."""
    plt = _plt()
    fig, axes = plt.subplots(2, (len(examples) + 1) // 2, figsize=(12, 9))
    for ax, (layer, head, what) in zip(axes.flat, examples):
        heatmap(weights_of(layer)[head], tokens, f"layer {layer}, head {head}\n{what}", ax=ax)
    fig.tight_layout()
    plt.show()


def mask_patterns(causal: torch.Tensor, dec_len: int) -> None:
    """Section 4: who may attend to whom in an encoder, a decoder and cross-attention."""
    plt = _plt()
    enc_len = causal.shape[0]
    patterns = [
        ("encoder: bidirectional", torch.ones(enc_len, enc_len), "input token", "input token"),
        ("decoder: causal", causal.float(), "key", "query"),
        ("cross-attention", torch.ones(dec_len, enc_len), "encoder token (key)", "decoder token (query)"),
    ]
    fig, axes = plt.subplots(1, 3, figsize=(11, 3.3))
    for ax, (title, pattern, xlabel, ylabel) in zip(axes, patterns):
        ax.imshow(pattern, cmap="Blues", vmin=0, vmax=1.3)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel(xlabel, fontsize=8)
        ax.set_ylabel(ylabel, fontsize=8)
        ax.set_xticks(torch.arange(pattern.shape[1] + 1) - 0.5, [])  # one grid cell per (query, key)
        ax.set_yticks(torch.arange(pattern.shape[0] + 1) - 0.5, [])
        ax.grid(color="white", lw=1.5)
        ax.tick_params(length=0)
    fig.suptitle("who may attend to whom (dark = allowed)", y=1.02)
    plt.show()


def gqa_diagram(n_heads: int, n_kv_heads: int, head_dim: int, hidden: int) -> None:
    """Section 7: query heads in groups over their shared KV heads, from h to o_proj."""
    from matplotlib.patches import FancyBboxPatch

    plt = _plt()
    groups = n_heads // n_kv_heads
    colours = [f"C{j}" for j in range(n_kv_heads)]
    _, ax = plt.subplots(figsize=(12, 5.6))
    ax.set_xlim(-0.2, 12.4)
    ax.set_ylim(-1.3, 9.6)
    ax.axis("off")

    def box(x: float, y: float, w: float, h: float, text: str, colour: str = "white", alpha: float = 1.0) -> None:
        ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.02", fc=colour, ec="black", lw=0.8,
                                    alpha=alpha))
        ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=8)

    def arrow(x0: float, y0: float, x1: float, y1: float, colour: str = "gray") -> None:
        ax.annotate("", xy=(x1, y1), xytext=(x0, y0), arrowprops={"arrowstyle": "->", "color": colour, "lw": 1})

    box(0, 3.2, 1.4, 2.6, f"h\n[seq, {hidden}]", "whitesmoke")
    row_y = [8.4 - 0.95 * i for i in range(n_heads)]  # one row per query head
    for i, y in enumerate(row_y):
        box(2.6, y, 1.6, 0.75, f"q head {i}  ({head_dim})", colours[i // groups], alpha=0.35)
        box(8.6, y, 1.6, 0.75, f"out head {i}  ({head_dim})")
    for j in range(n_kv_heads):
        top, bottom = row_y[j * groups], row_y[(j + 1) * groups - 1]
        box(5.4, bottom + 0.1, 1.9, top - bottom + 0.55, f"KV head {j}\nk ({head_dim}) + v ({head_dim})\n"
            "stored in the cache", colours[j])
        for i in range(j * groups, (j + 1) * groups):
            arrow(4.2, row_y[i] + 0.37, 5.4, (top + bottom) / 2 + 0.37, colours[j])
            arrow(7.3, (top + bottom) / 2 + 0.37, 8.6, row_y[i] + 0.37, colours[j])
    arrow(1.4, 4.5, 2.55, 4.5)
    ax.text(1.45, 5.0, f"q_proj\n{hidden} → {n_heads}×{head_dim}", fontsize=7)
    ax.plot([0.7, 0.7, 6.35], [3.2, 0.25, 0.25], color="gray", lw=1)  # under the query heads, to the KV heads
    arrow(6.35, 0.25, 6.35, row_y[-1] + 0.1)
    ax.text(3.0, -0.05, f"k_proj, v_proj: {hidden} → {n_kv_heads} × {head_dim} each", fontsize=8)
    box(10.7, 3.2, 1.5, 2.6, f"concat\n{n_heads} × {head_dim} = {n_heads * head_dim}\n→ o_proj\n[seq, {hidden}]",
        "whitesmoke")
    for y in row_y:
        arrow(10.2, y + 0.37, 10.7, 4.5)
    shares = "; ".join(f"{', '.join(str(i) for i in range(j * groups, (j + 1) * groups))} share KV head {j}"
                       for j in range(n_kv_heads))
    ax.text(6.35, -1.0, f"query heads {shares}  (q head h reads KV head h // {groups})", ha="center", fontsize=9)
    ax.set_title(f"one attention layer of SmolLM2: {n_heads} query heads in {n_kv_heads} groups over "
                 f"{n_kv_heads} KV heads", fontsize=11)
    plt.show()


def cache_share(context: torch.Tensor, kv_bytes: dict[str, int], weight_bytes: int, max_positions: int) -> None:
    """Section 7: the share of a decode step's bytes that is KV cache, by context length and batch."""
    plt = _plt()
    _, ax = plt.subplots(figsize=(6.5, 3.4))
    for b, colour in [(1, "C0"), (8, "C1"), (64, "C2")]:
        for (name, per_token), style in zip(kv_bytes.items(), ["-", ":"]):
            kv = b * context * per_token
            ax.plot(context, kv / (kv + weight_bytes), style, color=colour, label=f"batch {b}, {name}")
    ax.axhline(0.5, color="k", lw=0.5)
    ax.axvline(max_positions, color="r", lw=0.8, ls="--", label="SmolLM2's context")
    ax.set_xlabel("tokens in each sequence's cache")
    ax.set_ylabel("share of bytes read that is cache")
    ax.set_title("a decode step reads weights once, caches per sequence")
    ax.legend(fontsize=7, ncol=2)
    plt.show()
