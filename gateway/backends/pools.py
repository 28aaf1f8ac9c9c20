"""The two pools of backends: in-flight counts (leases), scraped load, and the least-loaded choice.

    with pools.lease(backend):          # counts one request in flight on `backend` until the block ends
        ...

Whether a backend may take traffic (`Backend.healthy`) is the breaker's business: gateway/backends/health.py.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from crossover.gateway.backends.rates import RateTable
from crossover.gateway.config import PLAIN, POOL_NAMES, SPECULATIVE, HealthSettings, Settings
from crossover.gateway.engines import DEFAULT_ENGINE, EngineName, SpecReading
from crossover.gateway.modes import other as other_mode
from crossover.gateway.policies import least_loaded

# Scraped engine load older than this many load intervals is ignored (the engine stopped answering).
STALE_AFTER_INTERVALS = 3


@dataclass(eq=False)
class Backend:
    url: str
    pool: str
    # Sent to the backend as a bearer token instead of the client's credentials (SGLang's --api-key).
    api_key: str | None = None
    # Which engine serves it (gateway/engines/adapters.py): where its load is read, how it sleeps.
    engine: EngineName = DEFAULT_ENGINE
    inflight: int = 0
    healthy: bool | None = None
    failures: int = 0
    ejected_until: float = 0.0
    scraped: int | None = None
    scraped_at: float = float("-inf")
    # Its speculative acceptance as its /metrics last said (gateway/backends/health.py reads it), and when.
    acceptance: SpecReading | None = None
    acceptance_at: float = float("-inf")
    models: tuple[str, ...] = ()
    # In-engine topology: held out until its speculation gate is the gateway's again (gateway/topology/gates.py).
    gate_pending: bool = False
    # Times it may have restarted: the breaker ejected it, or (in-engine) it failed a request
    # (gateway/backends/health.py).
    outages: int = 0
    # In-engine: `outages` as of the gate's last read-back. An outage since then (a restart: it comes back on its
    # start-up gate) holds it out until the gate is read again, whenever the probes bring it back. None: no gate to
    # check (the other topologies).
    gate_read_outages: int | None = None
    # In flight on it through the other members of the cluster (gateway/cluster/coordination.py), as they last
    # published.
    elsewhere: int = 0

    @property
    def usable(self) -> bool:
        return self.healthy is not False and not self.gate_pending and self.gate_read_outages in (None, self.outages)

    def state(self, inflight: int, accept_length: float | None = None) -> dict:
        now = time.monotonic()
        return {
            "url": self.url,
            "engine": self.engine,
            "healthy": self.healthy,
            "inflight": inflight,
            "consecutive_failures": self.failures,
            "ejected_for_s": round(max(0.0, self.ejected_until - now), 3),
            "scraped_load": self.scraped,
            "accept_length": None if accept_length is None else round(accept_length, 4),
            "models": list(self.models),
        }


@dataclass
class Pools:
    """Both pools' backends and the one load signal routing reads."""

    speculative: list[Backend]
    plain: list[Backend]
    load_signal: str
    health: HealthSettings
    served_model_names: frozenset[str] = frozenset()
    # What the requests each pool served delivered, by load and prompt length (gateway/backends/rates.py).
    rates: RateTable = field(default_factory=RateTable)
    _rotation: int = field(default=0, repr=False)
    _names: frozenset[str] = field(default=frozenset(), repr=False)

    @classmethod
    def from_settings(cls, settings: Settings, **extra) -> Pools:
        spec, plain = settings.pools.speculative, settings.pools.plain
        return cls(
            speculative=[Backend(url, SPECULATIVE, spec.api_key or None, spec.engine) for url in spec.backends],
            # In-engine: one pool (config.py); the plain one stays empty and routing never chooses it.
            plain=[Backend(url, PLAIN, plain.api_key or None, plain.engine) for url in plain.backends] if plain else [],
            load_signal=settings.load_signal,
            health=settings.health,
            served_model_names=frozenset(settings.served_model_names),
            **extra,
        )

    def pool(self, name: str) -> list[Backend]:
        return self.speculative if name == SPECULATIVE else self.plain

    def all(self) -> list[Backend]:
        return self.speculative + self.plain

    other = staticmethod(other_mode)

    def lease(self, backend: Backend) -> Lease:
        return Lease(backend)

    # -- load -----------------------------------------------------------------------------------

    def count(self, backend: Backend) -> int:
        """Requests in flight on `backend` through this gateway (a host's workers: all of theirs,
        gateway/cluster/host.py)."""
        return backend.inflight

    def backend_load(self, backend: Backend) -> int:
        counted = self.count(backend) + backend.elsewhere
        if self.load_signal == "local":
            return counted
        fresh = time.monotonic() - backend.scraped_at <= STALE_AFTER_INTERVALS * self.health.load_interval
        scraped = backend.scraped if fresh and backend.scraped is not None else None
        if self.load_signal == "scraped":
            return counted if scraped is None else scraped
        return max(counted, scraped or 0)

    def accept_length(self, backend: Backend) -> float | None:
        """Its speculative acceptance as last read, unless the reading is stale (as scraped load goes stale)."""
        reading = backend.acceptance
        stale_after = STALE_AFTER_INTERVALS * self.health.load_interval
        if reading is None or time.monotonic() - backend.acceptance_at > stale_after:
            return None
        return reading.accept_length

    def pool_load(self, name: str) -> int:
        pool = self.pool(name)
        if self.load_signal == "local":  # the default, asked once per request: no call per backend
            load = 0
            for backend in pool:
                load += backend.inflight + backend.elsewhere
            return load
        return sum([self.backend_load(backend) for backend in pool])

    def total_load(self) -> int:
        return self.pool_load(SPECULATIVE) + self.pool_load(PLAIN)

    def inflight(self, name: str) -> int:
        return sum(self.count(backend) for backend in self.pool(name))

    def elsewhere(self, name: str) -> int:
        """In flight on pool `name` through the cluster's other members."""
        return sum(backend.elsewhere for backend in self.pool(name))

    def choose(
        self, name: str, exclude: frozenset[Backend] | set[Backend] = frozenset(), turn: bool = True
    ) -> Backend | None:
        """The usable backend of pool `name` with the least load, not in `exclude`; ties rotate (`turn=False`:
        the choice is only looked at, and `turn()` makes it)."""
        pool = self.pool(name)
        if len(pool) == 1:  # the usual pool: nothing to compare
            only = pool[0]
            return only if only.usable and only not in exclude else None
        candidates = [backend for backend in pool if backend.usable and backend not in exclude]
        if not candidates:
            return None
        index = least_loaded([self.backend_load(backend) for backend in candidates], self._rotation + 1)
        if turn:
            self.turn()
        return candidates[index] if index is not None else None

    def turn(self) -> None:
        """The next tie goes to the next backend."""
        self._rotation += 1

    def usable(self, name: str) -> bool:
        """Whether pool `name` has a backend that may take traffic now."""
        return any(backend.usable for backend in self.pool(name))

    def any_healthy(self) -> bool:
        return any(backend.healthy for backend in self.all())

    # -- models ---------------------------------------------------------------------------------

    def model_names(self) -> frozenset[str]:
        """Configured names, else what the backends' /v1/models reported (empty while unknown)."""
        return self.served_model_names or self._names

    def learned_models(self, backend: Backend, models: tuple[str, ...]) -> None:
        """What `backend`'s /v1/models reported: the names requests are checked against follow at once (they are
        asked for once per request, and change only here)."""
        backend.models = models
        self._names = frozenset(name for each in self.all() for name in each.models)

    def state(self) -> dict:
        return {
            name: {
                "inflight": self.inflight(name),
                "load": self.pool_load(name),
                "backends": [
                    backend.state(self.count(backend), self.accept_length(backend)) for backend in self.pool(name)
                ],
                "rate_table": self.rates.state(name),
            }
            for name in POOL_NAMES
        }


class Lease:
    """One request in flight on a backend, from the attempt until its last byte: `release` (or the end of a
    `with` block) gives it back, once, however the request ended. `level`: the backend's in-flight count as it
    began, itself included (the rate table's load, gateway/backends/rates.py)."""

    __slots__ = ("backend", "level")

    def __init__(self, backend: Backend) -> None:
        level = backend.inflight = backend.inflight + 1
        self.backend: Backend | None = backend
        self.level = level

    def release(self) -> None:
        if self.backend is not None:
            self.backend.inflight -= 1
            self.backend = None

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()
