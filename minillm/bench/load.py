"""``bench load``: how long ``load_model()`` takes once the default model is converted."""

from __future__ import annotations

import argparse
from typing import Any

from minillm.bench.timing import best_time


def run(args: argparse.Namespace) -> dict[str, Any]:
    return bench_load()


def bench_load() -> dict[str, Any]:
    """Seconds for ``load_model()`` once the default model is converted (best of 3, fresh process state)."""
    from minillm.model import load_model

    load_model()  # make sure the conversion is done
    return {"load_s": best_time(lambda: load_model(device="cpu"))}


def print_load_report(r: dict[str, Any]) -> None:
    print(f"load_model() after conversion: {r['load_s']:.2f} s")
