"""The notebooks teach: short enough for a workshop slot, no development log, no typed-in measurements.

nbval (``make test``) proves each notebook runs and that its marked cells reproduce; these
tests hold the rules nbval cannot see. A notebook is a lesson a learner reads with its stored
outputs beside the prose, so

* it fits a 45-minute workshop slot: at most ``MAX_CELLS`` cells;
* it carries no optimisation history: no recorded "before" timings, no targets printed to the
  learner (those belong in commit messages and docs/benchmarks.md);
* a speed or a time in the prose comes from the run (a printed f-string, or a Markdown output
  built from live values), never typed into a Markdown cell, where it goes stale the first time
  the notebook runs on another machine;
* it opens with the ``python3`` kernel that nbval and JupyterLab start.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

NOTEBOOKS = sorted((Path(__file__).resolve().parents[2] / "notebooks").glob("[0-9][0-9]_*.ipynb"))
MAX_CELLS = 80

# Development-log vocabulary: a dictionary of recorded earlier timings, "before" entries, goals.
LOG_WORDS = re.compile(r"\bRECORDED\b|\bbefore_\w+|(?i:\bgoal:\s*[<>]=?)")
# A number followed by a unit only a measurement produces.
TYPED_TIMING = re.compile(
    r"\d\s*(µs|us|ms|tok/s|tokens/s|tokens per second|[KMG]i?B/s)(?![\w/])", re.IGNORECASE
)


def _cells(path: Path) -> list[dict]:
    return json.loads(path.read_text(encoding="utf-8"))["cells"]


def _text(cell: dict) -> str:
    source = cell["source"]
    return source if isinstance(source, str) else "".join(source)


def _outputs_text(cell: dict) -> str:
    parts = []
    for output in cell.get("outputs", []):
        text = output.get("text") or output.get("data", {}).get("text/plain", "")
        parts.append(text if isinstance(text, str) else "".join(text))
    return "".join(parts)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_fits_a_workshop_slot(path: Path) -> None:
    n = len(_cells(path))
    assert n <= MAX_CELLS, f"{path.name} has {n} cells; a lesson has at most {MAX_CELLS}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_no_development_log(path: Path) -> None:
    found = [
        f"cell {i}: {m.group(0)!r}"
        for i, cell in enumerate(_cells(path))
        for m in LOG_WORDS.finditer(_text(cell) + _outputs_text(cell))
    ]
    assert not found, f"{path.name} carries development history: {found}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_no_timing_typed_into_prose(path: Path) -> None:
    found = [
        f"cell {i}: {_text(cell)[max(0, m.start() - 40):m.end()]!r}"
        for i, cell in enumerate(_cells(path))
        if cell["cell_type"] == "markdown"
        for m in TYPED_TIMING.finditer(_text(cell))
    ]
    assert not found, f"{path.name}: print measured times and speeds from the run instead: {found}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_python3_kernel(path: Path) -> None:
    spec = json.loads(path.read_text(encoding="utf-8"))["metadata"]["kernelspec"]
    assert spec["name"] == "python3", f"{path.name} asks for kernel {spec['name']!r}"
