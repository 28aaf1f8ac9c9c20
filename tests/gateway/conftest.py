"""Fixtures: a real gateway on uvicorn (in a thread) in front of real stand-ins (subprocesses).

- `gateway(speculative=[urls], plain=[urls], **settings)` -> RunningGateway (started, first health round done),
  on `crossover serve`'s client protocol, or on plain uvicorn with `plain_uvicorn=True`
- `lane_serve`, `lane_gateway`: `serve` and `gateway` keeping pooled connections for the direct lane; `lanes`: what
  the direct lane answered each request
- `sims` -> (k25-eagle3, k25-plain) stand-ins, ready
- `gateway_process(toml, env=None)` -> `crossover serve --config FILE` in its own process, ready
- `redis_server` -> a real redis-server on a free loopback port, one per test module (tests/gateway/cluster_helpers.py)
- `without_cyclic_collector`: only reference counting frees memory during the test, so what a test finds still there
  once let go is in a reference cycle
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from crossover.gateway.app import create_app
from crossover.gateway.config import Settings
from crossover.gateway.request.inline import InlineExchange
from crossover.gateway.serve.server import protocol_options
from crossover.servers.process import free_port, spawn, stop, wait_ready
from tests.gateway.cluster_helpers import RedisServer
from tests.gateway.gateway_helpers import SIM_SCALE, WAIT_S, RunningGateway


@pytest.fixture
def gateway(serve):
    """On the client protocol `crossover serve` uses; `plain_uvicorn=True` runs the app as any ASGI server would."""

    def start(
        speculative: list[str],
        plain: list[str],
        transport=None,
        plain_uvicorn: bool = False,
        tracing=None,
        **overrides,
    ) -> RunningGateway:
        overrides.setdefault("health", {"interval": 0.5, "timeout": 2.0})
        overrides.setdefault("pools", {"speculative": {"backends": speculative}, "plain": {"backends": plain}})
        settings = Settings(**overrides)
        registry = CollectorRegistry()
        app = create_app(settings, registry=registry, transport=transport, tracing=tracing)
        server = serve(app, **({} if plain_uvicorn else protocol_options(settings, app)))
        return RunningGateway(server.url, app, registry, settings, server.server)

    return start


@pytest.fixture
def lane_serve(serve):
    """`serve` for the direct lane's tests: backends that keep an idle connection open long after a busy machine
    gets round to the test's request."""
    return lambda app, **config: serve(app, **{"timeout_keep_alive": 60, **config})


@pytest.fixture
def lane_gateway(gateway):
    """`gateway` for the direct lane's tests. The lane sends only on a pooled connection: the gateway keeps the
    first health round's as long (the default expiry is 2 s, which a busy machine may take between starting the
    gateway and sending a request)."""

    def start(*args, **overrides):
        overrides["timeouts"] = {"backend_keepalive": 60, **overrides.get("timeouts", {})}
        return gateway(*args, **overrides)

    return start


@pytest.fixture
def lanes(monkeypatch):
    """What `InlineExchange.offer` answered, request by request; `lanes.off = True` makes it decline all."""

    class Lanes(list):
        off = False

    answers = Lanes()
    offer = InlineExchange.offer

    def spy(endpoint, scope, body: bytes, link) -> bool:
        answers.append(False if answers.off else offer(endpoint, scope, body, link))
        return answers[-1]

    monkeypatch.setattr(InlineExchange, "offer", spy)
    return answers


@pytest.fixture
def sims(sim):
    """A k25-eagle3 and a k25-plain stand-in: (speculative, plain)."""
    return sim("k25-eagle3", *SIM_SCALE), sim("k25-plain", *SIM_SCALE)


@dataclass
class GatewayProcess:
    url: str
    port: int
    proc: subprocess.Popen
    log_path: Path

    def metrics(self) -> dict[tuple[str, tuple], float]:
        """Every sample of /metrics: {(name, sorted label pairs): value}."""
        text = httpx.get(self.url + "/metrics", timeout=10, trust_env=False).text
        return {
            (sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
        }

    def log(self) -> str:
        """What the gateway wrote to stdout and stderr so far."""
        return self.log_path.read_text(errors="replace")

    def rss_bytes(self) -> int:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise AssertionError("no VmRSS")


@pytest.fixture
def gateway_process(tmp_path):
    """`crossover serve --config FILE` as a subprocess: `gateway_process(toml_text)` -> GatewayProcess (ready).
    `nofile=N` runs it under `ulimit -n N`."""
    started: list[subprocess.Popen] = []

    def start(config: str, env: dict[str, str] | None = None, nofile: int | None = None) -> GatewayProcess:
        port = free_port()
        path = tmp_path / f"gateway-{port}.toml"
        path.write_text(f'port = {port}\nlog_level = "warning"\n{config}')
        argv = [sys.executable, "-m", "crossover.gateway.cli", "serve", "--config", str(path)]
        if nofile is not None:
            argv = ["prlimit", f"--nofile={nofile}:{nofile}", *argv]
        env = dict(env or {})
        if "shutdown_delay" not in config:  # no load balancer to warn here: stop at once unless a test says
            env.setdefault("CROSSOVER_TIMEOUTS__SHUTDOWN_DELAY", "0")
        log_path = tmp_path / f"gateway-{port}.log"
        with log_path.open("wb") as log:
            proc = spawn(
                argv, die_with_parent=False, env={**os.environ, **(env or {})}, stdout=log, stderr=subprocess.STDOUT
            )
        started.append(proc)
        url = f"http://127.0.0.1:{port}"
        wait_ready(url + "/health", proc, WAIT_S)
        return GatewayProcess(url, port, proc, log_path)

    yield start
    stop(started, timeout=30)


@pytest.fixture
def without_cyclic_collector():
    """As nearly always under `crossover serve`, whose collector runs seldom (gateway/serve/server.py's
    GC_THRESHOLDS): an object in a cycle outlives its request there, holding its memory."""
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    yield
    if enabled:
        gc.enable()


@pytest.fixture(scope="module")
def redis_server():
    server = RedisServer.start()
    yield server
    server.stop()
