"""Prometheus metrics of one server (``GET /metrics``, the text exposition format).

Each :class:`ServerMetrics` has its own registry, so several servers in one process (tests) do not
share counters. Generator state (queue depth, running jobs, tokens/s, cache pages) is read from
the generator's published snapshot at scrape time, so it is never stale.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from exl3_core.generator.async_generator import GeneratorStats

#: time-to-first-token histogram buckets (seconds)
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
#: routes counted under their own label; anything else is "other" (bounded label cardinality)
ROUTES = ("/health", "/metrics", "/v1/models", "/v1/completions", "/v1/chat/completions")


class _GeneratorCollector(Collector):
    def __init__(self, stats: Callable[[], GeneratorStats]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        s = self._stats()
        yield GaugeMetricFamily("exl3_queue_depth", "Requests waiting for a slot in the batch", value=s.queued_jobs)
        yield GaugeMetricFamily("exl3_running_requests", "Requests generating now", value=s.active_jobs)
        yield GaugeMetricFamily("exl3_generation_tokens_per_second",
                                "Tokens sampled per second over the last 10 seconds", value=s.tokens_per_s)
        yield CounterMetricFamily("exl3_generation_tokens", "Tokens sampled", value=s.generated_tokens)
        yield CounterMetricFamily("exl3_prompt_tokens", "Prompt tokens of accepted requests", value=s.prompt_tokens)
        yield CounterMetricFamily("exl3_steps", "Generator steps that ran at least one request", value=s.steps)
        yield CounterMetricFamily("exl3_failed_steps", "Generator steps that raised (their requests ended with an "
                                                       "error)", value=s.failed_steps)
        yield CounterMetricFamily("exl3_cancelled_requests", "Requests cancelled while queued or running "
                                                              "(client disconnects, timeouts)", value=s.cancelled)
        yield CounterMetricFamily("exl3_preemptions", "Requests paused for KV-cache space and recomputed later",
                                  value=s.preemptions)
        yield GaugeMetricFamily("exl3_cache_pages", "KV-cache pages", value=s.pages)
        yield GaugeMetricFamily("exl3_cache_pages_in_use", "KV-cache pages held by requests", value=s.pages_in_use)
        yield GaugeMetricFamily("exl3_cache_pages_cached", "Free KV-cache pages kept for prefix reuse",
                                value=s.pages_cached)


class ServerMetrics:
    """The server's registry: HTTP request counts and durations, time to first token, generator state."""

    def __init__(self, stats: Callable[[], GeneratorStats]) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter("exl3_http_requests", "HTTP requests answered", ["route", "status"],
                                registry=self.registry)
        self.duration = Histogram("exl3_http_request_duration_seconds", "Time from request to the end of the response",
                                  ["route"], registry=self.registry)
        self.ttft = Histogram("exl3_time_to_first_token_seconds", "Time from request arrival to its first token",
                              buckets=TTFT_BUCKETS, registry=self.registry)
        self.registry.register(_GeneratorCollector(stats))

    def render(self) -> tuple[bytes, str]:
        """The exposition text and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    @staticmethod
    def route_label(path: str) -> str:
        path = path.rstrip("/") or "/"
        if path in ROUTES:
            return path
        return "/v1/models/{model}" if path.startswith("/v1/models/") else "other"


class MetricsMiddleware:
    """Counts every HTTP response by route and status and times it (ASGI middleware)."""

    def __init__(self, app: ASGIApp, metrics: ServerMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        t0 = time.perf_counter()
        status = 500  # what the server answers when the app raises before responding

        async def observe(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, observe)
        finally:
            route = self.metrics.route_label(scope["path"])
            self.metrics.requests.labels(route, str(status)).inc()
            self.metrics.duration.labels(route).observe(time.perf_counter() - t0)
