"""``GET /metrics``: the server's Prometheus metrics, kept by the official ``prometheus_client``.

Two kinds of numbers. What the engine thread counts as it serves (tokens, finished requests by
reason, time to first token, time per output token) goes into the library's counters and
histograms. The engine's own state (queue, batch, KV blocks, prefix cache, preemptions, drafts) is
published by the engine thread after each loop iteration as one ``EngineSnapshot``, and a
collector turns the latest one into samples at scrape time, so ``/metrics`` never reads the
Engine. Each ``Metrics`` has a registry of its own: two servers in one process keep their counts
apart.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

TTFT_BUCKETS = (0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TPOT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5)
RATE_WINDOW_S = 10.0  # tokens/s is averaged over this many seconds
FINISH_LABELS = ("stop", "length", "abort", "error")  # minillm_requests_finished_total's reasons


@dataclass(frozen=True)
class EngineSnapshot:
    """The engine's state after its latest loop iteration, published by the engine thread (one
    reference assignment), so ``/metrics`` never reads the Engine itself."""

    running: int = 0
    waiting: int = 0
    blocks_free: int = 0
    blocks_total: int = 0
    preemptions: int = 0
    prefix_cache_hits: int = 0  # prompt tokens found in the prefix cache
    prefix_cache_queries: int = 0  # prompt tokens looked up in it
    drafts_proposed: int = 0  # speculative decoding's drafted tokens verified
    drafts_accepted: int = 0  # of those, kept


class Metrics:
    """The counters the engine thread writes (``accepted``, ``step``, ``finish``, ``publish``) and
    ``render`` reads, from any thread: the library's metrics are thread-safe."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.snapshot = EngineSnapshot()
        self._lock = threading.Lock()  # guards _recent
        self._recent: deque[tuple[float, int]] = deque()  # (when, tokens) of the last RATE_WINDOW_S
        self.registry.register(_EngineCollector(self))
        self.prompt_tokens = Counter("minillm_prompt_tokens_total", "Prompt tokens accepted.",
                                     registry=self.registry)
        self.generated_tokens = Counter("minillm_generated_tokens_total", "Tokens generated.",
                                        registry=self.registry)
        self.finished = Counter("minillm_requests_finished_total",
                                "Engine requests (one per choice) finished, by reason.", ["reason"],
                                registry=self.registry)
        for reason in FINISH_LABELS:  # every reason is shown from the start, at 0
            self.finished.labels(reason)
        self.ttft = Histogram("minillm_time_to_first_token_seconds", "From the HTTP request to a choice's first token.",
                              buckets=TTFT_BUCKETS, registry=self.registry)
        self.tpot = Histogram("minillm_time_per_output_token_seconds",
                              "Per choice: decode time after the first token, per token.", buckets=TPOT_BUCKETS,
                              registry=self.registry)

    # -- written by the engine thread
    def publish(self, snapshot: EngineSnapshot) -> None:
        self.snapshot = snapshot

    def accepted(self, prompt_tokens: int) -> None:
        self.prompt_tokens.inc(prompt_tokens)

    def step(self, now: float, tokens: int, first_token_waits: list[float]) -> None:
        self.generated_tokens.inc(tokens)
        for wait in first_token_waits:
            self.ttft.observe(wait)
        with self._lock:
            self._recent.append((now, tokens))

    def finish(self, reason: str, tokens: int = 0, decode_seconds: float = 0.0) -> None:
        self.finished.labels(reason).inc()
        if tokens > 1:  # time per output token: the decode after the first token, per token
            self.tpot.observe(decode_seconds / (tokens - 1))

    # -- read by /metrics
    def tokens_per_second(self) -> float:
        """Tokens generated per second over the last ``RATE_WINDOW_S`` seconds."""
        with self._lock:
            now = time.perf_counter()
            while self._recent and self._recent[0][0] < now - RATE_WINDOW_S:
                self._recent.popleft()
            return sum(tokens for _, tokens in self._recent) / RATE_WINDOW_S

    def render(self) -> bytes:
        """Prometheus' text format: ``# HELP`` and ``# TYPE`` lines, then ``name{labels} value``."""
        return generate_latest(self.registry)


class _EngineCollector(Collector):
    """The latest ``EngineSnapshot`` (and the recent token rate) as samples, at scrape time."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[Metric]:
        engine = self.metrics.snapshot
        hits = engine.prefix_cache_hits / engine.prefix_cache_queries if engine.prefix_cache_queries else 0.0
        yield GaugeMetricFamily("minillm_requests_running", "Requests in the running batch.", value=engine.running)
        yield GaugeMetricFamily("minillm_requests_waiting", "Requests queued for admission.", value=engine.waiting)
        yield GaugeMetricFamily("minillm_kv_blocks_used", "KV-cache blocks held by requests.",
                                value=engine.blocks_total - engine.blocks_free)
        yield GaugeMetricFamily("minillm_kv_blocks_free", "KV-cache blocks free.", value=engine.blocks_free)
        yield GaugeMetricFamily("minillm_kv_blocks_total", "KV-cache blocks in the pool.", value=engine.blocks_total)
        yield GaugeMetricFamily("minillm_prefix_cache_hit_rate",
                                "Share of prompt tokens found in the prefix cache (0 without one).",
                                value=round(hits, 6))
        yield CounterMetricFamily("minillm_prefix_cache_hit_tokens_total",
                                  "Prompt tokens found in the prefix cache instead of computed.",
                                  value=engine.prefix_cache_hits)
        yield CounterMetricFamily("minillm_prefix_cache_query_tokens_total",
                                  "Prompt tokens admitted (looked up in the prefix cache when it is on).",
                                  value=engine.prefix_cache_queries)
        yield CounterMetricFamily("minillm_preemptions_total",
                                  "Requests sent back to the queue because the KV pool ran out.",
                                  value=engine.preemptions)
        yield CounterMetricFamily("minillm_speculative_drafts_total",
                                  "Drafted tokens verified by speculative decoding (--speculative).",
                                  value=engine.drafts_proposed)
        yield CounterMetricFamily("minillm_speculative_drafts_accepted_total",
                                  "Drafted tokens the model agreed with, kept without a step of their own.",
                                  value=engine.drafts_accepted)
        yield GaugeMetricFamily("minillm_generated_tokens_per_second",
                                f"Tokens generated per second over the last {RATE_WINDOW_S:g} s.",
                                value=round(self.metrics.tokens_per_second(), 3))
