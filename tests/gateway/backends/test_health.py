"""Background checks: ejecting and restoring backends, and engine load as a routing signal."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from crossover.gateway.backends.health import PASSIVE, PROBE, Breaker, HealthMonitor
from crossover.gateway.backends.pools import Backend, Pools
from crossover.gateway.config import HealthSettings, Settings
from crossover.gateway.engines.sglang import load_from_loads, load_from_metrics
from tests.gateway.gateway_helpers import LONG, MODEL, SIM_SCALE, chat, wait_until

SGLANG_METRICS = """\
# HELP sglang:num_running_reqs The number of running requests.
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{dp_rank="0",model_name="m",tp_rank="0"} 3.0
sglang:num_running_reqs{dp_rank="0",model_name="m",tp_rank="1"} 3.0
sglang:num_running_reqs{dp_rank="1",model_name="m",tp_rank="0"} 2.0
# HELP sglang:num_queue_reqs The number of requests in the waiting queue.
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{dp_rank="0",model_name="m",tp_rank="0"} 4.0
sglang:num_queue_reqs{dp_rank="1",model_name="m",tp_rank="0"} 0.0
"""


def test_load_parsers():
    assert load_from_loads({"loads": [{"num_running_reqs": 2, "num_waiting_reqs": 5}, {"num_running_reqs": 1}]}) == 8
    assert load_from_loads([{"num_reqs": 3, "num_waiting_reqs": 1}]) == 4  # the older /get_load
    assert load_from_metrics(SGLANG_METRICS) == 3 + 2 + 4  # TP ranks repeat their DP rank; DP ranks add up
    for bad in ({}, {"loads": []}, [{"token_usage": 0.1}], "text"):
        with pytest.raises((ValueError, TypeError, AttributeError)):
            load_from_loads(bad)
    with pytest.raises(ValueError):
        load_from_metrics("# nothing here\n")


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_scraped_load_sees_requests_that_bypass_this_gateway(sim, gateway, engine):
    """Read where the engine reports it: SGLang's /v1/loads, vLLM's vllm:num_requests_* gauges."""
    plays = ("--engine", engine)
    speculative, plain = sim("k25-eagle3", *SIM_SCALE, *plays), sim("k25-plain", *SIM_SCALE, *plays)
    gw = gateway(
        [speculative.url],
        [plain.url],
        pools={
            "speculative": {"backends": [speculative.url], "engine": engine},
            "plain": {"backends": [plain.url], "engine": engine},
        },
        load_signal="scraped",
        threshold=2,
        hysteresis=0,
        # Scraped load counts while it is under three intervals old: 3 s covers a slow answer on a busy machine.
        health={"interval": 60, "load_interval": 1.0},
    )
    backend = gw.state.pools.speculative[0]

    async def scenario():
        # Another gateway replica (here: a client talking to the engine directly) keeps two streams busy.
        async with httpx.AsyncClient(timeout=20, trust_env=False) as other:
            held = [
                await other.send(
                    other.build_request("POST", speculative.url + "/v1/chat/completions", json=chat(True, LONG)),
                    stream=True,
                )
                for _ in range(2)
            ]
            try:
                await asyncio.to_thread(wait_until, lambda: backend.scraped == 2, what="the scraped load")
                return await other.post(gw.url + "/v1/chat/completions", json=chat())
            finally:
                for response in held:
                    await response.aclose()

    response = asyncio.run(scenario())
    assert response.headers["x-crossover-pool"] == "plain"  # local counts alone would have said speculative
    assert gw.metric("crossover_backend_scraped_load", pool="speculative", backend=speculative.url) >= 0
    wait_until(lambda: backend.scraped == 0, what="the engine's load to drop after the streams closed")


def test_the_prometheus_endpoint_is_the_last_resort_for_load(serve, gateway):
    async def engine(scope, receive, send):
        if scope["type"] != "http":
            return
        found = {"/health": b"", "/metrics": SGLANG_METRICS.encode(), "/v1/models": b'{"data": [{"id": "m"}]}'}
        body = found.get(scope["path"])
        await send({"type": "http.response.start", "status": 404 if body is None else 200, "headers": []})
        await send({"type": "http.response.body", "body": body or b'{"detail": "Not Found"}'})

    url = serve(engine).url
    gw = gateway([url], [url], load_signal="max", health={"interval": 60, "load_interval": 1.0})
    wait_until(lambda: all(backend.scraped == 9 for backend in gw.state.pools.all()), what="load from /metrics")
    assert gw.state.pools.pool_load("speculative") == 9
    assert gw.state.pools.model_names() == {"m"}


def test_a_dead_backend_is_ejected_then_restored(sim, gateway):
    speculative = sim("k25-eagle3", "--time-scale", "10")
    plain = sim("k25-plain", "--time-scale", "10")
    gw = gateway(
        [speculative.url],
        [plain.url],
        health={"interval": 0.05, "timeout": 2.0, "failure_threshold": 2, "eject_seconds": 0.5},
    )
    backend = gw.state.pools.speculative[0]
    assert backend.healthy is True and backend.models == (MODEL,)
    speculative.kill()
    wait_until(lambda: backend.healthy is False, what="the dead backend to be ejected")
    assert gw.metric("crossover_backend_healthy", pool="speculative", backend=speculative.url) == 0
    with httpx.Client(base_url=gw.url, timeout=10, trust_env=False) as client:
        response = client.post("/v1/chat/completions", json=chat())
        assert response.status_code == 200 and response.headers["x-crossover-pool"] == "plain"
        assert gw.metric("crossover_route_decisions_total", pool="plain", reason="fallback") == 1
        sim("k25-eagle3", "--time-scale", "10", port=speculative.port)
        wait_until(lambda: backend.healthy is True, what="the restarted backend to come back")
        assert client.post("/v1/chat/completions", json=chat()).headers["x-crossover-pool"] == "speculative"
        assert client.get("/health").json()["healthy_backends"] == 2


def make_breaker(backends: int = 2, failure_threshold: int = 3, eject_seconds: float = 30.0, percent: int = 50):
    urls = [f"http://s{index}:1" for index in range(backends)]
    settings = Settings(
        health={
            "failure_threshold": failure_threshold,
            "eject_seconds": eject_seconds,
            "max_ejection_percent": percent,
        },
        pools={"speculative": {"backends": urls}, "plain": {"backends": ["http://p:1"]}},
    )
    pools = Pools.from_settings(settings)
    ejected: list[tuple[str, str]] = []
    probed: list[str] = []
    breaker = Breaker(
        pools,
        settings.health,
        on_eject=lambda backend, source: ejected.append((backend.url, source)),
        probe=lambda backend: probed.append(backend.url),
    )
    for backend in pools.all():
        breaker.succeeded(backend, probe=True)
    return pools, breaker, ejected, probed


def test_the_checks_leave_the_first_health_round_to_the_caller_and_scrape_load_at_once():
    """The app probes every backend before serving; a second round at once would only hold the pooled
    connections the first requests want (the direct lane sends only on one)."""
    pools, _, _, _ = make_breaker()
    paths: list[str] = []

    async def scenario() -> None:
        scraped = asyncio.Event()

        def answer(request: httpx.Request) -> httpx.Response:
            paths.append(request.url.path)
            if paths.count("/v1/loads") == len(pools.all()):
                scraped.set()
            return httpx.Response(200, json={"loads": []})

        async with httpx.AsyncClient(transport=httpx.MockTransport(answer)) as client:
            monitor = HealthMonitor(pools, client, HealthSettings(interval=60), scrape=True)
            checks = asyncio.create_task(monitor.run())
            try:
                await asyncio.wait_for(scraped.wait(), 10)
            finally:
                checks.cancel()

    asyncio.run(scenario())
    assert "/health" not in paths and paths.count("/v1/loads") == len(pools.all()), paths


def test_unknown_backends_are_usable_until_a_probe_fails():
    _, breaker, _, _ = make_breaker()
    fresh = Backend("http://new:1", "speculative")
    assert fresh.healthy is None and fresh.usable
    breaker.failed_probe(fresh)
    assert fresh.healthy is False and not fresh.usable


def test_periodic_probes_eject_after_consecutive_failures_and_bring_back_after_the_ejection():
    pools, breaker, ejected, _ = make_breaker(failure_threshold=3, eject_seconds=30)
    backend = pools.speculative[0]
    breaker.failed_probe(backend)
    breaker.failed_probe(backend)
    breaker.succeeded(backend, probe=True)  # a success resets the count
    breaker.failed_probe(backend)
    breaker.failed_probe(backend)
    assert backend.healthy is True
    breaker.failed_probe(backend)
    assert backend.healthy is False and ejected == [(backend.url, PROBE)]
    breaker.succeeded(backend, probe=True)
    assert backend.healthy is False  # the ejection runs its time
    backend.ejected_until = time.monotonic()  # ... which has run out (set, not waited for on a busy machine)
    breaker.succeeded(backend, probe=True)
    assert backend.healthy is True and backend.failures == 0


def test_passive_failures_ask_for_a_probe_which_decides():
    pools, breaker, ejected, probed = make_breaker(failure_threshold=3)
    backend = pools.speculative[0]
    breaker.failed_passively(backend)
    assert probed == [backend.url] and backend.healthy is True
    breaker.failed_probe(backend)  # the probe it asked for failed: decisive at once
    assert backend.healthy is False and ejected == [(backend.url, PROBE)]


def test_passive_failures_never_eject_the_last_healthy_backend_nor_past_the_cap():
    pools, breaker, ejected, _ = make_breaker(backends=2, failure_threshold=2, percent=50)
    first, second = pools.speculative
    for _ in range(5):
        breaker.failed_passively(first)
    assert first.healthy is False and ejected == [(first.url, PASSIVE)]
    for _ in range(5):
        breaker.failed_passively(second)
    assert second.healthy is True  # the pool's last healthy backend: only a failed probe can take it out
    (plain,) = pools.plain
    for _ in range(5):
        breaker.failed_passively(plain)
    assert plain.healthy is True
    assert len(ejected) == 1


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_the_accept_length_gauge_follows_the_stand_ins_acceptance_and_a_live_change(sim, gateway, engine):
    """SGLang's gauge, or vLLM's counters over the window between two scrapes, read on the load scrape's schedule;
    only the speculative backend has the series."""
    plays = ("--engine", engine)
    spec, plain = sim("k25-eagle3", *SIM_SCALE, *plays), sim("k25-plain", *SIM_SCALE, *plays)
    gw = gateway(
        [spec.url],
        [plain.url],
        threshold=1000,
        load_signal="max",
        health={"interval": 0.5, "timeout": 2.0, "load_interval": 0.1},
        pools={
            "speculative": {"backends": [spec.url], "engine": engine},
            "plain": {"backends": [plain.url], "engine": engine},
        },
    )
    labels = {"pool": "speculative", "backend": spec.url}

    with httpx.Client(timeout=60, trust_env=False) as client:

        def near(target: float) -> bool:
            client.post(gw.url + "/v1/chat/completions", json=chat(max_tokens=64)).raise_for_status()
            value = gw.registry.get_sample_value("crossover_backend_accept_length", labels)
            return value is not None and abs(value - target) < 0.25

        assert client.get(spec.url + "/sim/acceptance").json()["accept_length"] == 2.4
        wait_until(lambda: near(2.4), what="the gauge at the profile's acceptance")
        client.post(spec.url + "/sim/acceptance", json={"accept_length": 1.3}).raise_for_status()
        wait_until(lambda: near(1.3), what="the gauge at the new acceptance")
        state = gw.state.snapshot()["pools"]
        assert abs(state["speculative"]["backends"][0]["accept_length"] - 1.3) < 0.25
        assert state["plain"]["backends"][0]["accept_length"] is None
        bad = client.post(spec.url + "/sim/acceptance", json={"accept_length": 9})
        assert bad.status_code == 400 and "between 1 and" in bad.text
    assert (
        gw.registry.get_sample_value("crossover_backend_accept_length", {"pool": "plain", "backend": plain.url}) is None
    )


def test_with_the_local_load_signal_nothing_is_asked_of_the_engines_for_acceptance(serve, gateway):
    """The default: no load scrape, so no /metrics GET either (the engines see health probes only)."""
    seen: list[str] = []

    async def backend(scope, receive, send):
        if scope["type"] != "http":
            return
        seen.append(scope["path"])
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": b'{"object": "list", "data": []}'})

    url = serve(backend).url
    gw = gateway([url], [url], health={"interval": 0.2, "timeout": 2.0, "load_interval": 0.05})
    probed = len(seen)
    wait_until(lambda: len(seen) >= probed + 4, what="four more health probes")
    assert "/metrics" not in seen, seen
    assert gw.state.monitor.acceptance is False
