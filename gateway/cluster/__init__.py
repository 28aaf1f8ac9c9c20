"""What a gateway's replicas share, whichever way they share it (nothing, Redis, or the workers of one host):
the control state, the lease and its fencing token, the in-flight counts."""

from __future__ import annotations

from crossover.gateway.cluster.collector import ClusterCollector
from crossover.gateway.cluster.coordination import Cluster, Coordination, Solo
from crossover.gateway.cluster.factory import make_coordination
from crossover.gateway.cluster.host import Host, HostPools, HostRegistry, Worker, heartbeat_ms
from crossover.gateway.cluster.store import Control, ModeAnswer, ModeRequest, Store, StoreUnavailable

__all__ = [
    "Cluster",
    "ClusterCollector",
    "Control",
    "Coordination",
    "Host",
    "HostPools",
    "HostRegistry",
    "ModeAnswer",
    "ModeRequest",
    "Solo",
    "Store",
    "StoreUnavailable",
    "Worker",
    "heartbeat_ms",
    "make_coordination",
]
