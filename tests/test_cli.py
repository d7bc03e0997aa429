"""The command line: ``python -m minillm demo`` runs end to end; a bad command fails cleanly."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent


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


def test_demo_exits_zero_and_streams_the_text():
    result = run_cli("demo")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    # The streamed line joins the pieces with '|': without the bars it is the sentence itself.
    streamed = [line.strip() for line in out.splitlines() if line.count("|") >= 3]
    joined = [line.replace("|", "") for line in streamed]
    assert any("苹果手机很好用" in line and "👋🏽" in line for line in joined), out
    assert "\ufffd" not in out
    assert "joined == decode(ids): True" in out


def test_unknown_command_exits_non_zero():
    result = run_cli("bogus", timeout=60)
    assert result.returncode != 0
    assert "bogus" in result.stderr


def test_no_command_exits_non_zero():
    result = run_cli(timeout=60)
    assert result.returncode != 0
