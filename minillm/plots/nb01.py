"""Drawing helpers of notebook 01 (BPE from scratch): trainer timings and coloured tokens.

Each function takes what the notebook computed and draws it. matplotlib is imported inside the
functions that draw with it.
"""

from __future__ import annotations

import html
import itertools
import statistics
from collections.abc import Sequence

COLOURS = ["#fde2e4", "#d7eef7", "#e2f0cb", "#fff1c1", "#e8dff5"]


def _rolling_median(values: Sequence[float], window: int = 15) -> list[float]:
    half = window // 2
    return [statistics.median(values[max(0, k - half): k + half + 1]) for k in range(len(values))]


def trainer_timings(naive_seconds: Sequence[float], incr_seconds: Sequence[float], title: str) -> None:
    """Each merge's time (thin, log scale) with its rolling median, and the cumulative time."""
    import matplotlib.pyplot as plt

    fig, (per_merge, total) = plt.subplots(1, 2, figsize=(11, 3.6), dpi=80)
    for seconds, label, color in [(naive_seconds, "naive: recount every pair", "C0"),
                                  (incr_seconds, "incremental: index + heap", "C1")]:
        ms = [1000 * s for s in seconds]
        per_merge.semilogy(ms, color=color, lw=0.7, alpha=0.35)
        per_merge.semilogy(_rolling_median(ms), color=color, lw=2, label=label)
        total.plot(list(itertools.accumulate(seconds)), color=color, lw=2, label=label)
    per_merge.set(xlabel="merge number", ylabel="ms per merge (log)", title="each merge (thin) and its rolling median of 15")
    total.set(xlabel="merge number", ylabel="seconds since the first merge", title="cumulative time")
    per_merge.legend()
    total.legend()
    fig.suptitle(title)
    plt.tight_layout()
    plt.show()


def token_html(pieces: Sequence[tuple[int, bytes]], caption: str) -> str:
    """One line of coloured tokens (hover for the id) under a caption; bytes of a split character as \\x.."""
    spans = []
    for k, (i, data) in enumerate(pieces):
        piece = html.escape(data.decode("utf-8", errors="backslashreplace")).replace("\n", "↵<br>")
        spans.append(f'<span title="id {i}" style="background:{COLOURS[k % len(COLOURS)]};'
                     f'color:#000;white-space:pre;font-family:monospace">{piece}</span>')
    return f'<div style="line-height:1.8">{caption}<br>{"".join(spans)}</div>'
