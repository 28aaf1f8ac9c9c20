"""Whether each backend may take traffic (the breaker), and the checks that tell: health probes, the
model names each backend serves, and (optionally) its engine load.

The breaker follows Envoy's outlier detection. A backend's `healthy` is None (never checked: usable),
True or False (ejected until `ejected_until`, then back through a passing probe). Evidence comes from:
- probes (`/health`, SGLang's runs a 1-token generation): a periodic probe ejects after `failure_threshold`
  consecutive failures; a probe triggered by a suspicious request decides at once;
- passive failures of the backend's kind (gateway/request/failover.py classifies them): each triggers a probe at
  once, and after `failure_threshold` in a row they eject by themselves - but only while that keeps the
  pool's passively ejected share within `max_ejection_percent` and never its last healthy backend. A
  failure that was the request's, or the gateway's own, is never evidence.

Engine load is running + queued requests, read where the backend's engine reports it (gateway/engines/adapters.py:
SGLang's `/v1/loads`, `/get_load` or `/metrics`; vLLM's `/metrics`). A speculative backend's acceptance is read from
its `/metrics` on the same schedule (every `load_interval`, within the health timeout) wherever load is scraped
(`load_signal` scraped or max) or something asks for it: from the load scrape's own answer where that was
`/metrics`, else with one GET of it. With the default local load signal, nothing extra is asked of the engines.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable

import httpx

from crossover.gateway.backends.pools import Backend, Pools
from crossover.gateway.config import SPECULATIVE, HealthSettings
from crossover.gateway.engines import METRICS_PATH, adapter
from crossover.gateway.wire import bearer

log = logging.getLogger("crossover.health")

PROBE = "probe"
PASSIVE = "passive"


class Breaker:
    """Takes backends out of rotation and brings them back; see the module docstring for the rules."""

    def __init__(
        self,
        pools: Pools,
        settings: HealthSettings,
        on_eject: Callable[[Backend, str], None] = lambda backend, source: None,
        probe: Callable[[Backend], None] = lambda backend: None,
    ) -> None:
        self.pools = pools
        self.settings = settings
        self.on_eject = on_eject
        # Probe this backend now (the HealthMonitor's, which made this breaker; a no-op if one is under way).
        self.probe = probe
        self.suspects: set[Backend] = set()
        # Backends put out of service on purpose (the mode a time-shared GPU set does not serve): their failed
        # probes are expected, not ejections - no warning, no ejection counted.
        self.resting: set[Backend] = set()

    def rest(self, backend: Backend) -> None:
        self.resting.add(backend)
        self.suspects.discard(backend)
        backend.healthy = False

    def wake(self, backend: Backend) -> None:
        """Back in service (it just generated): any failure from its off time is forgotten."""
        self.resting.discard(backend)
        self.succeeded(backend)

    def succeeded(self, backend: Backend, *, probe: bool = False) -> None:
        if probe:
            self.suspects.discard(backend)
            if time.monotonic() < backend.ejected_until:
                return  # an ejection runs its full time, or a backend that fails requests would flap back
        if backend.failures or backend.healthy is not True:
            backend.failures = 0
            backend.ejected_until = 0.0
            backend.healthy = True

    def failed_probe(self, backend: Backend) -> None:
        backend.failures += 1
        if backend in self.resting:
            backend.healthy = False
            return
        decisive = backend in self.suspects  # a probe asked for by a failed request decides at once
        self.suspects.discard(backend)
        if backend.healthy is None:
            backend.healthy = False
        elif backend.healthy and (decisive or backend.failures >= self.settings.failure_threshold):
            self._eject(backend, PROBE)

    def failed_passively(self, backend: Backend) -> None:
        backend.failures += 1
        if backend.gate_read_outages is not None:
            # In-engine: a backend that fails a request may be restarting, and comes back on its start-up gate -
            # maybe before any probe sees it down, and the last of a pool is never ejected: hold it out until its
            # gate is read again (gateway/topology/gates.py reads it at once).
            backend.outages += 1
        if (
            backend.healthy is not False
            and backend.failures >= self.settings.failure_threshold
            and self._may_eject(backend)
        ):
            self._eject(backend, PASSIVE)
        self.check_soon(backend)

    def check_soon(self, backend: Backend) -> None:
        """Something looked wrong: let a probe decide, now rather than at the next interval."""
        self.suspects.add(backend)
        self.probe(backend)

    def _may_eject(self, backend: Backend) -> bool:
        pool = self.pools.pool(backend.pool)
        usable = [other for other in pool if other.usable and other is not backend]
        if not usable:
            return False  # never the last: a request that fails everywhere must not take its pool down
        ejected = sum(1 for other in pool if other.healthy is False) + 1
        return ejected * 100 <= self.settings.max_ejection_percent * len(pool)

    def _eject(self, backend: Backend, source: str) -> None:
        backend.healthy = False
        backend.ejected_until = time.monotonic() + self.settings.eject_seconds
        backend.outages += 1
        log.warning("ejected backend %s (%s) for %g s", backend.url, source, self.settings.eject_seconds)
        self.on_eject(backend, source)


class HealthMonitor:
    """Probes every backend on a schedule, and any one at once when its breaker asks.

    monitor = HealthMonitor(pools, client, settings.health, scrape=False, on_eject=count)
    monitor.breaker                 # what failover and the switch controller report to
    await monitor.check_all(); task = asyncio.create_task(monitor.run())   # the app's lifespan
    monitor.stop()                  # no more probes on request
    """

    def __init__(
        self,
        pools: Pools,
        client: httpx.AsyncClient,
        settings: HealthSettings,
        scrape: bool,
        on_eject: Callable[[Backend, str], None] = lambda backend, source: None,
        *,
        acceptance: bool = False,
    ) -> None:
        self.pools = pools
        # The breaker asks this monitor for probes: made here, so neither is wired to the other afterwards.
        self.breaker = Breaker(pools, settings, on_eject, probe=self.probe_now)
        self.client = client
        self.settings = settings
        self.scrape = scrape
        # Read the speculative backends' acceptance: beside a load scrape, or where something needs it without one.
        self.acceptance = scrape or acceptance
        self._load_source: dict[Backend, int] = {}
        self._probing: dict[Backend, asyncio.Task] = {}
        self._stopped = False

    def stop(self) -> None:
        """At shutdown: the probes under way end, and none starts on request."""
        self._stopped = True
        for task in self._probing.values():
            task.cancel()

    def probe_now(self, backend: Backend) -> None:
        """On the serving event loop (the breaker asks while a request fails)."""
        if not self._stopped and backend not in self._probing:
            task = asyncio.get_running_loop().create_task(self.check(backend))
            self._probing[backend] = task
            task.add_done_callback(lambda _: self._probing.pop(backend, None))

    async def run(self) -> None:
        """Check forever (until cancelled): health every `interval`, engine load every `load_interval`. The first
        health round is the caller's (`check_all` before serving): repeating it at once would hold the pooled
        connections it left while the first requests want them, for nothing learned."""
        loops = [self._every(self.settings.interval, self.check_all, first_after=self.settings.interval)]
        if self.scrape or (self.acceptance and self.pools.speculative):
            loops.append(self._every(self.settings.load_interval, self.scrape_all))
        await asyncio.gather(*loops)

    async def _every(self, period: float, step: Callable[[], Awaitable[None]], first_after: float = 0.0) -> None:
        await asyncio.sleep(first_after)
        while True:
            started = time.monotonic()
            try:
                await step()
            except Exception:  # a bug in one round must not end the checks for the gateway's lifetime
                log.exception("background check failed")
            await asyncio.sleep(max(0.0, period - (time.monotonic() - started)))

    async def check_all(self) -> None:
        await asyncio.gather(*(self.check(backend) for backend in self.pools.all()))

    async def check(self, backend: Backend) -> None:
        was_healthy = backend.healthy
        try:
            response = await self.client.get(
                backend.url + self.settings.path, timeout=self.settings.timeout, headers=bearer(backend.api_key)
            )
            ok = response.status_code == 200
        except httpx.HTTPError:
            ok = False
        if not ok:
            self.breaker.failed_probe(backend)
            return
        self.breaker.succeeded(backend, probe=True)
        if backend.healthy and (was_healthy is not True or not backend.models):
            # (Re)learn names when a backend comes (back) up: it may have restarted with another model.
            await self.learn_models(backend)

    async def learn_models(self, backend: Backend) -> None:
        with contextlib.suppress(httpx.HTTPError, ValueError, KeyError, TypeError, AttributeError):
            response = await self.client.get(
                backend.url + "/v1/models", timeout=self.settings.timeout, headers=bearer(backend.api_key)
            )
            response.raise_for_status()
            self.pools.learned_models(backend, tuple(str(entry["id"]) for entry in response.json()["data"]))

    async def scrape_all(self) -> None:
        await asyncio.gather(*(self.scrape_backend(backend) for backend in self.pools.all()))

    async def scrape_backend(self, backend: Backend) -> None:
        """Its load (when routing reads scraped load) and, on a speculative backend, its acceptance."""
        reachable, metrics = await self.scrape_load(backend) if self.scrape else (True, None)
        if backend.pool != SPECULATIVE or not reachable or not self.acceptance:
            return
        if metrics is None:
            try:
                response = await self.client.get(
                    backend.url + METRICS_PATH, timeout=self.settings.timeout, headers=bearer(backend.api_key)
                )
                response.raise_for_status()
            except httpx.HTTPError:
                return  # the last reading goes stale
            metrics = response.text
        self.read_acceptance(backend, metrics)

    def read_acceptance(self, backend: Backend, metrics: str) -> None:
        try:
            reading = adapter(backend.engine).acceptance(metrics, backend.acceptance)
        except (ValueError, TypeError, AttributeError):
            return  # not Prometheus text: the last reading goes stale
        backend.acceptance = reading
        if reading is not None:
            backend.acceptance_at = time.monotonic()

    async def scrape_load(self, backend: Backend) -> tuple[bool, str | None]:
        """(whether the backend answered, its /metrics text if that is where the load was read)."""
        sources = adapter(backend.engine).load_sources
        first = self._load_source.get(backend, 0)
        for index in [*range(first, len(sources)), *range(first)]:
            source = sources[index]
            try:
                response = await self.client.get(
                    backend.url + source.path, timeout=self.settings.timeout, headers=bearer(backend.api_key)
                )
                response.raise_for_status()
                load = source.parse(response)
            except (httpx.ConnectError, httpx.TimeoutException):
                return False, None  # the backend is unreachable; its load goes stale, routing falls back to local
            except (httpx.HTTPError, ValueError, TypeError, AttributeError):
                continue  # this engine release lacks the endpoint or the format: try the next source
            backend.scraped, backend.scraped_at = load, time.monotonic()
            self._load_source[backend] = index
            return True, response.text if source.path == METRICS_PATH else None
        return True, None
