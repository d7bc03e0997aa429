"""The course in JupyterLab in headless Chromium: tests/browser/check_lab.py as a test.

Opt-in (MINILLM_LAB_BROWSER=1), because it opens every widget notebook with its own kernel and
runs notebook 01 (about 2-3 min on 2 busy cores); skipped with the reason when Playwright's
Python client or a Chromium is missing. Screenshots go to $MINILLM_LAB_SHOTS (/tmp/lab_shots).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parents[1] / "browser" / "check_lab.py"
_spec = importlib.util.spec_from_file_location("check_lab", SCRIPT)
check_lab = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(check_lab)


def test_widgets_render_on_first_open_and_run_all_in_chromium():
    why = check_lab.unavailable()
    if why:
        pytest.skip(f"browser check: {why}")
    if os.environ.get("MINILLM_LAB_BROWSER") != "1":
        pytest.skip("browser check is opt-in (~2-3 min): MINILLM_LAB_BROWSER=1, "
                    "or run python tests/browser/check_lab.py")
    proc = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]


# --------------------------------------------------------------------------- make lab as root
REPO = Path(__file__).parents[2]


def _lab_command(*run_as: str) -> str | None:
    """The `jupyter lab` line `make lab` would run (make -n: printed, nothing run), as this user
    or, with run_as, as another (setpriv); None when that other user cannot read the checkout."""
    proc = subprocess.run([*run_as, "make", "-n", "-C", str(REPO), "lab", "PYTHON=python"],
                          capture_output=True, text=True, timeout=60)
    if run_as and proc.returncode != 0:
        return None
    assert proc.returncode == 0, proc.stderr
    return next(line for line in proc.stdout.splitlines() if "jupyter lab" in line)


@pytest.mark.skipif(shutil.which("make") is None, reason="no make")
def test_make_lab_allows_root_only_when_run_as_root():
    """JupyterLab exits at once when started as root without --allow-root (containers, workshop
    VMs); a normal user's command line stays as it was."""
    as_root = os.geteuid() == 0
    assert ("--allow-root" in _lab_command()) == as_root
    if as_root and shutil.which("setpriv"):  # root can also try it as a normal user (nobody)
        as_nobody = _lab_command("setpriv", "--reuid=65534", "--regid=65534", "--clear-groups")
        assert as_nobody is None or "--allow-root" not in as_nobody
