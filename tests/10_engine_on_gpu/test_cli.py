"""The command line: ``python -m minillm demo`` runs end to end; a bad command fails cleanly."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def run_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONIOENCODING": "utf-8"}
    return subprocess.run(
        [sys.executable, "-m", "minillm", *args],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        encoding="utf-8",
        timeout=timeout,
    )


def test_demo_streams_a_real_answer_and_reports_speed():
    result = run_cli("demo", timeout=900)  # a cold compile of the decode step takes minutes on 2 cores
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "validate(): all three checks ok" in out
    answer = out.split("assistant> ", 1)[1].splitlines()[0]
    assert answer.startswith("The capital of France is Paris"), out
    assert "tokens/s, batch 1" in out and "continuous batching, 4 sampled requests" in out
    assert "\ufffd" not in out


def test_unknown_command_exits_non_zero():
    result = run_cli("bogus", timeout=60)
    assert result.returncode != 0
    assert "bogus" in result.stderr


def test_no_command_exits_non_zero():
    result = run_cli(timeout=60)
    assert result.returncode != 0
