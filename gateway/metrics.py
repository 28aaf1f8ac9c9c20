"""Prometheus metrics, all in one registry that the caller passes in (tests use a fresh one each).

Counters and histograms are updated per request; gauges (in-flight, threshold, health) are read from
the live state at scrape time, so they can never drift from it.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from crossover.gateway.admission import Admission
from crossover.gateway.backends import LEVEL_NAMES, Pools
from crossover.gateway.config import POOL_NAMES
from crossover.gateway.errors import (  # noqa: F401  (the outcomes: re-exported with the other label values)
    BACKEND_ERROR,
    BAD_REQUEST,
    BUSY,
    CLIENT_DISCONNECT,
    CLIENT_SLOW,
    OK,
    OUTCOMES,
    OVERLOADED,
    SHUTDOWN,
    TIMEOUT,
    UNAUTHORIZED,
    UNAVAILABLE,
)

# LLM requests: first tokens from tens of ms (idle) to minutes (deep queues); whole requests up to the total timeout.
TTFT_BUCKETS_S = (0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
DURATION_BUCKETS_S = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 120, 300, 600, 1800)

# Label value for requests that ended before a pool was chosen (bad input, overload).
NO_POOL = "none"

# How a request ended (the `outcome` label of crossover_requests_total): OUTCOMES, written down in
# gateway/errors.py, where each error carries its own.

# Why an attempt was abandoned before the first byte and the request tried on another backend
# (crossover_failovers_total{reason}); only failures that say nothing about the request fail over.
CONNECT_ERROR = "connect_error"  # nothing reached the backend
BACKEND_UNAVAILABLE = "backend_unavailable"  # HTTP 502/504 from the backend (or a proxy in front of it)
BACKEND_BUSY = "backend_busy"  # HTTP 503/429 from the backend: busy, refused before doing any work
QUEUE_FULL = "queue_full"  # SGLang's error event with code 503 (HTTP 200): "The request queue is full."
FAILOVER_REASONS = (CONNECT_ERROR, BACKEND_UNAVAILABLE, BACKEND_BUSY, QUEUE_FULL)

# Mode switches of a time-shared GPU set: a sleep/wake takes seconds, a restart of a large model minutes.
SWITCH_BUCKETS_S = (0.5, 1, 2.5, 5, 10, 20, 30, 60, 120, 300, 600, 900, 1800)


class RoutingView(Protocol):
    """What the scrape reads of the live routing state (gateway/topology/routing.py's `Routing`)."""

    threshold: int
    hysteresis: int
    spillover_share: float
    state_file_problem: str | None


class Metrics:
    def __init__(self, registry: CollectorRegistry, pools: Pools, routing: RoutingView, admission: Admission) -> None:
        self.registry = registry
        # The five families every request updates are kept as plain numbers (`Tally`, `Spread`), read at scrape.
        self.requests = Tally(
            "crossover_requests", "Requests by pool and outcome.", ("pool", "outcome"), registry=registry
        )
        self.route_decisions = Tally(
            "crossover_route_decisions", "Routing decisions by chosen pool and reason.", ("pool", "reason"), registry
        )
        # Only requests that carry a tier (theirs or their key's): a fixed set of label values (TIERS x pools).
        self.tiers = Tally(
            "crossover_requests_by_tier",
            "Requests with an OpenAI service_tier (their own or their API key's), by tier and the pool that served "
            "them.",
            ("tier", "pool"),
            registry,
        )
        self.ttft = Spread(
            "crossover_time_to_first_token_seconds",
            "Arrival to the first streamed event sent to the client.",
            ("pool",),
            TTFT_BUCKETS_S,
            registry,
        )
        self.duration = Spread(
            "crossover_request_duration_seconds",
            "Arrival to the last byte (or any other end) of a request.",
            ("pool",),
            DURATION_BUCKETS_S,
            registry,
        )
        self.output_tokens = Tally(
            "crossover_output_tokens", "Completion tokens reported in responses' usage.", ("pool",), registry
        )
        self.failovers = Counter(
            "crossover_failovers",
            "Attempts abandoned before the first byte and retried elsewhere.",
            ["reason"],
            registry=registry,
        )
        # Never a resend: nothing was written on them. Many mean backend_keepalive is not below the backends' own
        # idle timeout. (A request once written is never sent again: it may have reached the backend.)
        self.stale_connections = Counter(
            "crossover_backend_stale_connections",
            "Idle backend connections found closed by the backend as a request was about to go on one; dropped "
            "unused, the request went on another.",
            registry=registry,
        )
        self.refused_requests = Counter(
            "crossover_client_requests_refused",
            "Requests refused before they reached the gateway's app: unparsable (invalid_http), a head too large, "
            "a head or body too slow. Logged at debug only.",
            ["reason"],
            registry=registry,
        )
        self.ejections = Counter(
            "crossover_backend_ejections",
            "Backends taken out of rotation, by pool, backend and what decided it (probe or passive).",
            ["pool", "backend", "source"],
            registry=registry,
        )
        self.mode_switches = Counter(
            "crossover_mode_switches",
            "Mode switches of a time-shared GPU set by mechanism, target mode and outcome.",
            ["mechanism", "to", "outcome"],
            registry=registry,
        )
        self.switch_duration = Histogram(
            "crossover_switch_duration_seconds",
            "Decision to verified new mode (drain included), per finished switch, failed ones too.",
            buckets=SWITCH_BUCKETS_S,
            registry=registry,
        )
        self.recoveries = Counter(
            "crossover_switch_recoveries",
            "Recoveries of a time-shared GPU set without an operator (the serving mode died, or none served), "
            "by mechanism and outcome (ok: a mode serves again; unavailable: none does yet).",
            ["mechanism", "outcome"],
            registry=registry,
        )
        self.switch_dropped = Counter(
            "crossover_switch_dropped",
            "Requests a mode switch did not serve: cut at the drain deadline, or refused by the switch queue.",
            ["reason"],
            registry=registry,
        )
        # The live rate table (gateway/backends/rates.py): filled at each request's end, read at scrape.
        self.rates = pools.rates
        registry.register(_StateCollector(pools, routing, admission))
        registry.register(_RateCollector(pools))

    def refused(self, reason: str) -> None:
        self.refused_requests.labels(reason).inc()

    def routed(self, pool: str, reason: str) -> None:
        self.route_decisions.inc((pool, reason))

    def tiered(self, tier: str, pool: str) -> None:
        self.tiers.inc((tier, pool))

    def first_event(self, pool: str, seconds: float) -> None:
        self.ttft.observe((pool,), seconds)

    def request_ended(
        self, pool: str, outcome: str, seconds: float, output_tokens: int, level: int = 0, prompt_tokens: int = 0
    ) -> None:
        """`level`: its backend's in-flight count as it began there; `prompt_tokens`: its usage's (the rate table)."""
        self.requests.inc((pool, outcome))
        self.duration.observe((pool,), seconds)
        if output_tokens:
            self.output_tokens.inc((pool,), output_tokens)
            if outcome == OK:
                self.rates.add(pool, level, prompt_tokens, output_tokens, seconds)


class Tally(Collector):
    """A counter family as a dict of plain numbers, exposed at scrape time: an update is one dict operation,
    where prometheus_client's `labels(...).inc()` takes a lock and runs its checks. For what every request
    updates (the event loop is one thread); it has no `_created` series."""

    def __init__(self, name: str, documentation: str, labelnames: tuple[str, ...], registry: CollectorRegistry):
        self.name, self.documentation, self.labelnames = name, documentation, labelnames
        self.values: dict[tuple[str, ...], float] = {}
        registry.register(self)

    def inc(self, labels: tuple[str, ...], amount: float = 1) -> None:
        self.values[labels] = self.values.get(labels, 0) + amount

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for labels, value in list(self.values.items()):
            family.add_metric(labels, value)
        yield family


class Spread(Collector):
    """A histogram family as plain numbers, as `Tally` is a counter: bucket `le` inclusive, as prometheus_client
    counts."""

    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: tuple[str, ...],
        buckets: tuple[float, ...],
        registry: CollectorRegistry,
    ) -> None:
        self.name, self.documentation, self.labelnames = name, documentation, labelnames
        self.bounds = tuple(float(bound) for bound in buckets)
        self.les = [floatToGoString(bound) for bound in self.bounds] + ["+Inf"]
        self.counts: dict[tuple[str, ...], list[int]] = {}
        self.sums: dict[tuple[str, ...], float] = {}
        registry.register(self)

    def observe(self, labels: tuple[str, ...], value: float) -> None:
        counts = self.counts.get(labels)
        if counts is None:
            counts = self.counts[labels] = [0] * len(self.les)
            self.sums[labels] = 0.0
        counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sums[labels] += value

    def collect(self) -> Iterator[Metric]:
        family = HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for labels, counts in list(self.counts.items()):
            cumulative, buckets = 0, []
            for le, count in zip(self.les, counts, strict=True):
                cumulative += count
                buckets.append((le, cumulative))
            family.add_metric(labels, buckets, self.sums[labels])
        yield family


class _StateCollector(Collector):
    def __init__(self, pools: Pools, routing: RoutingView, admission: Admission) -> None:
        self.pools = pools
        self.routing = routing
        self.admission = admission

    def collect(self) -> Iterator[Metric]:
        inflight = GaugeMetricFamily("crossover_inflight_requests", "Requests in flight by pool.", labels=["pool"])
        for name in POOL_NAMES:
            inflight.add_metric([name], self.pools.inflight(name))
        yield inflight
        yield GaugeMetricFamily(
            "crossover_admission_queued_requests",
            "Requests waiting for one of max_inflight slots.",
            value=self.admission.queued,
        )
        yield GaugeMetricFamily("crossover_routing_threshold", "Live routing threshold.", value=self.routing.threshold)
        yield GaugeMetricFamily(
            "crossover_routing_hysteresis", "Live hysteresis of the switch policy.", value=self.routing.hysteresis
        )
        yield GaugeMetricFamily(
            "crossover_routing_spillover_share",
            "Live share of the requests in flight the speculative pool takes above the threshold (spillover).",
            value=self.routing.spillover_share,
        )
        yield GaugeMetricFamily(
            "crossover_state_file_problem",
            "1 while the state file could not be restored at start (the configured threshold serves) or the last "
            "save failed; /admin/state says why.",
            value=1.0 if self.routing.state_file_problem else 0.0,
        )
        healthy = GaugeMetricFamily(
            "crossover_backend_healthy", "1 if the backend is known healthy.", labels=["pool", "backend"]
        )
        backend_inflight = GaugeMetricFamily(
            "crossover_backend_inflight_requests", "Requests in flight by backend.", labels=["pool", "backend"]
        )
        scraped = GaugeMetricFamily(
            "crossover_backend_scraped_load",
            "Running + queued requests the engine last reported.",
            labels=["pool", "backend"],
        )
        accept = GaugeMetricFamily(
            "crossover_backend_accept_length",
            "Tokens per speculative verify step (the bonus token included) the engine last reported: SGLang's "
            "sglang:spec_accept_length, vLLM's 1 + accepted / drafts between two scrapes. Only backends reporting it.",
            labels=["pool", "backend"],
        )
        for backend in self.pools.all():
            labels = [backend.pool, backend.url]
            healthy.add_metric(labels, 1.0 if backend.healthy else 0.0)
            backend_inflight.add_metric(labels, self.pools.count(backend))
            if backend.scraped is not None:
                scraped.add_metric(labels, backend.scraped)
            accept_length = self.pools.accept_length(backend)
            if accept_length is not None:
                accept.add_metric(labels, accept_length)
        yield healthy
        yield backend_inflight
        yield scraped
        yield accept


class _RateCollector(Collector):
    """The rate table's sums by pool and level (over prompt lengths): `rate(tokens) / rate(seconds)` is the per-stream
    tokens/s at that level over any window, added up over a host's workers (counters sum; a ratio would not)."""

    def __init__(self, pools: Pools) -> None:
        self.rates = pools.rates

    def collect(self) -> Iterator[Metric]:
        labels = ["pool", "level"]
        requests = CounterMetricFamily(
            "crossover_pool_stream_requests",
            "Requests that ended well with a usage count, by pool and in-flight level on their backend as they began.",
            labels=labels,
        )
        tokens = CounterMetricFamily(
            "crossover_pool_stream_tokens", "Their completion tokens, by pool and level.", labels=labels
        )
        seconds = CounterMetricFamily(
            "crossover_pool_stream_seconds",
            "Their durations (arrival to last byte) added up, by pool and level: tokens / seconds is the per-stream "
            "rate at that level.",
            labels=labels,
        )
        for pool in POOL_NAMES:
            for level, (count, total, duration) in zip(LEVEL_NAMES, self.rates.by_level(pool), strict=True):
                if count:
                    requests.add_metric([pool, level], count)
                    tokens.add_metric([pool, level], total)
                    seconds.add_metric([pool, level], duration)
        yield requests
        yield tokens
        yield seconds
