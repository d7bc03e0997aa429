"""A minillm server for tests: the app on a free port of 127.0.0.1, in a background thread
(``serving``), or the real ``python -m minillm serve`` in a subprocess (``serve_command``).

Shared by the tests of ``tests/12_serving/`` (the API, the chat page in Chromium, shutdown, security).
"""

from __future__ import annotations

import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import uvicorn
from openai import OpenAI

from minillm import Engine
from minillm.serve import create_app
from minillm.serve.security import uvicorn_config

LABEL = r'[a-zA-Z_][a-zA-Z0-9_]*="[^"]*"'
NUMBER = r"[-+]?(?:[0-9]+(?:\.[0-9]*)?(?:[eE][-+]?[0-9]+)?|Inf|NaN)"
METRIC_LINE = re.compile(rf"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{{{LABEL}(?:,{LABEL})*\}})? ({NUMBER})$")  # name{labels} value


@dataclass
class Served:
    url: str  # http://127.0.0.1:PORT
    client: OpenAI
    app: Any = None  # the FastAPI app (its Server: app.state.server)
    api_key: str | None = None  # the key the server asks for, if any

    def metrics(self) -> dict[str, float]:
        """``/metrics`` parsed: every line is a comment or ``name{labels} value``."""
        values = {}
        auth = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        for line in httpx.get(f"{self.url}/metrics", headers=auth).text.splitlines():
            if line.startswith("#") or not line:
                continue
            match = METRIC_LINE.match(line)
            assert match, f"not Prometheus text: {line!r}"
            values[match[1] + (match[2] or "")] = float(match[3])
        return values

    def wait_until_idle(self, timeout: float = 120.0) -> dict[str, float]:
        """Poll /metrics until no request runs or waits and every KV block is free (bounded)."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            idle = m["minillm_requests_running"] == 0 and m["minillm_requests_waiting"] == 0
            if idle and m["minillm_kv_blocks_free"] == m["minillm_kv_blocks_total"] or time.monotonic() > deadline:
                return m
            time.sleep(0.05)


@contextmanager
def serving(engine: Engine, model_id: str, request_timeout: float = 30.0, **options: Any) -> Iterator[Served]:
    """The app on a free port of 127.0.0.1, in a background thread, until the block ends; configured
    as ``python -m minillm serve`` configures it (``uvicorn_config``). ``options`` go to ``create_app``."""
    sock = socket.create_server(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    app = create_app(engine, model_id, warm_up=False, request_timeout=request_timeout, **options)
    server = uvicorn.Server(uvicorn_config(app, "warning", request_timeout, timeout_graceful_shutdown=5))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 120
    while True:
        try:
            if httpx.get(f"{url}/health").status_code == 200:
                break
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline and thread.is_alive(), "the server did not come up"
        time.sleep(0.05)
    try:
        yield Served(url, OpenAI(base_url=f"{url}/v1", api_key=options.get("api_key") or "x", max_retries=0,
                                 timeout=300), app, options.get("api_key"))
    finally:
        server.should_exit = True
        thread.join(60)


# --------------------------------------------------------------------------- `python -m minillm serve`
REPO = Path(__file__).resolve().parents[2]


@dataclass
class Command:
    """``python -m minillm serve`` in a subprocess; its stderr goes to ``log_path``."""

    url: str
    process: subprocess.Popen
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(encoding="utf-8", errors="replace")


@contextmanager
def serve_command(model: Path, log_path: Path, *args: str, host: str = "127.0.0.1",
                  env: dict[str, str] | None = None, wait_healthy: bool = True) -> Iterator[Command]:
    """The real command on a free port (eager backend: it starts in seconds), until the block ends
    (then killed if still running). ``args`` are more command-line options."""
    with socket.create_server(("127.0.0.1", 0)) as probe:
        port = probe.getsockname()[1]
    # stderr to a file, not a pipe: nobody reads a pipe while the test runs, and a full pipe
    # (64 KB of access logs) would block the server mid-write. SIGINT at its default whatever this
    # process inherited (a background job starts with SIGINT ignored, and children inherit that).
    log = log_path.open("w")
    process = subprocess.Popen(
        [sys.executable, "-m", "minillm", "serve", "--model", str(model), "--host", host, "--port", str(port),
         "--device", "cpu", "--backend", "eager", *args], cwd=REPO, stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL, stderr=log, env=env, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    command = Command(f"http://127.0.0.1:{port}", process, log_path)
    try:
        deadline = time.monotonic() + 300
        while wait_healthy:
            try:
                if httpx.get(f"{command.url}/health", timeout=10).json().get("status") == "ok":
                    break
            except (httpx.TransportError, ValueError):
                pass
            assert process.poll() is None, f"the server exited with {process.returncode}:\n{command.log()[-3000:]}"
            assert time.monotonic() < deadline, f"the server did not come up:\n{command.log()[-3000:]}"
            time.sleep(0.1)
        yield command
    finally:
        if process.poll() is None:
            process.kill()
        process.wait(30)
        log.close()


def wait_until_healthy(url: str, process: subprocess.Popen, seconds: float) -> None:
    """Poll ``url``/health until the server started as ``process`` says "ok" (it may compile first)."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            if httpx.get(f"{url}/health").json()["status"] == "ok":
                return
        except httpx.TransportError:
            pass
        assert process.poll() is None and time.monotonic() < deadline, "the server did not come up"
        time.sleep(0.2)
