"""``GET /metrics``: counters and histograms of what the server did, in Prometheus' text format.

The engine thread counts as it serves (tokens, finished requests by reason, time to first token,
time per output token) and publishes the engine's own state after each loop iteration as one
``EngineSnapshot``, so ``/metrics`` never reads the Engine itself.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

TTFT_BUCKETS = (0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TPOT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5)
RATE_WINDOW_S = 10.0  # tokens/s is averaged over this many seconds


class Histogram:
    """A Prometheus histogram: cumulative counts per upper bound, plus the sum and the count."""

    def __init__(self, buckets: Sequence[float]) -> None:
        self.buckets = tuple(buckets)
        self.counts = [0] * len(self.buckets)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        for i, bound in enumerate(self.buckets):
            if value <= bound:
                self.counts[i] += 1
        self.sum += value
        self.count += 1

    def lines(self, name: str) -> list[str]:
        rows = [f'{name}_bucket{{le="{b:g}"}} {c}' for b, c in zip(self.buckets, self.counts)]
        return rows + [f'{name}_bucket{{le="+Inf"}} {self.count}', f"{name}_sum {self.sum:.6f}",
                       f"{name}_count {self.count}"]


@dataclass(frozen=True)
class EngineSnapshot:
    """The engine's state after its latest loop iteration, published by the engine thread (one
    reference assignment), so ``/metrics`` and ``/health`` never read the Engine itself."""

    running: int = 0
    waiting: int = 0
    blocks_free: int = 0
    blocks_total: int = 0
    preemptions: int = 0
    prefix_cache_hits: int = 0  # prompt tokens found in the prefix cache
    prefix_cache_queries: int = 0  # prompt tokens looked up in it


class Metrics:
    """Counters and histograms written by the engine thread and read by ``/metrics``, under a lock."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.prompt_tokens = 0
        self.generated_tokens = 0
        self.finished: dict[str, int] = {"stop": 0, "length": 0, "abort": 0, "error": 0}
        self.ttft = Histogram(TTFT_BUCKETS)
        self.tpot = Histogram(TPOT_BUCKETS)
        self._recent: deque[tuple[float, int]] = deque()  # (when, tokens) of the last RATE_WINDOW_S

    def accepted(self, prompt_tokens: int) -> None:
        with self._lock:
            self.prompt_tokens += prompt_tokens

    def step(self, now: float, tokens: int, first_token_waits: list[float]) -> None:
        with self._lock:
            self.generated_tokens += tokens
            self._recent.append((now, tokens))
            for wait in first_token_waits:
                self.ttft.observe(wait)

    def finish(self, reason: str, tokens: int = 0, decode_seconds: float = 0.0) -> None:
        with self._lock:
            self.finished[reason] += 1
            if tokens > 1:  # time per output token: the decode after the first token, per token
                self.tpot.observe(decode_seconds / (tokens - 1))

    def render(self, engine: EngineSnapshot) -> str:
        """Prometheus' text format: ``# HELP`` and ``# TYPE`` lines, then ``name{labels} value``."""
        with self._lock:
            now = time.perf_counter()
            while self._recent and self._recent[0][0] < now - RATE_WINDOW_S:
                self._recent.popleft()
            rate = sum(tokens for _, tokens in self._recent) / RATE_WINDOW_S
            hits = engine.prefix_cache_hits / engine.prefix_cache_queries if engine.prefix_cache_queries else 0.0
            single: list[tuple[str, str, str, float]] = [
                ("minillm_requests_running", "gauge", "Requests in the running batch.", engine.running),
                ("minillm_requests_waiting", "gauge", "Requests queued for admission.", engine.waiting),
                ("minillm_kv_blocks_used", "gauge", "KV-cache blocks held by requests.",
                 engine.blocks_total - engine.blocks_free),
                ("minillm_kv_blocks_free", "gauge", "KV-cache blocks free.", engine.blocks_free),
                ("minillm_kv_blocks_total", "gauge", "KV-cache blocks in the pool.", engine.blocks_total),
                ("minillm_prefix_cache_hit_rate", "gauge",
                 "Share of prompt tokens found in the prefix cache (0 without one).", round(hits, 6)),
                ("minillm_prefix_cache_hit_tokens_total", "counter",
                 "Prompt tokens found in the prefix cache instead of computed.", engine.prefix_cache_hits),
                ("minillm_prefix_cache_query_tokens_total", "counter",
                 "Prompt tokens admitted (looked up in the prefix cache when it is on).", engine.prefix_cache_queries),
                ("minillm_preemptions_total", "counter",
                 "Requests sent back to the queue because the KV pool ran out.", engine.preemptions),
                ("minillm_prompt_tokens_total", "counter", "Prompt tokens accepted.", self.prompt_tokens),
                ("minillm_generated_tokens_total", "counter", "Tokens generated.", self.generated_tokens),
                ("minillm_generated_tokens_per_second", "gauge",
                 f"Tokens generated per second over the last {RATE_WINDOW_S:g} s.", round(rate, 3)),
            ]
            out: list[str] = []
            for name, kind, help, value in single:
                out += [f"# HELP {name} {help}", f"# TYPE {name} {kind}", f"{name} {value}"]
            name = "minillm_requests_finished_total"
            out += [f"# HELP {name} Engine requests (one per choice) finished, by reason.", f"# TYPE {name} counter"]
            out += [f'{name}{{reason="{reason}"}} {count}' for reason, count in self.finished.items()]
            for name, help, histogram in [
                ("minillm_time_to_first_token_seconds", "From the HTTP request to a choice's first token.", self.ttft),
                ("minillm_time_per_output_token_seconds", "Per choice: decode time after the first token, per token.",
                 self.tpot),
            ]:
                out += [f"# HELP {name} {help}", f"# TYPE {name} histogram", *histogram.lines(name)]
            return "\n".join(out) + "\n"

