"""Prometheus metrics of one server (its own registry, so tests can run several apps)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from leyline.engine.scheduler import SchedulerStats
from leyline.protocol import LeylineResponse

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "leyline_requests",
            "HTTP requests by route and status",
            ["route", "status"],
            registry=r,
        )
        self.tokens = Counter(
            "leyline_tokens", "Prompt tokens by what happened to them", ["kind"], registry=r
        )
        self.paths = Counter("leyline_paths", "Cache paths taken", ["path"], registry=r)
        self.fallbacks = Counter(
            "leyline_fallbacks", "Fallbacks to re-prefill by reason", ["reason"], registry=r
        )
        self.generated = Counter("leyline_generated_tokens", "Tokens generated", registry=r)
        self.latency = Histogram(
            "leyline_request_seconds",
            "End-to-end request latency",
            ["route"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.ttft = Histogram(
            "leyline_time_to_first_token_seconds",
            "Time to first token (streamed and not)",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.sessions = Gauge("leyline_sessions", "Live sessions", registry=r)
        self.evicted_sessions = Counter(
            "leyline_evicted_sessions", "Idle sessions evicted (LRU)", ["why"], registry=r
        )
        self.cache_bytes = Gauge("leyline_cache_bytes", "Bytes of KV held by sessions", registry=r)
        self.prefix_cache_bytes = Gauge(
            "leyline_prefix_cache_bytes", "Bytes held by the shared prefix cache", registry=r
        )
        self.scheduler = Gauge(
            "leyline_scheduler",
            "Model scheduler counters since start: jobs, slices, decode_steps, decoded_rows "
            "(decoded_rows / decode_steps is the mean decode batch), max_batch",
            ["counter"],
            registry=r,
        )
        self.scheduler_rates = Gauge(
            "leyline_scheduler_seconds",
            "The scheduler's learned model time per job token and per batched decode step "
            "(what turns a job's size into its estimated work left)",
            ["per"],
            registry=r,
        )

        self.cpu_kernels = Gauge(
            "leyline_cpu_kernel",
            "1 where the engine's compiled CPU kernel is on, 0 where it is off "
            "(switched off, no C compiler, failed build: the log says why)",
            ["kernel"],
            registry=r,
        )

    def record_cpu_kernels(self) -> None:
        from leyline.engine import cpu

        for kernel, state in cpu.status().items():
            self.cpu_kernels.labels(kernel).set(1 if state == "on" else 0)

    def record_scheduler(self, stats: SchedulerStats) -> None:
        for name, value in (
            ("jobs", stats.jobs),
            ("slices", stats.slices),
            ("decode_steps", stats.decode_steps),
            ("decoded_rows", stats.decoded_rows),
            ("max_batch", stats.max_batch),
        ):
            self.scheduler.labels(name).set(value)
        self.scheduler_rates.labels("token").set(stats.seconds_per_token)
        self.scheduler_rates.labels("decode_step").set(stats.seconds_per_decode_step)

    def record_cache_op(self, report: LeylineResponse) -> None:
        self.paths.labels(report.path.value).inc()
        self.tokens.labels("reused").inc(report.reused_tokens)
        self.tokens.labels("prefilled").inc(report.prefilled_tokens)
        self.tokens.labels("rotated").inc(report.rotated_tokens)
        if report.fallback_reason is not None:
            self.fallbacks.labels(report.fallback_reason.value).inc()

    def render(self) -> bytes:
        self.record_cpu_kernels()
        return generate_latest(self.registry)
