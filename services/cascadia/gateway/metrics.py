"""Prometheus metrics of one gateway (its own registry, so several apps can live in one process)."""

from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


@dataclass
class GatewayMetrics:
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)

    def __post_init__(self) -> None:
        r = self.registry
        self.requests = Counter(
            "cascadia_requests", "Requests by endpoint and HTTP status.", ["endpoint", "status"], registry=r
        )
        self.prompt_tokens = Counter("cascadia_prompt_tokens", "Prompt tokens of served requests.", registry=r)
        self.completion_tokens = Counter("cascadia_completion_tokens", "Tokens generated.", registry=r)
        self.cached_prompt_tokens = Counter(
            "cascadia_cached_prompt_tokens",
            "Prompt tokens whose positions a finished stream's state held (not computed again).",
            registry=r,
        )
        self.ttft = Histogram(
            "cascadia_time_to_first_token_seconds",
            "From request to its first token.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "cascadia_inter_token_latency_seconds",
            "Between consecutive tokens of a request.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.errors = Counter("cascadia_errors", "Failed requests by kind.", ["kind"], registry=r)
        self.in_flight = Gauge("cascadia_requests_in_flight", "Requests being served by this gateway.", registry=r)
        self.background_runs = Gauge(
            "cascadia_background_responses", "Background responses this gateway is generating.", registry=r
        )
        self.queue_depth = Gauge(
            "cascadia_router_queue_depth", "Requests waiting in the router for admission.", registry=r
        )
        self.active_streams = Gauge("cascadia_router_active_streams", "Streams admitted by the router.", registry=r)
        self.kept_streams = Gauge(
            "cascadia_router_kept_streams",
            "Finished streams and shared prefixes whose state the stages keep for prompts that start alike.",
            registry=r,
        )
        self.shared_prefixes = Gauge(
            "cascadia_router_shared_prefixes",
            "Kept copies of the prefixes prompts share (a system message), counted in the kept streams too.",
            registry=r,
        )
