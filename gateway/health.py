"""Background checks: each backend's health, the model names it serves, and (optionally) its engine load.

Engine load is running + queued requests, read from SGLang's `/v1/loads`, or `/get_load` on older
releases, or the `sglang:num_running_reqs` and `sglang:num_queue_reqs` gauges at `/metrics`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable

import httpx
from prometheus_client.parser import text_string_to_metric_families

from crossover.gateway.config import HealthSettings
from crossover.gateway.pools import Backend, Pools

log = logging.getLogger("crossover.health")


def load_from_loads(payload: object) -> int:
    """`/v1/loads` (`{"loads": [rank, ...]}`) or `/get_load` (`[rank, ...]`): running + waiting, summed over ranks."""
    ranks = payload.get("loads", payload) if isinstance(payload, dict) else payload
    if isinstance(ranks, dict):
        ranks = [ranks]
    if not isinstance(ranks, list) or not ranks:
        raise ValueError("no load entries")
    total = 0
    for rank in ranks:
        running = rank.get("num_running_reqs", rank.get("num_reqs"))
        if running is None:
            raise ValueError("no running-request count")
        total += int(running) + int(rank.get("num_waiting_reqs", 0))
    return total


def load_from_metrics(text: str) -> int:
    """Prometheus text: running + queued gauges; TP ranks repeat their DP rank's value, DP ranks add up."""
    by_rank: dict[tuple[str, str], float] = {}
    for family in text_string_to_metric_families(text):
        if family.name not in ("sglang:num_running_reqs", "sglang:num_queue_reqs"):
            continue
        for sample in family.samples:
            key = (family.name, sample.labels.get("dp_rank", "0"))
            by_rank[key] = max(by_rank.get(key, 0.0), sample.value)
    if not by_rank:
        raise ValueError("no sglang:num_running_reqs gauge")
    return int(sum(by_rank.values()))


LOAD_SOURCES: tuple[tuple[str, Callable[[httpx.Response], int]], ...] = (
    ("/v1/loads", lambda response: load_from_loads(response.json())),
    ("/get_load", lambda response: load_from_loads(response.json())),
    ("/metrics", lambda response: load_from_metrics(response.text)),
)


class HealthMonitor:
    def __init__(self, pools: Pools, client: httpx.AsyncClient, settings: HealthSettings, scrape: bool) -> None:
        self.pools = pools
        self.client = client
        self.settings = settings
        self.scrape = scrape
        self._load_source: dict[Backend, int] = {}

    async def run(self) -> None:
        """Check forever (until cancelled): health every `interval`, engine load every `load_interval`."""
        loops = [self._every(self.settings.interval, self.check_all)]
        if self.scrape:
            loops.append(self._every(self.settings.load_interval, self.scrape_all))
        await asyncio.gather(*loops)

    async def _every(self, period: float, step: Callable[[], Awaitable[None]]) -> None:
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
            response = await self.client.get(backend.url + self.settings.path, timeout=self.settings.timeout)
            ok = response.status_code == 200
        except httpx.HTTPError:
            ok = False
        if not ok:
            self.pools.failed(backend)
            return
        self.pools.succeeded(backend, probe=True)
        if backend.healthy and (was_healthy is not True or not backend.models):
            # (Re)learn names when a backend comes (back) up: it may have restarted with another model.
            await self.learn_models(backend)

    async def learn_models(self, backend: Backend) -> None:
        with contextlib.suppress(httpx.HTTPError, ValueError, KeyError, TypeError, AttributeError):
            response = await self.client.get(backend.url + "/v1/models", timeout=self.settings.timeout)
            response.raise_for_status()
            backend.models = tuple(str(entry["id"]) for entry in response.json()["data"])

    async def scrape_all(self) -> None:
        await asyncio.gather(*(self.scrape_load(backend) for backend in self.pools.all()))

    async def scrape_load(self, backend: Backend) -> None:
        first = self._load_source.get(backend, 0)
        for index in [*range(first, len(LOAD_SOURCES)), *range(first)]:
            path, parse = LOAD_SOURCES[index]
            try:
                response = await self.client.get(backend.url + path, timeout=self.settings.timeout)
                response.raise_for_status()
                load = parse(response)
            except (httpx.ConnectError, httpx.TimeoutException):
                return  # the backend itself is unreachable; its load goes stale and routing falls back to local
            except (httpx.HTTPError, ValueError, TypeError, AttributeError):
                continue  # this SGLang release lacks the endpoint or the format: try the next source
            backend.scraped, backend.scraped_at = load, time.monotonic()
            self._load_source[backend] = index
            return
