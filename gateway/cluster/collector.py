"""The cluster's metrics at scrape time: this replica's place in it."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from crossover.gateway.cluster.coordination import Coordination


class ClusterCollector(Collector):
    """This replica's place in its cluster (gateway/cluster/coordination.py) at scrape time; without a cluster,
    connected and leader, as a gateway alone is."""

    def __init__(self, coordination: Coordination) -> None:
        self.coordination = coordination

    def collect(self) -> Iterator[Metric]:
        coordination = self.coordination
        yield GaugeMetricFamily(
            "crossover_cluster_connected",
            "1 while the cluster's shared state is reachable (else: serving on the last state seen, no switch starts).",
            value=1 if coordination.connected else 0,
        )
        yield GaugeMetricFamily(
            "crossover_cluster_leader",
            "1 while this replica holds the lease that lets it act on the GPU set.",
            value=1 if coordination.leader else 0,
        )
        yield CounterMetricFamily(
            "crossover_cluster_fenced",
            "Times this replica stepped down because a resource refused its fencing token.",
            value=coordination.fenced,
        )
