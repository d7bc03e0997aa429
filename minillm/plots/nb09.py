"""Notebook 09's figures (sampling): bars of a next-token distribution before and after a
processor, the top-p walk, filters against temperature, entropy against temperature, seeded
draws against their distribution, the beam-search tree and the EOS probability along an answer.

Each function takes what the notebook computed (probabilities, token labels) and shows the
figure; none of them computes anything the lesson depends on. ``label`` turns a token id into its
text. ``filtered`` returns its figure instead, for the explorer to display and replace.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

Label = Callable[[int], str]


def _plt() -> Any:
    import matplotlib.pyplot as plt

    return plt


def bars(ax: Any, p: torch.Tensor, order: torch.Tensor, label: Label, title: str, highlight: Sequence[int] = (),
         color: str = "C0") -> None:
    """Probabilities ``p`` [vocab] of the tokens in ``order`` as bars; removed tokens are empty slots."""
    values = p[order].tolist()
    ax.bar(range(len(order)), values, color=["C3" if int(i) in highlight else color for i in order])
    ax.set_xticks(range(len(order)), [label(int(i)) for i in order], rotation=70, fontsize=7)
    ax.set_title(title, fontsize=9)
    ax.text(0.98, 0.95, f"{int((p > 0).sum()):,} tokens can be drawn", transform=ax.transAxes, ha="right",
            va="top", fontsize=8)


def panels(rows: Sequence[tuple[torch.Tensor, str]], order: torch.Tensor, label: Label, highlight: Sequence[int] = (),
           width: float = 12) -> None:
    """One bar panel per ``(probabilities [vocab], title)``, side by side on a shared y axis; the
    first panel in blue, the others (processed) in green."""
    plt = _plt()
    fig, axes = plt.subplots(1, len(rows), figsize=(width, 3), sharey=True, squeeze=False)
    for j, (ax, (p, title)) in enumerate(zip(axes[0], rows)):
        bars(ax, p, order, label, title, highlight, color="C0" if j == 0 else "C2")
    axes[0, 0].set_ylabel("probability")
    fig.tight_layout()
    _plt().show()


def long_tail(probs: torch.Tensor, order: torch.Tensor, label: Label, title: str) -> None:
    """The top tokens' bars beside the cumulative probability of all tokens, most likely first."""
    plt = _plt()
    cum = probs.sort(descending=True).values.cumsum(0)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 3.2), gridspec_kw={"width_ratios": [1.4, 1]})
    bars(ax1, probs, order, label, title)
    ax1.set_ylabel("probability")
    ax2.plot(range(1, len(cum) + 1), cum.tolist())
    ax2.set(xscale="log", xlabel="tokens, most likely first", ylabel="cumulative probability")
    ax2.set_title("the long tail: mass still missing after the top k", fontsize=9)
    ax2.grid(alpha=0.3)
    fig.tight_layout()
    _plt().show()


def entropy_vs_temperature(temps: Sequence[float], entropies: dict[str, list[float]], mark: float) -> None:
    """Entropy (nats) of each row's distribution against temperature, with a line at ``mark``."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 3))
    for name, values in entropies.items():
        ax.plot(temps, values, label=name)
    ax.axvline(mark, color="0.5", ls="--", lw=1)
    ax.text(mark, ax.get_ylim()[1] * 0.95, f" T = {mark}", color="0.4", va="top", fontsize=8)
    ax.set(xlabel="temperature", ylabel="entropy (nats)", title="entropy grows smoothly with T: no edge anywhere")
    ax.title.set_fontsize(9)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    _plt().show()


def top_p_walk(sorted_p: torch.Tensor, order: torch.Tensor, label: Label, p: float, crossing: int, n: int = 12) -> None:
    """The sorted probabilities as bars (kept green, the crossing token red, removed grey) with the running total."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8, 3))
    colors = ["C2" if j < crossing else "C3" if j == crossing else "0.7" for j in range(n)]
    ax.bar(range(n), sorted_p[:n].tolist(), color=colors, label="probability")
    ax.step(range(n), sorted_p.cumsum(0)[:n].tolist(), where="mid", color="k", label="running total")
    ax.axhline(p, color="C3", ls="--", lw=1)
    ax.text(n - 0.5, p + 0.02, f"p = {p}", color="C3", ha="right")
    ax.set_xticks(range(n), [label(int(i)) for i in order[:n]], rotation=60, fontsize=8)
    ax.set(ylabel="probability")
    ax.set_title("top-p: green kept, red = the crossing token (kept), grey removed", fontsize=9)
    ax.legend(loc="center right", fontsize=8)
    _plt().show()


def kept_vs_temperature(temps: Sequence[float], kept: dict[str, list[int]]) -> None:
    """How many tokens each filter leaves drawable, against the temperature applied before it."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.5, 3))
    for (name, values), marker in zip(kept.items(), "os^"):
        ax.plot(temps, values, f"{marker}-", label=name)
    ax.set(yscale="log", xlabel="temperature", ylabel="tokens that can be drawn", title="filtering after temperature")
    ax.legend()
    ax.grid(alpha=0.3)
    _plt().show()


def draws_vs_distribution(target: torch.Tensor, freq: torch.Tensor, n: int, label: Label, title: str) -> None:
    """The filtered distribution beside the frequencies of ``n`` draws (error bars: 2 standard errors)."""
    plt = _plt()
    support = target.nonzero()[:, 0]
    support = support[target[support].argsort(descending=True)]
    x = torch.arange(len(support)).float()
    fig, ax = plt.subplots(figsize=(8, 3))
    ax.bar(x - 0.2, target[support].tolist(), width=0.4, label="filtered distribution")
    err = 2 * (target[support] * (1 - target[support]) / n).sqrt()
    ax.bar(x + 0.2, freq[support].tolist(), width=0.4, yerr=err.tolist(), capsize=2, label=f"{n} seeded draws",
           color="C1")
    ax.set_xticks(x.tolist(), [label(int(i)) for i in support], rotation=45, fontsize=8)
    ax.set(ylabel="probability / frequency", title=title)
    ax.legend()
    _plt().show()


def filtered(raw: torch.Tensor, p: torch.Tensor, label: Label, title: str) -> Any:
    """The explorer's picture: the raw top 20 (grey) and what the sampler would draw from (green)."""
    plt = _plt()
    order = raw.topk(20).indices
    fig, ax = plt.subplots(figsize=(10, 3))
    ax.bar(range(20), raw[order].tolist(), color="0.8", label="raw")
    ax.bar(range(20), p[order].tolist(), width=0.5, color="C2", label="filtered")
    ax.set_xticks(range(20), [label(int(i)) for i in order], rotation=60, fontsize=8)
    ax.set(ylabel="probability", ylim=(0, 1.1 * max(float(raw.max()), float(p.max()))))
    ax.set_title(f"{title}: {int((p > 0).sum()):,} tokens can be drawn; mass outside the raw top 20: "
                 f"{1 - float(p[order].sum()):.3f}", fontsize=9)
    ax.legend(loc="upper right")
    plt.close(fig)  # the caller displays it (and replaces it when a slider moves)
    return fig


def beam_tree(tree: list[list[dict]], best: list[int], label: Label, title: str) -> None:
    """Each column a step, each node a candidate (token, cumulative log-prob) joined to the beam it
    extends: blue became beams, green finished hypotheses, grey dropped; the red path is the winner."""
    plt = _plt()
    colors = {"beam": "C0", "finished": "C2", "dropped": "0.6"}
    fig, ax = plt.subplots(figsize=(11, 4))
    ax.text(0, 0, "prompt", ha="center", va="center", fontsize=8, bbox=dict(fc="w", ec="k"))
    for step, candidates in enumerate(tree, start=1):
        for j, c in enumerate(candidates):
            c["xy"] = (step, (len(candidates) - 1) / 2 - j)
            px, py = c["parent_node"]["xy"] if c["parent_node"] else (0, 0.0)
            ax.plot([px, step], [py, c["xy"][1]], color=colors[c["status"]], lw=1, alpha=0.6, zorder=1)
            ax.text(*c["xy"], f"{label(c['token'])} {c['score']:.2f}", ha="center", va="center", fontsize=7,
                    color="0.45" if c["status"] == "dropped" else "k", bbox=dict(fc="w", ec=colors[c["status"]]))

    def tokens_of(c: dict) -> list[int]:
        return (tokens_of(c["parent_node"]) if c["parent_node"] else []) + [c["token"]]

    end = next(c for c in tree[len(best) - 1] if c["status"] == "finished" and tokens_of(c) == best)
    path = [end]
    while path[0]["parent_node"]:
        path.insert(0, path[0]["parent_node"])
    ax.plot([0] + [c["xy"][0] for c in path], [0.0] + [c["xy"][1] for c in path], color="C3", lw=6, alpha=0.25,
            zorder=0)
    ax.set(xlim=(-0.5, len(tree) + 0.6), xticks=range(len(tree) + 1), xlabel="step")
    ax.set_yticks([])
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)
    ax.set_title(title, fontsize=9)
    _plt().show()


def eos_curve(p_eos: Sequence[float], answer: Sequence[int], label: Label, threshold: float | None = None) -> None:
    """p(EOS) at each step of an answer (x: the token chosen at that step), with an optional threshold line."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(12, 3.2))
    ax.plot(range(len(p_eos)), list(p_eos), "o-", ms=3, color="C3")
    if threshold is not None:
        ax.axhline(threshold, color="0.5", ls="--", lw=1)
    ax.set_xticks(range(len(answer)), [label(int(i)) for i in answer], rotation=90, fontsize=7)
    ax.set(ylabel="p(<|im_end|>)", ylim=(0, 1.02))
    ax.set_title("the EOS probability at each step (x: the token chosen at that step)", fontsize=9)
    ax.grid(alpha=0.3)
    _plt().show()
