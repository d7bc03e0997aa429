"""Notebook 10's figures: the batching timeline, throughput and latency under load, the roofline,
and decode speed against batch size and context. Each takes what the notebook measured."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


def _plt() -> Any:
    import matplotlib.pyplot as plt

    return plt


def batching_timeline(events: Sequence[tuple[int, int]], passes: Sequence[tuple[str, int]],
                      new_tokens: Sequence[int], max_running: int) -> None:
    """One line per request, a tick per token it got from a forward (``events``: (request, forward));
    below, how many rows each forward ran (``passes``: the runner's trace)."""
    plt = _plt()
    fig, (ax, ax_rows) = plt.subplots(2, 1, figsize=(11, 4.6), sharex=True, gridspec_kw={"height_ratios": [3, 1]})
    for i in range(len(new_tokens)):
        steps = [f for r, f in events if r == i]
        prefill, decode = steps[0], steps[1:]
        ax.plot([prefill, steps[-1]], [i, i], color="0.85", lw=7, zorder=0, solid_capstyle="butt")
        ax.scatter(decode, [i] * len(decode), marker="|", s=60, color=f"C{i}")
        ax.scatter([prefill], [i], marker=">", s=60, color="k", zorder=3, label="prefill (joins)" if i == 0 else None)
        ax.scatter([steps[-1]], [i], marker="x", s=40, color="C3", zorder=3, label="last token (leaves)" if i == 0 else None)
    ax.set_yticks(range(len(new_tokens)), [f"{i}: {n} tok" for i, n in enumerate(new_tokens)], fontsize=8)
    ax.invert_yaxis()
    ax.set(ylabel="request")
    ax.set_title(f"continuous batching, max {max_running} running: each | is a token a batched decode step "
                 "produced for that request", fontsize=9)
    ax.legend(loc="lower right", fontsize=8)
    ax_rows.bar(range(len(passes)), [rows if kind == "decode" else 0 for kind, rows in passes], width=1.0,
                color="C0", label="decode rows")
    ax_rows.bar(range(len(passes)), [1 if kind == "prefill" else 0 for kind, _ in passes], width=1.0, color="k",
                label="prefill")
    ax_rows.set(xlabel="forward #", ylabel="rows", yticks=range(0, max_running + 1, 2))
    ax_rows.legend(loc="upper right", fontsize=7, ncol=2)
    fig.tight_layout()
    plt.show()


def throughput_bars(rates: Mapping[str, float], title: str) -> None:
    """Tokens per second of each way of serving the same requests, and the ratio to the first."""
    plt = _plt()
    labels, values = list(rates), list(rates.values())
    fig, ax = plt.subplots(figsize=(7, 3))
    bars = ax.barh(labels, values, color=["0.6", "C0", "C2"][: len(values)])
    ax.bar_label(bars, [f"{v:.0f} tok/s ({v / values[0]:.1f}x)" for v in values], padding=3, fontsize=8)
    ax.set(xlabel="generated tokens per second (all requests together)", xlim=(0, max(values) * 1.35))
    ax.invert_yaxis()
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    plt.show()


def latency_under_load(load: Mapping[tuple[float, str], Mapping[str, float]], rates: Sequence[float],
                       servers: Sequence[str], title: str) -> None:
    """TTFT and TPOT, p50 and p99, against the arrival rate, one colour per server."""
    plt = _plt()
    fig, (ax_ttft, ax_tpot) = plt.subplots(1, 2, figsize=(11, 3.4))
    for k, name in enumerate(servers):
        for ax, metric in ((ax_ttft, "ttft"), (ax_tpot, "tpot")):
            ax.plot(rates, [load[r, name][f"{metric}_p50_ms"] for r in rates], "o-", color=f"C{k}", label=f"{name}, p50")
            ax.plot(rates, [load[r, name][f"{metric}_p99_ms"] for r in rates], "s--", color=f"C{k}", label=f"{name}, p99")
    ax_ttft.set(xlabel="arrival rate (requests/s)", ylabel="ms (log scale)", yscale="log", xticks=rates,
                title="time to first token")
    ax_tpot.set(xlabel="arrival rate (requests/s)", ylabel="ms", xticks=rates, ylim=(0, None),
                title="time per output token")
    ax_ttft.legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    plt.show()


def roofline(points: Mapping[str, tuple[float, float, str]], bandwidth: float, compute_roof: float,
             decode_bytes_s: Mapping[str, float], title: str) -> None:
    """Left: the roofline — min(bandwidth × intensity, compute_roof), one bandwidth for every point —
    with each workload at (flops per byte, flop/s). Right: the weight bytes per second each batch-1
    decoder streams (``decode_bytes_s``), against the same bandwidth."""
    import numpy as np

    plt = _plt()
    fig, (ax, ax_bw) = plt.subplots(1, 2, figsize=(12, 4), gridspec_kw={"width_ratios": [1.6, 1]})
    x = np.logspace(-1.3, 3, 200)
    ax.plot(x, np.minimum(bandwidth * x, compute_roof), color="k", lw=2)
    ax.text(0.06, compute_roof * 0.5, f"memory roof: {bandwidth / 1e9:.0f} GB/s × intensity", fontsize=8)
    ax.text(900, compute_roof * 1.2, "compute roof: best measured (prefill), not the peak", fontsize=8, ha="right")
    for i, (name, (xi, yi, marker)) in enumerate(points.items()):
        hollow = "transformers" in name  # so that minillm's point shows through when they overlap
        ax.scatter([xi], [yi], marker=marker, s=70 if hollow else 50, label=name, zorder=3, linewidths=1.5,
                   facecolors="none" if hollow else f"C{i}", edgecolors=f"C{i}")
    ax.axvline(compute_roof / bandwidth, color="0.7", ls=":", lw=1)
    ax.set(xscale="log", yscale="log", xlabel="arithmetic intensity (flops per byte of weights)",
           ylabel="achieved FLOP/s", ylim=(compute_roof / 3000, compute_roof * 3))
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7, loc="lower right")
    ax.grid(alpha=0.3, which="both")
    bars = ax_bw.bar(list(decode_bytes_s), [v / 1e9 for v in decode_bytes_s.values()], color=["C0", "C1", "C2"])
    ax_bw.bar_label(bars, [f"{v / bandwidth:.0%}" for v in decode_bytes_s.values()], fontsize=8)
    ax_bw.axhline(bandwidth / 1e9, color="k", lw=2, label=f"measured bandwidth {bandwidth / 1e9:.1f} GB/s")
    ax_bw.set(ylabel="weight bytes read per second (GB/s)", ylim=(0, bandwidth / 1e9 * 1.25))
    ax_bw.set_title("decode at batch 1: tokens/s × weight bytes", fontsize=9)
    ax_bw.legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    plt.show()


def batch_sweep(sweep: Mapping[int, tuple[float, float]], title: str) -> None:
    """Decode tokens/s and step time against the rows per step (``sweep``: rows -> (step s, tok/s))."""
    plt = _plt()
    sizes = list(sweep)
    fig, (ax_tok, ax_step) = plt.subplots(1, 2, figsize=(11, 3.2))
    ax_tok.plot(sizes, [tok_s for _, tok_s in sweep.values()], "o-", label="measured")
    ax_tok.plot(sizes, [b * sweep[sizes[0]][1] / sizes[0] for b in sizes], ":", color="0.5",
                label="if a step cost the same at any batch")
    ax_tok.set(xlabel="rows per decode step", ylabel="tokens/s", xscale="log", xticks=sizes, xticklabels=sizes,
               ylim=(0, max(tok_s for _, tok_s in sweep.values()) * 1.6), title="decode throughput")
    ax_tok.legend(fontsize=8)
    ax_step.plot(sizes, [1000 * step_s for step_s, _ in sweep.values()], "o-", color="C1")
    ax_step.set(xlabel="rows per decode step", ylabel="ms", xscale="log", xticks=sizes, xticklabels=sizes,
                ylim=(0, None), title="time of one decode step")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    plt.show()


def decode_vs_context(rows: Sequence[Mapping[str, float]], bandwidth: float, title: str) -> None:
    """Measured decode step time against the context, and the roofline of the bytes a step reads
    (weights + every row's K and V) at ONE bandwidth, so each roofline line rises with the context."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7.5, 3.4))
    for k, batch in enumerate(sorted({int(row["batch"]) for row in rows})):
        mine = [row for row in rows if row["batch"] == batch]
        contexts = [row["context"] for row in mine]
        ax.plot(contexts, [row["step_ms"] for row in mine], "o-", color=f"C{k}", label=f"batch {batch}, measured")
        ax.plot(contexts, [1000 * (row["weight_bytes"] + row["kv_bytes"]) / bandwidth for row in mine], ":",
                color=f"C{k}", label=f"batch {batch}, roofline: bytes read / {bandwidth / 1e9:.0f} GB/s")
    ax.set(xlabel="context length (tokens per row)", ylabel="ms per decode step", ylim=(0, None))
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    plt.show()
