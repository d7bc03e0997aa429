"""Clients that misbehave at the HTTP level: what they can hold, and what they get back.

Laws: a user string echoed in an error is cut to a short prefix; a client that leaves mid-upload
leaves no traceback in the log; a request whose headers, or whose body, do not arrive within the
request timeout has its connection closed (the body's case with a 408 first), so that slowloris
clients hold nothing for long; headers past 16 KiB are refused. An in-process server with a
1.5-second request timeout, spoken to over raw sockets; the time bounds are that timeout plus a
generous margin, and each slow client also checks that it was not cut off *before* the timeout.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from minillm import Engine, load_model
from minillm.serve.protocol import ECHO_CHARS

from helpers.checkpoints import tiny_hf_checkpoint
from helpers.serving import Served, serving

TIMEOUT = 1.5  # the server's request timeout here
MARGIN = 10.0  # how much later than TIMEOUT a connection may be closed (a busy machine)


@pytest.fixture(scope="module")
def served(tmp_path_factory, tiny_tokenizer) -> Iterator[Served]:
    folder = tiny_hf_checkpoint(tmp_path_factory.mktemp("tiny") / "tiny", tiny_tokenizer, "llama",
                                max_position_embeddings=512, vocab_size=300)
    model, tok = load_model(folder, device="cpu")
    with serving(Engine(model, tok, backend="eager", kv_cache_tokens=2048), "tiny", request_timeout=TIMEOUT) as s:
        yield s


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
def logs() -> Iterator[list[logging.LogRecord]]:
    """Everything the server logs during the test (uvicorn's loggers do not propagate to the root)."""
    handler = _Records()
    loggers = [logging.getLogger(name) for name in ("", "uvicorn", "uvicorn.error", "minillm.serve")]
    for logger in loggers:
        logger.addHandler(handler)
    yield handler.records
    for logger in loggers:
        logger.removeHandler(handler)


def _connect(served: Served) -> socket.socket:
    port = int(served.url.rsplit(":", 1)[1])
    return socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT + MARGIN)


def _read_until_closed(sock: socket.socket) -> bytes:
    received = b""
    try:
        while chunk := sock.recv(65536):
            received += chunk
    except ConnectionResetError:
        pass
    return received


def _assert_serving(served: Served) -> None:
    reply = httpx.post(f"{served.url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=60)
    assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 2


# --------------------------------------------------------------------------- echoed strings
@pytest.mark.parametrize("length", [ECHO_CHARS, ECHO_CHARS + 1, 2**20])
@pytest.mark.parametrize("path, body", [("/v1/completions", {"prompt": "hi"}),
                                        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})])
def test_an_unknown_model_name_is_echoed_cut_to_a_short_prefix(served, length, path, body):
    name = "m" * length
    response = httpx.post(f"{served.url}{path}", json={**body, "model": name}, timeout=60)
    assert response.status_code == 404 and response.json()["error"]["code"] == "model_not_found"
    message = response.json()["error"]["message"]
    if length <= ECHO_CHARS:
        assert name in message
    else:
        assert "m" * ECHO_CHARS + "…" in message and "m" * (ECHO_CHARS + 1) not in message
    assert len(response.content) < 1000


@pytest.mark.parametrize("body", [{"prompt": "hi", "stop": "s" * 5000}, {"prompt": "x" * 2**20, "max_tokens": -1},
                                  {"messages": [{"role": "r" * 5000, "content": "hi"}]}])
def test_a_refused_value_is_echoed_cut_to_a_short_prefix(served, body):
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    response = httpx.post(f"{served.url}{path}", json=body, timeout=60)
    assert response.status_code == 400 and len(response.json()["error"]["message"]) < 400


# --------------------------------------------------------------------------- a client that leaves mid-upload
@pytest.mark.parametrize("sent", [b"", b'{"prompt": "hi', b"5\r\n{\"pro\r\n"], ids=["no-body", "half-body", "chunked"])
def test_a_client_that_leaves_mid_upload_leaves_no_traceback(served, logs, sent):
    framing = b"Transfer-Encoding: chunked" if sent.startswith(b"5\r\n") else b"Content-Length: 100000"
    for path in (b"/v1/completions", b"/v1/chat/completions"):
        with _connect(served) as sock:
            sock.sendall(b"POST " + path + b" HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                         + framing + b"\r\n\r\n" + sent)
            time.sleep(0.3)  # the handler is reading the body now
    _assert_serving(served)  # (and the handlers of the two requests have ended by now)
    time.sleep(0.2)
    assert not [r for r in logs if r.exc_info or "Traceback" in r.getMessage()], [r.getMessage() for r in logs]
    assert all("\n" not in r.getMessage().strip() for r in logs)  # one line each, at most


# --------------------------------------------------------------------------- slow clients
@pytest.mark.parametrize("first, trickle", [
    (b"", b""),  # headers, then no body at all
    (b'{"prompt": ', b" "),  # part of the body, then a byte at a time
], ids=["no-body", "trickled-body"])
def test_a_body_that_does_not_arrive_in_time_gets_408_and_the_connection_closes(served, first, trickle):
    with _connect(served) as sock:
        began = time.monotonic()
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 1000\r\n\r\n" + first)
        stop = threading.Event()

        def drip() -> None:
            while trickle and not stop.wait(0.2):
                try:
                    sock.sendall(trickle)
                except OSError:
                    return

        threading.Thread(target=drip, daemon=True).start()
        received = _read_until_closed(sock)
        stop.set()
        elapsed = time.monotonic() - began
    head, _, body = received.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408"), received[:300]
    assert json.loads(body)["error"]["code"] == "request_timeout"
    assert TIMEOUT * 0.9 <= elapsed <= TIMEOUT + MARGIN
    _assert_serving(served)


def _slow_headers(served: Served, before: bytes, trickle: bytes, results: list) -> None:
    """Send ``before``, then ``trickle`` a byte every 0.2 s; record when the server closed the connection."""
    with _connect(served) as sock:
        began = time.monotonic()
        sock.sendall(before)
        received = b""
        sock.settimeout(0.2)
        for byte in [trickle[i:i + 1] for i in range(len(trickle))] * 1000 or [b""] * 1000:
            if time.monotonic() - began > TIMEOUT + MARGIN:
                break
            try:
                sock.sendall(byte)  # (b"": a silent client)
                chunk = sock.recv(65536)
                if not chunk:
                    break
                received += chunk
            except TimeoutError:
                continue
            except OSError:
                break
        results.append((time.monotonic() - began, received))


@pytest.mark.parametrize("before, trickle", [
    (b"", b""),  # connects, sends nothing
    (b"GET /v1/models HTTP/1.1\r\n", b"X"),  # a header a byte at a time, forever
    (b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\nGET /health HTTP/1.1\r\n", b"X"),  # the same on keep-alive
], ids=["silent", "trickled-headers", "trickled-next-request"])
def test_headers_that_do_not_arrive_in_time_close_the_connection(served, before, trickle):
    results: list = []
    _slow_headers(served, before, trickle, results)
    [(elapsed, received)] = results
    assert elapsed <= TIMEOUT + MARGIN, "the connection was never closed"
    answered = received.count(b"HTTP/1.1 200")
    assert answered == before.count(b"\r\n\r\n")  # the complete request was answered; the slow one never is
    assert elapsed >= TIMEOUT * 0.9 or answered  # (not cut off early)
    _assert_serving(served)


def test_eight_slowloris_connections_are_all_closed_and_others_are_served_meanwhile(served):
    results: list = []
    threads = [threading.Thread(target=_slow_headers, args=(served, b"POST /v1/completions HTTP/1.1\r\n", b"X",
                                                            results)) for _ in range(8)]
    for thread in threads:
        thread.start()
    _assert_serving(served)  # while they hold their connections
    for thread in threads:
        thread.join(TIMEOUT + MARGIN + 30)
    assert len(results) == 8 and all(elapsed <= TIMEOUT + MARGIN for elapsed, _ in results), results


@pytest.mark.parametrize("size, piece", [(20_000, 1000), (2**20, 2**20)], ids=["20k-in-pieces", "1M-at-once"])
def test_headers_past_16_kib_are_refused(served, size, piece):
    """h11 refuses an incomplete request head past 16 KiB; one read of the socket (up to 256 KiB,
    asyncio's) may bring a larger complete one, which is then parsed."""
    request = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: " + b"a" * size + b"\r\n\r\n"
    with _connect(served) as sock:
        try:
            for start in range(0, len(request), piece):
                sock.sendall(request[start:start + piece])
                time.sleep(0.01)
        except OSError:  # the server closed the connection while we were still sending
            pass
        received = _read_until_closed(sock)
    assert received.startswith(b"HTTP/1.1 400")
    _assert_serving(served)


def test_an_idle_keep_alive_connection_is_closed_after_5_s(tmp_path, tiny_tokenizer):
    """uvicorn's keep-alive timeout (``uvicorn_config``: 5 s), with a request timeout longer than it."""
    folder = tiny_hf_checkpoint(tmp_path / "tiny", tiny_tokenizer, "llama", max_position_embeddings=512,
                                vocab_size=300)
    model, tok = load_model(folder, device="cpu")
    with serving(Engine(model, tok, backend="eager", kv_cache_tokens=2048), "tiny", request_timeout=60) as other:
        with _connect(other) as sock:
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            began = time.monotonic()
            received = _read_until_closed(sock)
            elapsed = time.monotonic() - began
    assert received.count(b"HTTP/1.1 200") == 1
    assert 4.5 <= elapsed <= 5 + MARGIN
