"""The two pools of backends: in-flight counts, scraped load, and health with a circuit breaker.

Health of one backend (`Backend.healthy`):
- None (never checked) is usable; the first failure marks it unhealthy, the first success healthy.
- A healthy backend is ejected (unhealthy for `eject_seconds`) after `failure_threshold` consecutive
  failures, counting both health checks and requests (connect errors, 5xx, timeouts).
- An ejected backend comes back through a successful health check once its ejection has run out.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from crossover.gateway.config import PLAIN, POOL_NAMES, SPECULATIVE, HealthSettings, Settings
from crossover.gateway.policy import least_loaded

# Scraped engine load older than this many load intervals is ignored (the engine stopped answering).
STALE_AFTER_INTERVALS = 3


@dataclass(eq=False)
class Backend:
    url: str
    pool: str
    inflight: int = 0
    healthy: bool | None = None
    failures: int = 0
    ejected_until: float = 0.0
    scraped: int | None = None
    scraped_at: float = float("-inf")
    models: tuple[str, ...] = ()

    @property
    def usable(self) -> bool:
        return self.healthy is not False

    def state(self) -> dict:
        now = time.monotonic()
        return {
            "url": self.url,
            "healthy": self.healthy,
            "inflight": self.inflight,
            "consecutive_failures": self.failures,
            "ejected_for_s": round(max(0.0, self.ejected_until - now), 3),
            "scraped_load": self.scraped,
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
    _rotation: int = field(default=0, repr=False)

    @classmethod
    def from_settings(cls, settings: Settings) -> Pools:
        return cls(
            speculative=[Backend(url, SPECULATIVE) for url in settings.pools.speculative.backends],
            plain=[Backend(url, PLAIN) for url in settings.pools.plain.backends],
            load_signal=settings.load_signal,
            health=settings.health,
            served_model_names=frozenset(settings.served_model_names),
        )

    def pool(self, name: str) -> list[Backend]:
        return self.speculative if name == SPECULATIVE else self.plain

    def all(self) -> list[Backend]:
        return self.speculative + self.plain

    # -- load -----------------------------------------------------------------------------------

    def backend_load(self, backend: Backend) -> int:
        if self.load_signal == "local":
            return backend.inflight
        fresh = time.monotonic() - backend.scraped_at <= STALE_AFTER_INTERVALS * self.health.load_interval
        scraped = backend.scraped if fresh and backend.scraped is not None else None
        if self.load_signal == "scraped":
            return backend.inflight if scraped is None else scraped
        return max(backend.inflight, scraped or 0)

    def pool_load(self, name: str) -> int:
        return sum(self.backend_load(backend) for backend in self.pool(name))

    def total_load(self) -> int:
        return self.pool_load(SPECULATIVE) + self.pool_load(PLAIN)

    def inflight(self, name: str) -> int:
        return sum(backend.inflight for backend in self.pool(name))

    def choose(self, name: str, exclude: frozenset[Backend] | set[Backend] = frozenset()) -> Backend | None:
        """The usable backend of pool `name` with the least load, not in `exclude`; ties rotate."""
        candidates = [backend for backend in self.pool(name) if backend.usable and backend not in exclude]
        if not candidates:
            return None
        self._rotation += 1
        index = least_loaded([self.backend_load(backend) for backend in candidates], self._rotation)
        return candidates[index] if index is not None else None

    # -- health ---------------------------------------------------------------------------------

    def succeeded(self, backend: Backend, *, probe: bool = False) -> None:
        if probe and time.monotonic() < backend.ejected_until:
            return  # an ejection runs its full time, or a backend that fails requests would flap back
        backend.failures = 0
        backend.ejected_until = 0.0
        backend.healthy = True

    def failed(self, backend: Backend) -> None:
        backend.failures += 1
        if backend.healthy is True and backend.failures >= self.health.failure_threshold:
            backend.ejected_until = time.monotonic() + self.health.eject_seconds
            backend.healthy = False
        elif backend.healthy is None:
            backend.healthy = False

    def any_healthy(self) -> bool:
        return any(backend.healthy for backend in self.all())

    # -- models ---------------------------------------------------------------------------------

    def model_names(self) -> frozenset[str]:
        """Configured names, else what the backends' /v1/models reported (empty while unknown)."""
        if self.served_model_names:
            return self.served_model_names
        return frozenset(name for backend in self.all() for name in backend.models)

    def state(self) -> dict:
        return {
            name: {
                "inflight": self.inflight(name),
                "load": self.pool_load(name),
                "backends": [backend.state() for backend in self.pool(name)],
            }
            for name in POOL_NAMES
        }
