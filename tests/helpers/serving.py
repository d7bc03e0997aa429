"""A minillm server for tests: the app on a free port of 127.0.0.1, in a background thread.

Shared by ``tests/12_serving/test_serve.py`` (the API) and ``test_chat_page.py`` (the chat page in Chromium).
"""

from __future__ import annotations

import re
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import httpx
import uvicorn
from openai import OpenAI

from minillm import Engine
from minillm.serve import create_app

LABEL = r'[a-zA-Z_][a-zA-Z0-9_]*="[^"]*"'
NUMBER = r"[-+]?(?:[0-9]+(?:\.[0-9]*)?(?:[eE][-+]?[0-9]+)?|Inf|NaN)"
METRIC_LINE = re.compile(rf"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{{{LABEL}(?:,{LABEL})*\}})? ({NUMBER})$")  # name{labels} value


@dataclass
class Served:
    url: str  # http://127.0.0.1:PORT
    client: OpenAI

    def metrics(self) -> dict[str, float]:
        """``/metrics`` parsed: every line is a comment or ``name{labels} value``."""
        values = {}
        for line in httpx.get(f"{self.url}/metrics").text.splitlines():
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
def serving(engine: Engine, model_id: str) -> Iterator[Served]:
    """The app on a free port of 127.0.0.1, in a background thread, until the block ends."""
    sock = socket.create_server(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    server = uvicorn.Server(uvicorn.Config(create_app(engine, model_id, warm_up=False), log_level="warning",
                                           timeout_graceful_shutdown=5))
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
        yield Served(url, OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=300))
    finally:
        server.should_exit = True
        thread.join(60)
