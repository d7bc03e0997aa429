"""The HTTP side of ``bench serve``: a load generator of streaming chat clients, the servers as
subprocesses, and their Prometheus counters.

The client keeps one connection per request (asyncio, httpx) and times each answer by its
chunks; a server runs in a process group of its own so that ``stop()`` ends it whole.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from minillm.bench.timing import percentile


# --------------------------------------------------------------------------- the client
def serve_body(server: str, messages: list[dict[str, str]], max_tokens: int) -> dict[str, Any]:
    """A streaming, greedy chat request for ``max_tokens`` tokens, no fewer, in each server's dialect.

    minillm: ``ignore_eos`` (as vLLM has it), and ``stream_options.include_usage`` for the token
    count. transformers serve has neither (it refuses unknown fields and ignores
    ``stream_options``; its last chunk carries the usage anyway): its ``generate()`` path gets a
    ``generation_config`` with ``min_new_tokens``; its continuous batching hands a request only
    ``max_new_tokens`` and an EOS id, which falls back to the first request's generation config,
    and this one names none (its log: "Setting to -1 (disabled)"). The token counts are checked
    anyway: ``bench serve`` reports any server that returned fewer.
    """
    body: dict[str, Any] = {"messages": messages, "max_tokens": max_tokens, "temperature": 0.0, "stream": True}
    if server == "minillm":
        body.update(ignore_eos=True, stream_options={"include_usage": True})
    else:
        body["generation_config"] = json.dumps({"max_new_tokens": max_tokens, "min_new_tokens": max_tokens,
                                                "do_sample": False})
    return body


def _read_event(row: dict[str, Any], event: dict[str, Any]) -> None:
    """Fold one server-sent chat chunk into ``row``: content, timestamps, usage, or an error."""
    if "error" in event:
        row["error"] = f"error event: {str(event['error'])[:300]}"
        return
    choices = event.get("choices") or []
    content = "".join((choice.get("delta") or {}).get("content") or "" for choice in choices)
    if content:
        row["first"] = row["first"] or time.perf_counter()
        row["chunks"] += 1
        row["text"] += content
    if content or any(choice.get("finish_reason") for choice in choices):
        # the last token's time: its content, or the finish that follows it at once (a token
        # with no text of its own, as a special one, shows up only there)
        row["last"] = time.perf_counter()
    if event.get("usage"):
        row["usage_tokens"] = event["usage"].get("completion_tokens")


async def _stream_chat(client: Any, body: dict[str, Any]) -> dict[str, Any]:
    """Send one streaming chat completion; timestamps (``time.perf_counter``) and counts of its answer."""
    import httpx

    row: dict[str, Any] = {"sent": time.perf_counter(), "first": None, "last": None, "chunks": 0,
                           "usage_tokens": None, "error": None, "text": ""}
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                detail = (await response.aread()).decode("utf-8", "replace")[:300]
                row["error"] = f"HTTP {response.status_code}: {detail}"
            else:
                async for line in response.aiter_lines():
                    data = line[5:].strip() if line.startswith("data:") else None
                    if data == "[DONE]":
                        break
                    if data is not None:
                        _read_event(row, json.loads(data))
                        if row["error"]:
                            break
    except (httpx.HTTPError, ValueError) as err:  # ValueError: a line that is not JSON
        row["error"] = f"{type(err).__name__}: {err}"
    row["done"] = time.perf_counter()
    if row["error"] is None and row["first"] is None:
        row["error"] = "the answer had no content"
    return row


async def _drive_load(url: str, bodies: list[dict[str, Any]], arrivals: list[float],
                      timeout: float) -> list[dict[str, Any]]:
    import httpx

    limits = httpx.Limits(max_connections=len(bodies), max_keepalive_connections=len(bodies))
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(timeout), limits=limits) as client:
        start = time.perf_counter()

        async def one(i: int) -> dict[str, Any]:
            await asyncio.sleep(max(0.0, start + arrivals[i] - time.perf_counter()))
            row = await _stream_chat(client, bodies[i])
            row["late"] = row["sent"] - (start + arrivals[i])  # how far behind its schedule the client sent it
            return row

        return list(await asyncio.gather(*(one(i) for i in range(len(bodies)))))


def run_load(url: str, bodies: list[dict[str, Any]], arrivals: list[float],
             timeout: float = 600.0) -> list[dict[str, Any]]:
    """Send ``bodies[i]`` to ``url``'s ``/v1/chat/completions`` at ``arrivals[i]`` seconds from now,
    each streaming on a connection of its own (asyncio, httpx), and wait for every answer.

    Per request, in seconds: ``ttft`` (sent to first content), ``tpot`` ((last token - first
    content) / (tokens - 1), the last token's time being its content or the finish chunk),
    ``latency`` (sent to the end of the stream), ``tokens`` (the usage count the server reports,
    else the content chunks), ``chunks``, ``text``, ``late`` (sent behind schedule), and
    ``error`` (None, or what went wrong: a status, an error event, no content, an exception),
    plus the raw ``sent`` / ``done`` timestamps.
    """
    rows = asyncio.run(_drive_load(url, bodies, arrivals, timeout))
    for row in rows:
        tokens = row["usage_tokens"] if row["usage_tokens"] is not None else row["chunks"]
        row["tokens"] = tokens
        row["latency"] = row["done"] - row["sent"]
        ok = row["error"] is None
        row["ttft"] = row["first"] - row["sent"] if ok else None
        row["tpot"] = (row["last"] - row["first"]) / (tokens - 1) if ok and tokens > 1 else None
    return rows


def load_summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """One run: request and error counts, tokens, output tokens/s over the run's span (first send
    to last answer), p50/p99 of TTFT, TPOT and latency (ms) over the requests that succeeded."""
    ok = [row for row in rows if row["error"] is None]
    span = max(row["done"] for row in rows) - min(row["sent"] for row in rows) if rows else 0.0
    tokens = sum(row["tokens"] for row in ok)
    summary: dict[str, Any] = {"requests": len(rows), "errors": len(rows) - len(ok), "tokens": tokens,
                               "span_s": span, "tok_s": tokens / span if span > 0 else 0.0,
                               "late_max_ms": 1000 * max((row["late"] for row in rows if "late" in row), default=0.0),
                               "first_errors": sorted({row["error"] for row in rows if row["error"]})[:3]}
    for metric in ("ttft", "tpot", "latency"):
        values = [1000 * row[metric] for row in ok if row[metric] is not None]
        summary[f"{metric}_p50_ms"] = percentile(values, 50) if values else None
        summary[f"{metric}_p99_ms"] = percentile(values, 99) if values else None
    return summary


# --------------------------------------------------------------------------- the metrics
def prometheus_values(text: str) -> dict[str, float]:
    """Every sample of Prometheus text, by ``name{labels}`` as the exposition writes it."""
    from prometheus_client.parser import text_string_to_metric_families

    values = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f'{key}="{value}"' for key, value in sample.labels.items())
            values[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return values


def fetch_metrics(url: str) -> dict[str, float]:
    """A server's ``/metrics``, read by ``prometheus_values``."""
    import httpx

    return prometheus_values(httpx.get(f"{url}/metrics", timeout=30).text)


# --------------------------------------------------------------------------- the servers
def _die_with_parent() -> Callable[[], None] | None:
    """For Popen's ``preexec_fn`` on Linux: the child gets SIGTERM when this process dies, even by
    SIGKILL, so no server outlives the benchmark. (Looked up here, so the child only calls it.)"""
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    return lambda: prctl(1, signal.SIGTERM)  # 1: PR_SET_PDEATHSIG


def free_port() -> int:
    with socket.create_server(("127.0.0.1", 0)) as sock:
        return sock.getsockname()[1]


def children_env() -> dict[str, str]:
    """The servers' environment: offline, unbuffered, and this very minillm importable."""
    env = dict(os.environ)
    env["HF_HUB_OFFLINE"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    root = str(Path(__file__).resolve().parents[2])  # the folder that holds minillm/
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


class ServerProcess:
    """A server in a subprocess: its own process group (ended as a whole, compile workers
    included), its output in ``log_path``; ``stop()`` always ends it, SIGTERM then SIGKILL."""

    def __init__(self, name: str, argv: list[str], port: int, log_path: Path, env: dict[str, str]) -> None:
        self.name, self.argv, self.url, self.log_path = name, argv, f"http://127.0.0.1:{port}", log_path
        self.stopped = False
        self._log = open(log_path, "wb")  # noqa: SIM115 (closed by stop)
        self.process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT,
                                        env=env, start_new_session=True, preexec_fn=_die_with_parent())

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(encoding="utf-8", errors="replace")[-chars:]
        except OSError:
            return ""

    def peak_rss_mb(self) -> float | None:
        """The server process's peak resident memory (Linux: VmHWM), in MB; None where unknown."""
        try:
            status = Path(f"/proc/{self.process.pid}/status").read_text()
        except OSError:
            return None
        line = next((line for line in status.splitlines() if line.startswith("VmHWM:")), None)
        return int(line.split()[1]) / 1024 if line else None

    def wait_ready(self, timeout: float) -> None:
        """Poll ``/health`` until it answers 200 with status ok (bounded); the server's log in the error."""
        import httpx

        deadline = time.monotonic() + timeout
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.name} exited with status {self.process.returncode} before it was ready "
                                   f"({' '.join(self.argv)}); its log ends:\n{self.log_tail()}")
            try:
                response = httpx.get(f"{self.url}/health", timeout=5)
                if response.status_code == 200 and response.json().get("status") == "ok":
                    return
            except (httpx.HTTPError, ValueError):
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.name} was not ready after {timeout:.0f} s; its log ends:\n{self.log_tail()}")
            time.sleep(0.5)

    def stop(self) -> None:
        if self.stopped:  # once: the group id is not ours to signal after that
            return
        self.stopped = True
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(self.process.pid, sig)  # the group: the server and whatever it started
            except (ProcessLookupError, PermissionError):
                pass
            try:
                self.process.wait(15)
            except subprocess.TimeoutExpired:
                continue
        self._log.close()
