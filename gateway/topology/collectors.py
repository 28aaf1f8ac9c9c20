"""The topologies' metrics, computed at scrape time from what they read: a time-shared GPU set's mode and queue, an
in-engine pool's gates."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from crossover.gateway.config import POOL_NAMES
from crossover.gateway.topology.gates import GateSync


class SwitchCollector(Collector):
    """A time-shared GPU set's live state from `source()` -> (the mode that serves or None, requests held); with no
    source (the other topologies) no mode and an empty queue. Registered by the topology (gateway/topology/)."""

    def __init__(self, source: Callable[[], tuple[str | None, int]] | None = None) -> None:
        self.source = source

    def collect(self) -> Iterator[Metric]:
        source = self.source
        mode, queued = source() if source is not None else (None, 0)
        active = GaugeMetricFamily(
            "crossover_active_mode", "1 for the mode a time-shared GPU set serves, else 0.", labels=["mode"]
        )
        if source is not None:
            for name in POOL_NAMES:
                active.add_metric([name], 1.0 if name == mode else 0.0)
        yield active
        yield GaugeMetricFamily(
            "crossover_switch_queued_requests", "Requests held while the GPU set switches modes.", value=queued
        )


class GateCollector(Collector):
    """An in-engine pool's gates at scrape time (gates.py): each backend's as read back, -1 for none
    (never read back, or no gate), and whether it is the live one."""

    def __init__(self, sync: GateSync) -> None:
        self.sync = sync

    def collect(self) -> Iterator[Metric]:
        gate = GaugeMetricFamily(
            "crossover_backend_speculation_gate",
            "Each backend's zero-step gate as read back (batches above it run no draft steps; -1 none).",
            labels=["backend"],
        )
        synced = GaugeMetricFamily(
            "crossover_backend_gate_in_sync", "1 if the backend's gate is the live threshold.", labels=["backend"]
        )
        held = GaugeMetricFamily(
            "crossover_backend_gate_held_out",
            "1 while the backend is out of rotation for its gate (none while one is wanted, or unknown).",
            labels=["backend"],
        )
        moved = CounterMetricFamily(
            "crossover_backend_gate_moved",
            "Gates moved by someone other than the gateways, to another than the cluster's gate (then restored).",
            labels=["backend"],
        )
        errors = CounterMetricFamily(
            "crossover_gate_sync_errors",
            "Gate calls that failed, by kind (unreachable, malformed, refused, unauthorized, fenced, failed).",
            labels=["backend", "kind"],
        )
        for backend in self.sync.pools.speculative:
            read = self.sync.gates.get(backend.url)
            value = read.zero_steps_above_bs if read and read.zero_steps_above_bs is not None else -1
            gate.add_metric([backend.url], value)
            synced.add_metric([backend.url], 1 if self.sync.in_sync(backend) else 0)
            held.add_metric([backend.url], 1 if backend.gate_pending else 0)
            moved.add_metric([backend.url], self.sync.moved[backend.url])
        for (url, kind), count in sorted(self.sync.error_counts.items()):
            errors.add_metric([url, kind], count)
        yield gate
        yield synced
        yield held
        yield moved
        yield errors
