"""Prometheus metrics (vLLM's names under ``steerable:``). Request latencies and token counts are
observed here as outputs reach the server; engine occupancy and engine counters are read from
``LLMEngine.stats()`` at each scrape, between two steps."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from steerable.outputs import RequestOutput

disable_created_metrics()  # no "_created" series (vLLM does the same)

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0,
                    20.0, 40.0, 80.0)
# (stats key, metric name, help): gauges, then counters
_GAUGES = (("num_running", "steerable:num_requests_running", "Requests in the running batch."),
           ("num_waiting", "steerable:num_requests_waiting", "Requests waiting to be scheduled."),
           ("num_requests", "steerable:num_requests_live", "Requests the engine holds (running, waiting, paused)."),
           ("steering_rows_in_use", "steerable:steering_rows_in_use", "Steering table rows held by live requests."),
           ("steering_configs_in_use", "steerable:steering_configs_in_use",
            "Distinct steering configurations of live requests."),
           ("capture_requests_in_use", "steerable:capture_requests_in_use",
            "Live requests with their own capture spec."),
           ("activation_store_bytes", "steerable:activation_store_bytes",
            "Host bytes of captured prompt rows the activation store holds."))
_COUNTERS = (("prefix_cache_hit_tokens", "steerable:prefix_cache_hits", "Prompt tokens served from the prefix cache."),
             ("prefix_cache_query_tokens", "steerable:prefix_cache_queries",
              "Prompt tokens looked up in the prefix cache."),
             ("capture_rows_total", "steerable:capture_rows", "Captured rows delivered, counted per layer."),
             ("activation_store_hits", "steerable:activation_store_hits",
              "Prompt blocks whose captured rows a request took from the activation store."),
             ("activation_store_misses", "steerable:activation_store_misses",
              "Prompt blocks in the prefix cache whose rows a capture recomputed (not in the activation store)."),
             ("activation_store_evictions", "steerable:activation_store_evictions",
              "Blocks the activation store dropped to stay within its bytes."))


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.prompt_tokens = Counter("steerable:prompt_tokens", "Prompt tokens of finished requests.",
                                     registry=self.registry)
        self.generation_tokens = Counter("steerable:generation_tokens", "Generated tokens of finished requests.",
                                         registry=self.registry)
        self.ttft = Histogram("steerable:time_to_first_token_seconds", "Time to the first generated token.",
                              buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.itl = Histogram("steerable:inter_token_latency_seconds", "Time between generated tokens.",
                             buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.e2e = Histogram("steerable:e2e_request_latency_seconds", "Time from arrival to the last token.",
                             buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.errors = Counter("steerable:request_errors", "Requests answered with an error, by HTTP status.",
                              ["status"], registry=self.registry)
        self._engine = _EngineCollector()
        self.registry.register(self._engine)

    def error(self, status: int) -> None:
        self.errors.labels(status=str(status)).inc()

    def render(self, stats: dict[str, Any] | None) -> bytes:
        """The text exposition; engine metrics come from ``stats`` (omitted when the engine is gone)."""
        self._engine.stats = stats
        return generate_latest(self.registry)


class _EngineCollector:
    stats: dict[str, Any] | None = None

    def collect(self) -> Iterator[Metric]:
        stats = self.stats
        if not stats:
            return
        for key, name, doc in _GAUGES:
            yield GaugeMetricFamily(name, doc, value=stats[key])
        used = stats["num_blocks"] - stats["num_free_blocks"]
        yield GaugeMetricFamily("steerable:kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0-1).",
                                value=used / max(stats["num_blocks"], 1))
        yield GaugeMetricFamily("steerable:kv_blocks_in_use", "KV-cache blocks held by live requests.", value=used)
        for key, name, doc in _COUNTERS:
            yield CounterMetricFamily(name, doc, value=stats[key])


class RequestTimer:
    """Latencies of one engine request from its cumulative outputs, each completion on its own."""

    def __init__(self, metrics: Metrics):
        self.metrics = metrics
        self.start = time.perf_counter()
        self.first: float | None = None
        self.seen: dict[int, tuple[int, float]] = {}  # completion index -> (tokens, time of the last)
        self.last: RequestOutput | None = None

    def update(self, out: RequestOutput) -> None:
        now = time.perf_counter()
        self.last = out
        for completion in out.outputs:
            count, then = self.seen.get(completion.index, (0, self.start))
            new = len(completion.token_ids) - count
            if new <= 0:
                continue
            if self.first is None:
                self.first = now
                self.metrics.ttft.observe(now - self.start)
            elif count:
                for _ in range(new):
                    self.metrics.itl.observe((now - then) / new)
            self.seen[completion.index] = (count + new, now)

    def finish(self) -> None:
        """Count the request once it has ended (finished, aborted or failed)."""
        if self.last is None:
            return
        self.metrics.e2e.observe(time.perf_counter() - self.start)
        self.metrics.prompt_tokens.inc(len(self.last.prompt_token_ids))
        self.metrics.generation_tokens.inc(sum(len(c.token_ids) for c in self.last.outputs))
