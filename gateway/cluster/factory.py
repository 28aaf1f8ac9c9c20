"""`make_coordination`: a gateway's place in its cluster, from its settings (none, Redis, or its host's workers)."""

from __future__ import annotations

from crossover.gateway.backends import Pools
from crossover.gateway.cluster.coordination import Cluster, Coordination, Solo
from crossover.gateway.cluster.host import Worker
from crossover.gateway.cluster.store import Store
from crossover.gateway.config import Settings


def make_coordination(settings: Settings, pools: Pools, worker: Worker | None = None) -> Coordination:
    """Solo without a cluster; else the Redis-backed cluster (the `redis` package: `pip install crossover[cluster]`).
    One of a host's workers (gateway/cluster/host.py) is a member too: of the Redis cluster if there is one, else of its
    host's (gateway/cluster/host_store.py); either way the in-flight counts it publishes are its host's."""
    cluster = settings.cluster
    if cluster.redis_url:
        try:
            from crossover.gateway.cluster.redis_store import RedisStore  # only a cluster needs the optional package
        except ImportError as exc:
            needs = "[cluster] redis_url needs the redis package: pip install 'crossover[cluster]'"
            raise ImportError(f"{needs} ({exc})") from None

        timeout_s = min(cluster.lease / 3, 2.0)  # a call that takes longer leaves no room to renew the lease
        store: Store = RedisStore(cluster.redis_url, cluster.name, timeout_s=timeout_s, key=cluster.key)
    elif worker is not None:
        from crossover.gateway.cluster.host_store import HostStore

        store = HostStore(worker)
    else:
        return Solo()
    counted_as = worker.host.member if worker is not None else None
    return Cluster(store, pools, lease_s=cluster.lease, interval_s=cluster.sync_interval, counted_as=counted_as)
