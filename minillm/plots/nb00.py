"""Drawing helpers of notebook 00 (overview). matplotlib is imported inside each function."""

from __future__ import annotations


def top_candidates(labels: list[str], probs: list[float], title: str) -> None:
    """The top next-token candidates as horizontal bars, the argmax (what greedy picks) in orange."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 2.2))
    colors = ["tab:orange"] + ["tab:blue"] * (len(labels) - 1)
    ax.barh(labels[::-1], probs[::-1], color=colors[::-1])
    ax.set_xlabel("probability of the next token")
    ax.set_title(title, fontsize=9)
    plt.tight_layout()
    plt.show()


def rates(rates: dict[str, float]) -> None:
    """Generated tokens per second of a few ways to run the model, as labelled bars."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 2.2))
    bars = ax.barh(list(rates), list(rates.values()), color=["0.6", "C0", "C2"][: len(rates)])
    ax.bar_label(bars, [f"{r:.0f} tok/s" for r in rates.values()], padding=3, fontsize=8)
    ax.set(xlabel="generated tokens per second", xlim=(0, max(rates.values()) * 1.3))
    ax.invert_yaxis()
    fig.tight_layout()
    plt.show()
