"""Notebook 07's figures (the KV cache): time per token, the decode step's bytes, memory budgets.

Each function takes what the notebook computed and shows one figure; matplotlib is imported when
a function draws, not when this module is imported.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from minillm.cache import memory_budget

GiB = 2**30
GPUS = ((24, ":"), (80, "--"))  # two common GPU sizes (GiB) and their line styles


def time_per_token(lengths: Sequence[int], recompute_times: Sequence[float], cached_times: Sequence[float]) -> None:
    """Left: seconds per step of the recompute and the cached loops against the sequence length
    (the cached loop's first step is its prefill). Right: the running total."""
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 3.8))
    ax1.plot(lengths, [1e3 * t for t in recompute_times], ".-", label="full recompute")
    ax1.plot(lengths[1:], [1e3 * t for t in cached_times[1:]], ".-", label="KV cache (decode)")
    ax1.plot(lengths[0], 1e3 * cached_times[0], "s", color="C1", label="KV cache (prefill)")
    ax1.set(xlabel="tokens in the sequence", ylabel="ms per step", title="time per generated token", ylim=(0, None))
    ax1.legend()
    n = len(recompute_times)
    ax2.plot(range(1, n + 1), torch.tensor(recompute_times).cumsum(0), label="full recompute")
    ax2.plot(range(1, len(cached_times) + 1), torch.tensor(cached_times).cumsum(0), label="KV cache")
    ax2.set(xlabel="tokens generated", ylabel="seconds", title="total time")
    ax2.legend()
    fig.tight_layout()
    plt.show()


def decode_bytes_and_time(weights: int, kv_per_token: int, crossover: float, probe_lengths: Sequence[int],
                          probe_ms: Sequence[float], intercept: float, slope: float, context: int = 8192) -> None:
    """Left: the bytes model of a decode step (fp32): the weights, read once, against the K/V of
    batches of 1, 4 and 16 sequences, with their crossovers. Right: the measured step time
    against the cached length, and its least-squares line ``intercept + slope * t`` (ms)."""
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 3.8))
    ts = torch.arange(0, context + 1, 256)
    weights_mb = weights * 4 / 1e6
    top = 2.2 * weights_mb
    ax1.axhline(weights_mb, color="k", lw=1)
    ax1.text(context, weights_mb, "weights, read once per step ", ha="right", va="bottom", fontsize=8)
    for batch, color in ((1, "C0"), (4, "C1"), (16, "C2")):
        kv_mb = batch * kv_per_token * 4 / 1e6  # per cached token
        ax1.plot(ts, kv_mb * ts, color=color)
        end = min(context, top / kv_mb)
        inside = end < context
        ax1.text(end * (0.9 if inside else 1), kv_mb * end * (0.97 if inside else 1), f" K/V, batch {batch} ",
                 color=color, fontsize=8, ha="right" if inside else "left", va="top" if inside else "center")
        if crossover / batch <= context:
            ax1.plot(crossover / batch, weights_mb, "o", color=color)
            ax1.annotate(f"{crossover / batch:,.0f}", (crossover / batch, weights_mb), textcoords="offset points",
                         xytext=(6, -12), color=color, fontsize=8)
    ax1.set(xlabel="cached tokens per sequence (t)", ylabel="MB read per decode step (fp32)", xlim=(0, 1.22 * context),
            title=f"the bytes model (batch 1 crosses at {crossover:,.0f}, off the chart)", ylim=(0, top))
    ax2.plot(probe_lengths, probe_ms, "o", label="measured (best of 3)")
    ax2.plot(ts, intercept + slope * ts, "--", label=f"{intercept:.0f} ms + {1e3 * slope:.1f} µs per cached token")
    ax2.set(xlabel="cached tokens (t)", ylabel="ms per decode step", title="this machine, batch 1", ylim=(0, None))
    ax2.legend(fontsize=8)
    fig.tight_layout()
    plt.show()


def kv_outgrows_gpu(config: Any, name: str, dtype: torch.dtype = torch.bfloat16) -> None:
    """The KV cache (GiB) against the context for batches of 1 to 64, and what a 24 and an 80 GiB
    GPU have left once the weights are loaded (log-log)."""
    import matplotlib.pyplot as plt

    contexts = [2**k for k in range(10, 18)]
    weights = memory_budget(config, 1, 1, dtype).weights
    _, ax = plt.subplots(figsize=(7, 4))
    for batch in (1, 4, 16, 64):
        ax.plot(contexts, [memory_budget(config, batch, n, dtype).kv_cache / GiB for n in contexts],
                "o-", label=f"batch {batch}")
    for gpu, style in GPUS:
        ax.axhline(gpu - weights / GiB, color="k", ls=style, lw=1, label=f"{gpu} GiB GPU minus weights")
    ax.set(xscale="log", yscale="log", xlabel="context (tokens per sequence)", ylabel="KV cache, GiB",
           title=f"{name}, {str(dtype).removeprefix('torch.')}: the KV cache outgrows the GPU")
    ax.set_xticks(contexts, [f"{n // 1024}k" for n in contexts])
    ax.legend(fontsize=8)
    plt.show()


def budget_bar(config: Any, name: str, dtype_name: str, dtype: torch.dtype, batch: int, context: int) -> Any:
    """One bar: the weights plus the KV cache of ``batch`` x ``context`` tokens, against two GPU
    sizes. Returns the figure (for the notebook's widget), not shown."""
    import matplotlib.pyplot as plt

    budget = memory_budget(config, batch, context, dtype)
    fig, ax = plt.subplots(figsize=(8, 1.9))
    ax.barh([0], [budget.weights / GiB], color="C0", label="weights")
    ax.barh([0], [budget.kv_cache / GiB], left=[budget.weights / GiB], color="C3", label="KV cache")
    for gpu, style in GPUS:
        ax.axvline(gpu, color="k", ls=style, lw=1)
        ax.text(gpu, -0.48, f" {gpu} GiB GPU", fontsize=8, va="bottom")
    ax.set(yticks=[], xlabel="GiB", xlim=(0, max(100, 1.05 * budget.total / GiB)), ylim=(-0.5, 0.5))
    limit = config.max_position_embeddings
    note = "" if context <= limit else f" — past its {limit}-token context!"
    ax.set_title(f"{name}, {dtype_name}, {batch} x {context} tokens: {budget.total / GiB:.1f} GiB{note}", fontsize=10)
    ax.legend(loc="upper right", fontsize=8)
    plt.close(fig)  # shown by whoever asked for it, once
    return fig
