#!/usr/bin/env python
"""The course opened in JupyterLab in a real (headless) browser, as a learner meets it.

JupyterLab renders an output's `application/vnd.jupyter.widget-view+json` (a saved ipywidget)
only in a *trusted* notebook: ipywidgets registers that renderer as unsafe, and for an untrusted
output JupyterLab picks the best *safe* MIME type, the text/plain fallback
(`interactive(children=(IntSlider(...`). Trust is a signature in the user's Jupyter data dir,
so a fresh clone is untrusted for everyone; `make lab` runs `jupyter trust notebooks/*.ipynb`
before `jupyter lab`. This script does the same in a throwaway copy and checks, in Chromium:

1. before anything runs, each notebook with a saved widget shows at least one as a widget
   (a `.jupyter-widgets` element in that cell's output, not the text fallback);
2. opening a notebook does not modify it (the document is not dirty once its kernel is up and
   its widgets are drawn, and the file on disk is byte-identical after closing it);
3. for the notebooks in --run (default 01): Run All finishes with no error output, and moving
   one slider (or, in 02, typing into the text box) changes the widget's output.

It never writes the repository's files: the notebooks are copied into a temporary directory,
and Jupyter's config, data (trust database), runtime and settings directories are temporary too.

    python tests/browser/check_lab.py                      # the checks above, screenshots in /tmp/lab_shots
    python tests/browser/check_lab.py --run 01,04 --control # run two; also show the untrusted view first
    python tests/browser/check_lab.py --run all             # Run All in every widget notebook (minutes)

Needs Playwright's Python client (`pip install playwright`) and a Chromium (Debian:
`apt-get install chromium`; or MINILLM_CHROMIUM=/path/to/chrome). It does not use Playwright's
downloaded browsers. Exit status 0 when every check passes, 1 otherwise, 2 when it cannot run.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
NOTEBOOKS = REPO / "notebooks"
VIEW_MIME = "application/vnd.jupyter.widget-view+json"
STATE_MIME = "application/vnd.jupyter.widget-state+json"


def find_chromium() -> str | None:
    """A Chromium/Chrome binary: $MINILLM_CHROMIUM, else the first on PATH."""
    env = os.environ.get("MINILLM_CHROMIUM")
    if env:
        return env if Path(env).is_file() else None
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        path = shutil.which(name)
        if path:
            return path
    return None


def unavailable() -> str | None:
    """Why the check cannot run here, or None."""
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "Playwright's Python client is not installed (pip install playwright)"
    if find_chromium() is None:
        return "no Chromium found (apt-get install chromium, or set MINILLM_CHROMIUM)"
    try:
        import jupyterlab  # noqa: F401
        import jupyterlab_widgets  # noqa: F401
    except ImportError as e:
        return f"{e.name} is not installed"
    return None


def widget_cells(path: Path) -> list[int]:
    """Indexes of the code cells whose saved outputs include a widget view."""
    nb = json.loads(path.read_text(encoding="utf-8"))
    return [i for i, c in enumerate(nb["cells"])
            if any(VIEW_MIME in o.get("data", {}) for o in c.get("outputs", []))]


def widget_state_problems(path: Path) -> list[str]:
    """Views whose model (or a model they reference) has no saved state: those cannot render."""
    nb = json.loads(path.read_text(encoding="utf-8"))
    state = nb["metadata"].get("widgets", {}).get(STATE_MIME, {}).get("state", {})
    problems = []
    for i in widget_cells(path):
        for o in nb["cells"][i]["outputs"]:
            view = o.get("data", {}).get(VIEW_MIME)
            if view is None:
                continue
            todo, seen = [view["model_id"]], set()
            while todo:
                mid = todo.pop()
                if mid in seen:
                    continue
                seen.add(mid)
                if mid not in state:
                    problems.append(f"cell {i}: widget model {mid} has no saved state")
                    continue
                text = json.dumps(state[mid].get("state", {}))
                todo += [t.split('"')[0] for t in text.split("IPY_MODEL_")[1:]]
    return problems


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@contextlib.contextmanager
def jupyter_lab(root: Path, notebooks: Path, python: str, log):
    """`jupyter lab` on notebooks/, headless, token-protected, with every Jupyter dir under root."""
    env = dict(os.environ)
    for var, sub in [("JUPYTER_CONFIG_DIR", "config"), ("JUPYTER_DATA_DIR", "data"),
                     ("JUPYTER_RUNTIME_DIR", "runtime"), ("JUPYTERLAB_SETTINGS_DIR", "settings"),
                     ("JUPYTERLAB_WORKSPACES_DIR", "workspaces"), ("IPYTHONDIR", "ipython")]:
        env[var] = str(root / sub)
        (root / sub).mkdir(parents=True, exist_ok=True)
    # The kernels import this checkout's minillm (as `make lab` does with its editable install).
    env["PYTHONPATH"] = os.pathsep.join(p for p in [str(REPO), env.get("PYTHONPATH", "")] if p)
    env.pop("JUPYTER_PATH", None)
    # No news prompt; no autosave (a document made dirty must not reach the disk behind our back).
    (root / "config/labconfig").mkdir(parents=True, exist_ok=True)
    (root / "config/labconfig/page_config.json").write_text(json.dumps(
        {"disabledExtensions": {"@jupyterlab/apputils-extension:announcements": True}}))
    docmanager = root / "settings/@jupyterlab/docmanager-extension"
    docmanager.mkdir(parents=True, exist_ok=True)
    (docmanager / "plugin.jupyterlab-settings").write_text(json.dumps({"autosave": False}))
    port, token = free_port(), secrets.token_hex(16)
    cmd = [python, "-m", "jupyter", "lab", "--no-browser", "--ServerApp.ip=127.0.0.1",
           f"--ServerApp.port={port}", "--ServerApp.port_retries=0", f"--ServerApp.token={token}",
           f"--ServerApp.root_dir={notebooks}", "--LabApp.expose_app_in_browser=True"]
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        cmd.append("--allow-root")
    server_log = open(root / "jupyter-lab.log", "w")
    proc = subprocess.Popen(cmd, env=env, stdout=server_log, stderr=subprocess.STDOUT, cwd=notebooks)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"{base}/api/status?token={token}", timeout=2):
                    break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("jupyter lab did not start:\n"
                                       + (root / "jupyter-lab.log").read_text()[-3000:])
                time.sleep(0.3)
        log(f"jupyter lab up at {base} (root {notebooks})")
        yield base, token, env
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        server_log.close()


def trust(python: str, paths: list[Path], env: dict) -> None:
    """What `make lab` does before starting JupyterLab."""
    subprocess.run([python, "-m", "jupyter", "trust", *map(str, paths)], env=env, check=True,
                   stdout=subprocess.DEVNULL)


# --- in the page -------------------------------------------------------------------------------

JS_OPEN = """async (path) => {
  const app = window.jupyterapp;
  const panel = await app.commands.execute('docmanager:open', {path, factory: 'Notebook'});
  await panel.context.ready;
  await panel.sessionContext.ready;
  window.__panel = panel;
  return true;
}"""

JS_KERNEL_IDLE = """() => {
  const p = window.__panel;
  const k = p && p.sessionContext.session && p.sessionContext.session.kernel;
  return !!k && k.status === 'idle' && k.connectionStatus === 'connected';
}"""

JS_SCROLL_TO = """async (i) => {
  const nb = window.__panel.content;
  nb.activeCellIndex = i;
  await nb.scrollToItem(i, 'auto');
  window.__panel.content.widgets[i].node.setAttribute('data-lab-check', 'cell-' + i);
  return true;
}"""

JS_STATE = """() => {
  const p = window.__panel;
  return {dirty: p.context.model.dirty, trusted: p.content.widgets.filter(c => c.model.type === 'code')
            .every(c => c.model.trusted), path: p.context.path,
          kernel: p.sessionContext.kernelDisplayName};
}"""

JS_RUN_ALL = """() => {
  window.__runAll = null;
  window.jupyterapp.commands.execute('notebook:run-all-cells')
    .then(ok => { window.__runAll = {ok}; }, e => { window.__runAll = {error: String(e)}; });
  return true;
}"""

JS_RUN_DONE = """() => {
  // Run All's promise settles once every cell has run (or, after an error, been aborted).
  const p = window.__panel;
  const k = p.sessionContext.session && p.sessionContext.session.kernel;
  return !!window.__runAll && !!k && k.status === 'idle';
}"""

JS_ERRORS = """() => {
  const out = [];
  window.__panel.content.widgets.forEach((c, i) => {
    if (c.model.type !== 'code') return;
    for (const o of c.model.outputs.toJSON())
      if (o.output_type === 'error') out.push({cell: i, ename: o.ename, evalue: String(o.evalue).slice(0, 300)});
  });
  return out;
}"""

JS_CLOSE = """async () => {
  const p = window.__panel;
  await p.sessionContext.shutdown();
  p.dispose();
  window.__panel = null;
  return true;
}"""


class Checker:
    def __init__(self, page, shots: Path, log):
        self.page, self.shots, self.log = page, shots, log
        self.failures: list[str] = []

    def fail(self, msg: str) -> None:
        self.failures.append(msg)
        self.log("FAIL " + msg)

    def shot(self, name: str, locator=None) -> None:
        path = self.shots / f"{name}.png"
        try:
            (locator or self.page).screenshot(path=str(path))
        except Exception as e:  # a screenshot is evidence, not a check
            self.log(f"  (screenshot {name} failed: {e})")

    def open(self, name: str) -> None:
        self.page.evaluate(JS_OPEN, name)
        self.page.wait_for_function(JS_KERNEL_IDLE, timeout=60_000)

    def cell(self, i: int):
        self.page.evaluate(JS_SCROLL_TO, i)
        return self.page.locator(f'[data-lab-check="cell-{i}"]')

    def saved_widget(self, stem: str, cells: list[int], timeout_s: float) -> tuple[bool, str]:
        """Whether a saved widget draws as a widget in one of `cells` (before anything runs)."""
        deadline = time.monotonic() + timeout_s
        while True:
            for i in cells:
                cell = self.cell(i)
                if cell.locator(".jp-OutputArea-output .jupyter-widgets").count():
                    self.shot(f"{stem}_saved_widget_cell{i}", cell)
                    return True, f"cell {i}"
            if time.monotonic() > deadline:
                cell = self.cell(cells[0])
                text = cell.locator('.jp-OutputArea-output[data-mime-type="text/plain"]')
                shown = text.first.inner_text()[:80] if text.count() else "(no output)"
                self.shot(f"{stem}_saved_widget_cell{cells[0]}", cell)
                return False, f"cell {cells[0]} shows {shown!r}"
            time.sleep(0.25)

    def check_open(self, nb: Path, cells: list[int], settle_s: float) -> None:
        before = sha(nb)
        self.open(nb.name)
        ok, where = self.saved_widget(nb.stem, cells, timeout_s=20)
        if ok:
            self.log(f"  saved widget renders as a widget ({where})")
        else:
            self.fail(f"{nb.name}: no saved widget renders before running; {where}")
        time.sleep(settle_s)  # anything that would dirty the document on open has happened by now
        state = self.page.evaluate(JS_STATE)
        self.log(f"  after open: dirty={state['dirty']} trusted={state['trusted']} kernel={state['kernel']!r}")
        if state["dirty"]:
            self.fail(f"{nb.name}: opening it marks the document modified")
        self.shot(f"{nb.stem}_opened")
        self.page.evaluate(JS_CLOSE)
        if sha(nb) != before:
            self.fail(f"{nb.name}: the file on disk changed after opening and closing it")

    def check_run(self, nb: Path, cells: list[int], timeout_s: float) -> None:
        self.open(nb.name)
        t0 = time.monotonic()
        self.page.evaluate(JS_RUN_ALL)
        try:
            self.page.wait_for_function(JS_RUN_DONE, timeout=timeout_s * 1000, polling=500)
        except Exception:
            self.fail(f"{nb.name}: Run All did not finish in {timeout_s:.0f} s")
            self.shot(f"{nb.stem}_run_all_timeout")
            self.page.evaluate(JS_CLOSE)
            return
        if "error" in (self.page.evaluate("() => window.__runAll") or {}):
            self.fail(f"{nb.name}: Run All failed: {self.page.evaluate('() => window.__runAll.error')}")
        self.log(f"  Run All finished in {time.monotonic() - t0:.1f} s")
        errors = self.page.evaluate(JS_ERRORS)
        for e in errors:
            self.fail(f"{nb.name}: cell {e['cell']} raised {e['ename']}: {e['evalue']}")
        if not errors:
            self.log("  no error outputs")
        self.move_slider(nb, cells)
        self.page.evaluate(JS_CLOSE)

    def move_slider(self, nb: Path, cells: list[int]) -> None:
        """Move a slider (Home, else End) or, with none, type into a text box; its output must redraw."""
        for i in cells:
            cell = self.cell(i)
            sel = (f'[data-lab-check="cell-{i}"] .widget-output, '
                   f'[data-lab-check="cell-{i}"] .widget-html-content')
            out = self.page.locator(sel)
            handles = cell.locator(".widget-slider .noUi-handle")
            boxes = cell.locator(".widget-textarea textarea, .widget-text input")
            if not out.count() or not (handles.count() or boxes.count()):
                continue
            before = out.first.inner_html()
            self.shot(f"{nb.stem}_poke_before_cell{i}", cell)
            if handles.count():
                # one of the two moves it, wherever it starts
                moves = [(f"slider {k}", lambda k=k: (handles.first.focus(), handles.first.press(k)))
                         for k in ("Home", "End")]
            else:
                moves = [("typed into the text box", lambda: boxes.first.fill(boxes.first.input_value() + " 42"))]
            for what, move in moves:
                move()
                try:
                    self.page.wait_for_function(
                        "([sel, old]) => { const e = document.querySelector(sel);"
                        " return !!e && e.innerHTML !== old"  # redrawn, not only cleared
                        " && (e.innerText.trim().length > 0 || !!e.querySelector('img, svg, canvas')); }",
                        arg=[sel, before], timeout=20_000, polling=250)
                except Exception:
                    continue
                time.sleep(0.5)  # let the redraw finish before the picture
                self.shot(f"{nb.stem}_poke_after_cell{i}", cell)
                self.log(f"  {what} in cell {i}: its output changed")
                return
            self.fail(f"{nb.name}: poking the widget in cell {i} did not change its output")
            self.shot(f"{nb.stem}_poke_after_cell{i}", cell)
            return
        self.fail(f"{nb.name}: no slider or text box with an output found after Run All")

    def check_untrusted(self, nb: Path, cells: list[int]) -> None:
        """The control: what a fresh clone shows without `jupyter trust` (reported, not asserted)."""
        self.open(nb.name)
        cell = self.cell(cells[0])
        time.sleep(3)
        widget = cell.locator(".jp-OutputArea-output .jupyter-widgets").count()
        text = cell.locator('.jp-OutputArea-output[data-mime-type="text/plain"]')
        shown = text.first.inner_text()[:70] if text.count() else ""
        state = self.page.evaluate(JS_STATE)
        self.log(f"  untrusted (trusted={state['trusted']}): widget elements={widget}, text fallback={shown!r}")
        self.shot(f"{nb.stem}_untrusted_cell{cells[0]}", cell)
        self.page.evaluate(JS_CLOSE)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--source", default=str(NOTEBOOKS), help="the folder whose *.ipynb to copy and open "
                    "(default: this checkout's notebooks/)")
    ap.add_argument("--notebooks", default="", help="comma-separated prefixes to open (default: every "
                    "notebook with a saved widget)")
    ap.add_argument("--run", default=os.environ.get("MINILLM_LAB_RUN", "01"),
                    help="comma-separated prefixes to Run All and poke (default 01 (fast, no model); "
                    "'all' for every widget notebook, as the course's acceptance asks; '' for none)")
    ap.add_argument("--control", action="store_true",
                    help="first open one notebook before trusting it, to show the text fallback")
    ap.add_argument("--shots", default=os.environ.get("MINILLM_LAB_SHOTS", "/tmp/lab_shots"),
                    help="screenshot folder ($MINILLM_LAB_SHOTS, default /tmp/lab_shots)")
    ap.add_argument("--settle", type=float, default=2.0, help="seconds to wait after open before "
                    "checking the document is not dirty")
    ap.add_argument("--run-timeout", type=float, default=120.0)
    ap.add_argument("--python", default=sys.executable, help="the Python whose jupyter to run")
    args = ap.parse_args(argv)

    t_start = time.monotonic()

    def log(msg: str) -> None:
        print(f"[{time.monotonic() - t_start:5.1f}s] {msg}", flush=True)

    why = unavailable()
    if why:
        print(f"cannot run: {why}", file=sys.stderr)
        return 2
    from playwright.sync_api import sync_playwright

    pick = [p for p in args.notebooks.split(",") if p]
    runs = [""] if args.run.strip() == "all" else [p for p in args.run.split(",") if p]
    shots = Path(args.shots)
    shots.mkdir(parents=True, exist_ok=True)
    for old in shots.glob("*.png"):
        old.unlink()

    with tempfile.TemporaryDirectory(prefix="minillm-lab-") as tmp:
        root = Path(tmp)
        work = root / "notebooks"
        work.mkdir()
        for nb in sorted(Path(args.source).glob("*.ipynb")):
            shutil.copy2(nb, work / nb.name)
        targets = [(nb, widget_cells(nb)) for nb in sorted(work.glob("*.ipynb"))]
        targets = [(nb, c) for nb, c in targets if c and (not pick or any(nb.name.startswith(p) for p in pick))]
        if not targets:
            print("no notebook with a saved widget matched", file=sys.stderr)
            return 2
        failures = [f"{nb.name}: {p}" for nb, _ in targets for p in widget_state_problems(nb)]
        for f in failures:
            log("FAIL " + f)
        with jupyter_lab(root, work, args.python, log) as (base, token, env), sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=find_chromium(), headless=True)
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.goto(f"{base}/lab?token={token}&reset")
            page.wait_for_function("() => !!window.jupyterapp && window.jupyterapp.started !== undefined",
                                   timeout=60_000)
            page.evaluate("() => window.jupyterapp.restored")
            log(f"JupyterLab {page.evaluate('() => window.jupyterapp.version')} loaded in Chromium "
                f"{browser.version}")
            check = Checker(page, shots, log)
            check.failures += failures
            if args.control:
                nb, cells = targets[0]
                log(f"{nb.name} before `jupyter trust` (control)")
                check.check_untrusted(nb, cells)
            trust(args.python, sorted(work.glob("*.ipynb")), env)
            log("trusted the copies (jupyter trust notebooks/*.ipynb, as `make lab` does)")
            for nb, cells in targets:
                log(f"{nb.name}: open (saved widgets in cells {cells})")
                check.check_open(nb, cells, args.settle)
            for nb, cells in targets:
                if any(nb.name.startswith(p) for p in runs):
                    log(f"{nb.name}: Run All, then move a slider")
                    check.check_run(nb, cells, args.run_timeout)
            browser.close()
        failures = check.failures
    log(f"{'FAILED' if failures else 'passed'}: {len(targets)} notebooks opened, "
        f"{sum(any(nb.name.startswith(p) for p in runs) for nb, _ in targets)} run; screenshots in {shots}")
    for f in failures:
        print("  " + f)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
