"""Stopping the server (``minillm.serve.shutdown``): on SIGINT or SIGTERM every request gets an
answer, no KV block is lost, and the process exits within the grace period.

The laws, for both signals: a request that arrives once the server is stopping gets 503 with
OpenAI's error JSON; a request in flight either completes or is ended (a stream with an error
event and ``data: [DONE]``, a non-streaming request with a 503); nothing hangs; the pool is all
free at the end; the exit status is 130 for SIGINT (the shell's "interrupted") and 0 for SIGTERM
(a requested stop). The real command runs in a subprocess on a tiny random model with a 4096-token
context, so that a stream of thousands of tokens outlasts any grace period here; the engine's
own laws are checked in-process. Waits are bounded; the one time asserted is the exit's bound.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import threading
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from minillm import Engine, SamplingParams, load_model
from minillm.serve.protocol import ApiError
from minillm.serve.shutdown import SignalStop
from minillm.serve.worker import EngineWorker, Failed, Job
from minillm.serve.metrics import Metrics

from helpers.checkpoints import tiny_hf_checkpoint
from minillm.bench.load_client import prometheus_values

from helpers.serving import serve_command, serving

LONG = {"prompt": "hi", "max_tokens": 3500, "ignore_eos": True, "temperature": 0}  # minutes of decoding here
WAIT = 120  # the longest any wait for the server may take (a busy 2-core machine)


@pytest.fixture(scope="module")
def tiny4k(tmp_path_factory, tiny_tokenizer) -> Path:
    return tiny_hf_checkpoint(tmp_path_factory.mktemp("tiny4k") / "tiny4k", tiny_tokenizer, "llama",
                              max_position_embeddings=4096, vocab_size=300)


# --------------------------------------------------------------------------- clients that record their answer
@dataclass
class Answer:
    status: int | None = None
    events: list[str] = field(default_factory=list)  # a stream's data lines, without "data: "
    body: dict | None = None  # a JSON answer
    error: BaseException | None = None  # no answer at all (the connection failed or was cut)
    started: threading.Event = field(default_factory=threading.Event)  # set at the first event (or the answer)
    done: float | None = None  # time.monotonic() when the answer ended

    def kind(self) -> str:
        """What the client got: "completed", "ended" (error event + [DONE]), "503", or what went wrong."""
        if self.error is not None:
            return f"no answer: {self.error!r}"
        if self.body is not None:
            if self.status == 503 and self.body["error"]["code"] == "server_shutting_down":
                return "503"
            return "completed" if self.status == 200 and "choices" in self.body else f"{self.status}: {self.body}"
        if self.status != 200 or not self.events or self.events[-1] != "[DONE]":
            return f"a stream without [DONE]: {self.status} {self.events[-3:]}"
        last = json.loads(self.events[-2])
        if "error" in last:
            assert last["error"]["message"] == "the server is shutting down" and last["error"]["type"] == "server_error"
            return "ended"
        assert last["choices"][0]["finish_reason"] in ("stop", "length"), last
        return "completed"


def ask(url: str, body: dict, path: str = "/v1/completions") -> Answer:
    """Send ``body`` on a thread of its own; the answer is recorded as it arrives."""
    answer = Answer()

    def run() -> None:
        try:
            with httpx.stream("POST", f"{url}{path}", json=body, timeout=WAIT) as response:
                answer.status = response.status_code
                if response.headers.get("content-type", "").startswith("text/event-stream"):
                    for line in response.iter_lines():
                        if line.startswith("data: "):
                            answer.events.append(line[len("data: "):])
                            answer.started.set()
                else:
                    answer.body = json.loads(response.read())
        except BaseException as err:  # noqa: BLE001 (recorded, asserted on by the test)
            answer.error = err
        finally:
            answer.done = time.monotonic()
            answer.started.set()

    threading.Thread(target=run, daemon=True).start()
    return answer


def wait_all(answers: list[Answer]) -> None:
    deadline = time.monotonic() + WAIT
    while any(a.done is None for a in answers):
        assert time.monotonic() < deadline, "a client got no answer"
        time.sleep(0.02)


def wait_metric(url: str, at_least: float, *names: str) -> None:
    """Poll /metrics until the sum of ``names`` reaches ``at_least`` (bounded)."""
    deadline = time.monotonic() + WAIT
    while True:
        values = prometheus_values(httpx.get(f"{url}/metrics", timeout=WAIT).text)
        if sum(values[name] for name in names) >= at_least:
            return
        assert time.monotonic() < deadline, f"{names} stayed below {at_least}"
        time.sleep(0.02)


def pool_line(log: str) -> tuple[int, int]:
    match = re.search(r"KV blocks free: (\d+) of (\d+)", log)
    assert match, log[-2000:]
    return int(match[1]), int(match[2])


# --------------------------------------------------------------------------- the real command
@pytest.mark.parametrize("sig, status", [(signal.SIGINT, 130), (signal.SIGTERM, 0)], ids=["SIGINT", "SIGTERM"])
def test_every_request_gets_an_answer_and_the_process_exits_within_the_grace_period(tiny4k, tmp_path, sig, status):
    """16 long streams in flight, and requests arriving during the shutdown, from its first instant."""
    grace = 3.0
    with serve_command(tiny4k, tmp_path / "log.txt", "--shutdown-timeout", str(grace)) as served:
        streams = [ask(served.url, {**LONG, "stream": True}) for _ in range(16)]
        for stream in streams:
            assert stream.started.wait(WAIT)
        signalled = time.monotonic()
        served.process.send_signal(sig)
        arrivals = []
        while time.monotonic() < signalled + grace - 1:  # arrivals from the first instant, while streams run
            arrivals += [ask(served.url, {"prompt": "hi", "max_tokens": 2}),
                         ask(served.url, {**LONG, "stream": True}),
                         ask(served.url, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
                             "/v1/chat/completions")]
            time.sleep(0.1)
        assert served.process.wait(grace + 10) == status
        exited = time.monotonic() - signalled
        wait_all(streams + arrivals)
        log = served.log()
    kinds = [s.kind() for s in streams]
    assert set(kinds) <= {"completed", "ended"}, kinds
    assert "ended" in kinds  # 3500 tokens each cannot all finish within 3 s here
    arrived = [a.kind() for a in arrivals]
    assert set(arrived) <= {"503", "completed", "ended"}, arrived  # (one sent as the signal lands may get in)
    assert arrived.count("503") >= len(arrived) - 3, arrived
    assert exited <= grace + 10, f"exited {exited:.2f} s after the signal"  # (measured: grace + ~1 s; a busy machine adds steps)
    free, total = pool_line(log)
    assert free == total
    assert ("minillm: interrupted" in log) == (sig == signal.SIGINT)
    assert "Traceback" not in log
    print(f"\n{signal.Signals(sig).name}: exited {exited:.2f} s after the signal (grace {grace} s); streams: "
          f"{kinds.count('completed')} completed, {kinds.count('ended')} ended; {len(arrived)} arrivals")


def test_requests_that_finish_within_the_grace_period_complete_and_the_exit_does_not_wait_longer(
        tiny4k, tiny_tokenizer, tmp_path):
    grace = 60.0
    with serve_command(tiny4k, tmp_path / "log.txt", "--shutdown-timeout", str(grace)) as served:
        streams = [ask(served.url, {"prompt": "hi", "max_tokens": 12, "ignore_eos": True, "stream": True})
                   for _ in range(8)]
        plain = [ask(served.url, {"prompt": "hi", "max_tokens": 12, "ignore_eos": True}) for _ in range(8)]
        wait_metric(served.url, 16 * len(tiny_tokenizer.encode("hi")), "minillm_prompt_tokens_total")  # all in
        signalled = time.monotonic()
        served.process.send_signal(signal.SIGTERM)
        assert served.process.wait(WAIT) == 0
        exited = time.monotonic()
        wait_all(streams + plain)
        log = served.log()
    assert [a.kind() for a in streams + plain] == ["completed"] * 16
    last = max(a.done for a in streams + plain)
    assert exited - max(last, signalled) <= 3, "the process waited for more than its open requests"
    assert exited - signalled < grace / 2
    assert pool_line(log)[0] == pool_line(log)[1]


def test_non_streaming_requests_past_the_grace_period_get_503(tiny4k, tmp_path):
    with serve_command(tiny4k, tmp_path / "log.txt", "--shutdown-timeout", "1") as served:
        streams = [ask(served.url, {**LONG, "stream": True}) for _ in range(2)]
        plain = [ask(served.url, LONG), ask(served.url, {"messages": [{"role": "user", "content": "hi"}],
                                                          "max_tokens": 3500, "ignore_eos": True},
                                            "/v1/chat/completions")]
        wait_metric(served.url, 4, "minillm_requests_running", "minillm_requests_waiting")
        served.process.send_signal(signal.SIGTERM)
        assert served.process.wait(WAIT) == 0
        wait_all(streams + plain)
        log = served.log()
    assert [a.kind() for a in plain] == ["503", "503"]
    assert [a.kind() for a in streams] == ["ended", "ended"]
    assert re.search(r"stopped by SIGTERM: 4 open request\(s\) ended", log), log[-1000:]


def test_an_idle_server_stops_at_once(tiny4k, tmp_path):
    with serve_command(tiny4k, tmp_path / "log.txt", "--shutdown-timeout", "60") as served:
        signalled = time.monotonic()
        served.process.send_signal(signal.SIGTERM)
        assert served.process.wait(WAIT) == 0
        assert time.monotonic() - signalled < 20  # nothing to wait for: not the 60 s grace
        log = served.log()
    assert "stopped by SIGTERM: 0 open request(s) ended" in log


def test_a_second_signal_stops_without_waiting_for_the_grace_period(tiny4k, tmp_path):
    with serve_command(tiny4k, tmp_path / "log.txt", "--shutdown-timeout", "300") as served:
        streams = [ask(served.url, {**LONG, "stream": True}) for _ in range(4)]
        for stream in streams:
            assert stream.started.wait(WAIT)
        served.process.send_signal(signal.SIGINT)
        time.sleep(0.5)
        signalled = time.monotonic()
        served.process.send_signal(signal.SIGINT)
        assert served.process.wait(WAIT) == 130
        assert time.monotonic() - signalled < 20  # not the 300 s grace
        wait_all(streams)
    assert [s.kind() for s in streams] == ["ended"] * 4


# --------------------------------------------------------------------------- in-process: the app and the engine loop
@pytest.fixture
def engine(tiny4k) -> Engine:
    model, tok = load_model(tiny4k, device="cpu")
    return Engine(model, tok, backend="eager", kv_cache_tokens=8192)


def _shutdown(served, grace: float):
    """Start ``Server.shutdown(grace)`` on the server's event loop; a future of its end."""
    server = served.app.state.server
    return asyncio.run_coroutine_threadsafe(server.shutdown(grace), server.loop)


@pytest.mark.parametrize("method, path, body", [
    ("GET", "/health", None), ("GET", "/v1/models", None), ("GET", "/", None), ("GET", "/metrics", None),
    ("POST", "/v1/completions", {"prompt": "hi", "max_tokens": 2}),
    ("POST", "/v1/completions", {"prompt": "hi", "max_tokens": 2, "stream": True}),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
])
def test_while_draining_every_new_request_gets_503_with_openai_error_json(engine, method, path, body):
    with serving(engine, "tiny") as served:
        stream = ask(served.url, {**LONG, "stream": True})  # keeps the server draining meanwhile
        assert stream.started.wait(WAIT)
        done = _shutdown(served, grace=WAIT)
        deadline = time.monotonic() + WAIT
        while not served.app.state.server.drain.draining:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        response = httpx.request(method, f"{served.url}{path}", json=body, timeout=WAIT)
        assert response.status_code == 503 and response.headers["connection"] == "close"
        assert response.json() == {"error": {"message": "the server is shutting down", "type": "server_error",
                                             "param": None, "code": "server_shutting_down"}}
        assert stream.done is None  # the request in flight goes on meanwhile
        served.app.state.server.worker.stop()  # end the grace period now
        done.result(WAIT)
        wait_all([stream])
    assert stream.kind() == "ended"


@pytest.mark.parametrize("streams, plain", [(16, 0), (0, 4), (6, 3)])
def test_shutdown_ends_the_open_requests_and_frees_every_block(engine, streams, plain):
    with serving(engine, "tiny") as served:
        answers = [ask(served.url, {**LONG, "stream": True}) for _ in range(streams)]
        answers += [ask(served.url, LONG) for _ in range(plain)]
        wait_metric(served.url, streams + plain, "minillm_requests_running", "minillm_requests_waiting")
        _shutdown(served, grace=0.2).result(WAIT)
        wait_all(answers)
        pool = engine.manager.allocator  # the engine thread has stopped: it can be read here
        assert pool.num_free == pool.num_blocks
        assert served.app.state.server.worker.ended_by_stop == streams + plain
    assert [a.kind() for a in answers] == ["ended"] * streams + ["503"] * plain


def test_shutdown_returns_as_soon_as_the_open_requests_finish(engine):
    with serving(engine, "tiny") as served:
        answers = [ask(served.url, {"prompt": "hi", "max_tokens": 8, "ignore_eos": True, "stream": s})
                   for s in (True, False) * 4]
        for answer in answers:
            assert answer.started.wait(WAIT)
        began = time.monotonic()
        _shutdown(served, grace=300).result(WAIT)
        assert time.monotonic() - began < 60  # not the 300 s grace
        wait_all(answers)
        assert served.app.state.server.worker.ended_by_stop == 0
    assert [a.kind() for a in answers] == ["completed"] * 8


# --------------------------------------------------------------------------- the engine loop: every job gets an end
def _job(loop: asyncio.AbstractEventLoop) -> Job:
    return Job([([1, 2, 3], SamplingParams(max_new_tokens=50, ignore_eos=True))], loop, time.perf_counter())


def _events(loop: asyncio.AbstractEventLoop, job: Job) -> list:
    loop.run_until_complete(asyncio.sleep(0.05))  # run the puts the engine thread scheduled
    events = []
    while not job.events.empty():
        events.append(job.events.get_nowait())
    return events


def _shutting_down(events: list) -> bool:
    last = events[-1]
    return isinstance(last, Failed) and isinstance(last.error, ApiError) and last.error.status == 503 \
        and last.error.code == "server_shutting_down"


def test_a_job_submitted_after_stop_is_failed_at_once(engine):
    loop = asyncio.new_event_loop()
    try:
        worker = EngineWorker(engine, Metrics(), warm_up=False)
        worker.start()
        worker.stop()
        job = _job(loop)
        worker.submit(job)
        events = _events(loop, job)
        assert len(events) == 1 and _shutting_down(events)
    finally:
        loop.close()


def test_ctrl_c_in_the_engine_loop_ends_the_running_and_the_queued_jobs(engine, monkeypatch):
    """KeyboardInterrupt (a second signal) in the middle of a step: the job being decoded and the
    one still queued both end with a 503, and a later one is refused at once."""
    loop = asyncio.new_event_loop()
    try:
        worker = EngineWorker(engine, Metrics(), warm_up=False)
        running, queued, later = _job(loop), _job(loop), _job(loop)
        step = engine.step
        calls = []

        def interrupted_step():
            calls.append(1)
            if len(calls) == 3:
                worker.submit(queued)  # arrives while the step runs
                raise KeyboardInterrupt
            return step()

        monkeypatch.setattr(engine, "step", interrupted_step)
        worker.submit(running)
        with pytest.raises(KeyboardInterrupt):
            worker.run()  # here, on the test's main thread, as under run_server
        worker.submit(later)
        assert _shutting_down(_events(loop, running))
        for job in (queued, later):
            events = _events(loop, job)
            assert len(events) == 1 and _shutting_down(events)
    finally:
        loop.close()


# --------------------------------------------------------------------------- the signal handler
class _FakeServer:
    def __init__(self, loop, ready: bool) -> None:
        self.loop = loop
        self.worker = type("W", (), {"ready": threading.Event()})()
        if ready:
            self.worker.ready.set()
        self.shut: list[float] = []

    async def shutdown(self, grace: float) -> None:
        self.shut.append(grace)


def test_the_first_signal_schedules_the_shutdown_and_a_second_one_interrupts():
    loop = asyncio.new_event_loop()
    try:
        server = _FakeServer(loop, ready=True)
        stop = SignalStop(server, grace=7.0)
        stop(signal.SIGTERM, None)  # only schedules: nothing has run yet
        assert stop.signal == signal.SIGTERM and server.shut == []
        loop.run_until_complete(asyncio.sleep(0.05))
        assert server.shut == [7.0]
        with pytest.raises(KeyboardInterrupt):
            stop(signal.SIGINT, None)
        assert stop.signal == signal.SIGTERM  # the first one is the one reported
    finally:
        loop.close()


@pytest.mark.parametrize("has_loop, ready", [(False, True), (True, False)], ids=["no-event-loop-yet", "warming-up"])
def test_a_signal_before_the_server_runs_interrupts_at_once(has_loop, ready):
    loop = asyncio.new_event_loop()
    try:
        stop = SignalStop(_FakeServer(loop if has_loop else None, ready), grace=7.0)
        with pytest.raises(KeyboardInterrupt):
            stop(signal.SIGINT, None)
        assert stop.signal == signal.SIGINT
    finally:
        loop.close()


def test_the_drain_starts_while_the_main_thread_is_still_busy_in_a_c_call():
    """The C-level wakeup (``installed``): the shutdown is scheduled at once, though Python's handler
    cannot run until the main thread's long C call (here zlib, standing for an engine step) returns."""
    loop = asyncio.new_event_loop()
    serving_loop = threading.Thread(target=loop.run_forever, daemon=True)
    serving_loop.start()
    try:
        server = _FakeServer(loop, ready=True)
        started: list[float] = []

        async def shutdown(grace: float) -> None:
            started.append(time.monotonic())

        server.shutdown = shutdown
        stop = SignalStop(server, grace=7.0)
        data = os.urandom(40_000_000)
        with stop.installed():
            threading.Timer(0.1, os.kill, (os.getpid(), signal.SIGTERM)).start()
            busy_from = time.monotonic()
            zlib.compress(data, 9)  # one C call of about a second (without the GIL, as a step's kernels)
            busy_until = time.monotonic()
            deadline = time.monotonic() + WAIT
            while stop.signal is None:  # Python's handler has run by now, or runs here
                assert time.monotonic() < deadline
                time.sleep(0.01)
        assert stop.signal == signal.SIGTERM
        assert busy_until - busy_from > 0.5, "the hash was too quick to tell"
        assert len(started) == 1 and started[0] < busy_until - 0.2  # scheduled once, well before the call ended
    finally:
        loop.call_soon_threadsafe(loop.stop)
        serving_loop.join(5)
        loop.close()
