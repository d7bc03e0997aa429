"""How the benchmarks time things: peers taking turns in rounds, on ``torch.utils.benchmark``.

Speed goals are ratios against a peer measured in the same run. The peers take turns
(A, B, A, B, ...) rather than all of A then all of B, so a slow spell of a shared machine hits
both alike; each side's calls are one ``Measurement``, whose times give the best and the range.

``Timer.timeit`` and ``blocked_autorange`` run untimed warm-up calls before every measurement:
right for a small kernel, ruinous for a round that generates 128 tokens (three calls for one).
Here the rounds are the warm-up, so each call is timed once with the clock ``Timer`` uses
(``torch.utils.benchmark.timer``: it synchronizes the accelerator before reading the time).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.benchmark import Measurement, timer
from torch.utils.benchmark.utils.common import TaskSpec

BANDWIDTH_BYTES = 512 * 2**20


def interleaved(fns: dict[str, Callable[[], Any]], repeats: int) -> dict[str, Measurement]:
    """``repeats`` rounds, each calling every function once in turn; one ``Measurement`` per name."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = timer()
            fn()
            times[name].append(timer() - start)
    threads = torch.get_num_threads()
    return {name: Measurement(number_per_run=1, raw_times=seconds,
                              task_spec=TaskSpec(stmt=f"{name}()", setup="", label=name, num_threads=threads))
            for name, seconds in times.items()}


def interleaved_best(fns: dict[str, Callable[[], Any]], repeats: int) -> dict[str, float]:
    """The fastest time of each function over ``repeats`` rounds, the functions taking turns."""
    return {name: min(m.times) for name, m in interleaved(fns, repeats).items()}


def best_time(fn: Callable[[], Any], repeats: int = 3) -> float:
    """The fastest of ``repeats`` wall-clock timings of ``fn()``, in seconds."""
    return interleaved_best({"fn": fn}, repeats)["fn"]


def value_range(values: Sequence[float | None], best: Callable[[list[float]], float]) -> dict[str, float | None]:
    """``best`` (``min`` or ``max``) of the values present, and their range; all None if none is."""
    present = [v for v in values if v is not None]
    if not present:
        return {"best": None, "min": None, "max": None}
    return {"best": best(present), "min": min(present), "max": max(present)}


def ratio_range(ours: Sequence[float | None], theirs: Sequence[float | None]) -> tuple[float, float] | None:
    """The lowest and highest of ``ours[i] / theirs[i]``: a ratio taken round by round, each
    round's two runs being neighbours in time (rounds with a missing or zero value skipped)."""
    ratios = [a / b for a, b in zip(ours, theirs) if a is not None and b]
    return (min(ratios), max(ratios)) if ratios else None


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100), interpolated linearly between the nearest ranks."""
    return float(np.percentile(np.asarray(values, dtype=np.float64), q))


def bandwidth_reader(device: torch.device, nbytes: int = BANDWIDTH_BYTES) -> Callable[[], None]:
    """A function that reads ``nbytes`` once, by summing a buffer that size (a STREAM-like read).

    Its best time gives the bandwidth the roofline divides by: a measured proxy, not the
    datasheet, so a decode step streaming its weights at the machine's best can read slightly
    faster than this one ``sum`` (a roofline fraction just above 100%).
    """
    buffer = torch.ones(nbytes // 4, dtype=torch.float32, device=device)

    def read() -> None:
        buffer.sum()
        if device.type == "cuda":
            torch.cuda.synchronize()

    return read
