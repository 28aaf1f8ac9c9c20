"""Live routing state: decisions, validated updates and persistence."""

import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from crossover.gateway.backends.pools import Pools
from crossover.gateway.config import MAX_THRESHOLD, Settings, ThresholdError
from crossover.gateway.topology.routing import Routing
from crossover.servers.process import free_port, spawn, stop, wait_ready
from tests.gateway.gateway_helpers import LONG, WAIT_S, Scripted, chat, hold, wait_until

POOLS = {"speculative": {"backends": ["http://s:1"]}, "plain": {"backends": ["http://p:2"]}}
ADMIN = {"authorization": "Bearer t0ken"}


def test_switch_remembers_its_side_between_decisions():
    settings = Settings(policy="switch", threshold=4, hysteresis=2, pools=POOLS)
    routing, pools = Routing.from_settings(settings), Pools.from_settings(settings)
    spec, plain = pools.speculative[0], pools.plain[0]
    spec.inflight = 4
    assert routing.decide(pools).pool == "plain"
    spec.inflight, plain.inflight = 1, 2  # total 3: inside the band, stays plain
    assert routing.decide(pools).pool == "plain"
    plain.inflight = 0  # total 1 < 4 - 2
    assert routing.decide(pools).pool == "speculative"


def test_spillover_counts_only_the_speculative_pool():
    settings = Settings(policy="spillover", threshold=2, hysteresis=0, pools=POOLS)
    routing, pools = Routing.from_settings(settings), Pools.from_settings(settings)
    pools.plain[0].inflight = 50
    assert routing.decide(pools).pool == "speculative"
    pools.speculative[0].inflight = 2
    assert routing.decide(pools).pool == "plain"


def test_updates_are_validated_all_or_nothing():
    routing = Routing.from_settings(Settings(threshold=8, hysteresis=2, pools=POOLS))
    with pytest.raises(ValueError, match="hysteresis"):
        routing.update(threshold=2, hysteresis=2)
    with pytest.raises(ValueError, match="policy"):
        routing.update(threshold=10, policy="random")
    assert (routing.threshold, routing.hysteresis, routing.policy) == (8, 2, "spillover")
    routing.update(threshold=2)  # alone, the threshold narrows a band that no longer fits under it
    assert (routing.threshold, routing.hysteresis) == (2, 1)
    routing.update(threshold=20)
    assert (routing.threshold, routing.hysteresis) == (20, 1)
    routing.update(threshold=2, hysteresis=0, policy="switch")
    assert (routing.threshold, routing.hysteresis, routing.policy) == (2, 0, "switch")


def test_live_changes_survive_a_restart_through_the_state_file(tmp_path):
    state_file = tmp_path / "state" / "routing.json"
    settings = Settings(threshold=8, state_file=state_file, pools=POOLS)
    Routing.from_settings(settings).update(threshold=20, hysteresis=3)
    saved = {"threshold": 20, "hysteresis": 3, "policy": "spillover", "priority_headroom": 64, "spillover_share": 0.0}
    assert json.loads(state_file.read_text()) == saved
    restarted = Routing.from_settings(settings)
    assert (restarted.threshold, restarted.hysteresis) == (20, 3)
    restarted.update(spillover_share=0.25)
    assert Routing.from_settings(settings).spillover_share == 0.25


def test_the_spillover_share_is_validated_and_routes_by_the_total_load(tmp_path):
    settings = Settings(policy="spillover", threshold=1, spillover_share=0.5, pools=POOLS)
    routing, pools = Routing.from_settings(settings), Pools.from_settings(settings)
    pools.speculative[0].inflight, pools.plain[0].inflight = 3, 4  # 3 < half of 8 with the new one
    assert routing.decide(pools).pool == "speculative"
    pools.plain[0].inflight = 2
    assert routing.decide(pools).pool == "plain"
    for bad in (-0.1, 1.5, float("nan")):
        with pytest.raises(ThresholdError, match="spillover_share"):
            routing.update(spillover_share=bad)
    assert routing.spillover_share == 0.5
    with pytest.raises(ValueError, match="spillover_share"):
        Settings(spillover_share=2, pools=POOLS)
    state_file = tmp_path / "routing.json"
    state_file.write_text('{"threshold": 4, "hysteresis": 0, "spillover_share": "half"}')
    restored = Routing.from_settings(Settings(threshold=9, state_file=state_file, pools=POOLS))
    assert restored.threshold == 9 and "spillover_share is not a number" in restored.state_file_problem


@pytest.mark.parametrize("saved", ['{"threshold": "many"}', '{"threshold": 1' + "0" * 400 + "}", "[]", "{"])
def test_a_corrupt_state_file_serves_the_configured_values_and_says_so(tmp_path, saved, caplog):
    state_file = tmp_path / "routing.json"
    state_file.write_text(saved)
    routing = Routing.from_settings(Settings(threshold=9, state_file=state_file, pools=POOLS))
    assert routing.threshold == 9
    assert "routing.json cannot be restored" in routing.state_file_problem
    assert routing.state()["state_file"]["problem"] == routing.state_file_problem
    assert "serving the configured threshold 9" in caplog.text
    routing.update(threshold=5)  # a save that works clears the problem
    assert routing.state_file_problem is None and json.loads(state_file.read_text())["threshold"] == 5


# -- a real gateway process whose state directory it may only read ---------------------------------------


@pytest.fixture
def reading_only(serve):
    """start(saved) -> (url, log path): `crossover serve` whose state file holds `saved`, in a directory it can
    read but not write - immutable (chattr +i) when the tests run as root (root writes anywhere), else mode 0555."""
    started: list[subprocess.Popen] = []
    home = Path(tempfile.mkdtemp(prefix="crossover-ro-"))
    home.chmod(0o755)  # tmp_path's parents are root's alone
    backend = serve(Scripted(body=json.dumps({"choices": [], "usage": {"completion_tokens": 1}}).encode())).url

    def start(saved: str) -> tuple[str, Path, subprocess.Popen]:
        state_dir = home / "state"
        state_dir.mkdir()
        (state_dir / "routing.json").write_text(saved)
        port = free_port()
        config = home / "crossover.toml"
        config.write_text(
            f'port = {port}\nthreshold = 9\nadmin_token = "t0ken"\nstate_file = "{state_dir / "routing.json"}"\n'
            f'[pools.speculative]\nbackends = ["{backend}"]\n[pools.plain]\nbackends = ["{backend}"]\n'
        )
        config.chmod(0o644)
        # Root writes through a 0555 directory, so as root the directory and its file are made immutable
        # (chattr +i: not even root may create, rename or change what is in them) - the way a read-only
        # ConfigMap mount looks to the gateway. (Running the gateway as another user would need an interpreter
        # outside root's 0700 home.)
        if os.geteuid() == 0:
            subprocess.run(["chattr", "+i", str(state_dir / "routing.json"), str(state_dir)], check=True)
        else:
            state_dir.chmod(0o555)
        log = home / "gateway.log"
        with log.open("wb") as out:
            argv = [sys.executable, "-m", "crossover.gateway.cli", "serve", "--config", str(config)]
            env = {**os.environ, "CROSSOVER_TIMEOUTS__SHUTDOWN_DELAY": "0"}
            proc = spawn(argv, die_with_parent=False, env=env, stdout=out, stderr=subprocess.STDOUT)
        started.append(proc)
        url = f"http://127.0.0.1:{port}"
        wait_ready(url + "/health", proc, WAIT_S)
        return url, log, proc

    yield start
    stop(started, timeout=30)
    if os.geteuid() == 0 and (home / "state").exists():
        subprocess.run(["chattr", "-i", str(home / "state"), str(home / "state" / "routing.json")], check=False)
    (home / "state").chmod(0o755)
    shutil.rmtree(home)


def admin_state(url: str) -> dict:
    return httpx.get(url + "/admin/state", headers=ADMIN, timeout=10, trust_env=False).json()


def state_file_problem(url: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10, trust_env=False).text
    return next(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "crossover_state_file_problem"
    )


def test_a_read_only_state_directory_serves_the_saved_threshold(reading_only):
    url, _, _ = reading_only('{"threshold": 20, "hysteresis": 3, "policy": "spillover"}\n')
    served = httpx.post(url + "/v1/chat/completions", json=chat(), timeout=10, trust_env=False)
    assert served.status_code == 200
    state = admin_state(url)
    assert (state["threshold"], state["hysteresis"]) == (20, 3) and state["state_file"]["problem"] is None
    assert state_file_problem(url) == 0
    # A change cannot be saved there: it is live, and the answer says why with a stable code.
    changed = httpx.put(url + "/admin/threshold", json={"threshold": 7}, headers=ADMIN, timeout=10, trust_env=False)
    assert changed.status_code == 500 and changed.json()["error"]["code"] == "state_not_saved"
    assert admin_state(url)["threshold"] == 7 and "cannot be saved" in admin_state(url)["state_file"]["problem"]
    assert state_file_problem(url) == 1


def test_a_corrupt_state_file_serves_the_configured_threshold_with_a_warning(reading_only):
    url, log, _ = reading_only('{"threshold": "twenty"')
    served = httpx.post(url + "/v1/chat/completions", json=chat(), timeout=10, trust_env=False)
    assert served.status_code == 200
    state = admin_state(url)
    assert state["threshold"] == 9 and "routing.json cannot be restored" in state["state_file"]["problem"]
    assert state_file_problem(url) == 1
    assert "serving the configured threshold 9" in log.read_text()


def test_a_threshold_out_of_bounds_is_refused_everywhere(tmp_path):
    with pytest.raises(ValueError, match="threshold"):
        Settings(threshold=10**400, pools=POOLS)
    routing = Routing.from_settings(Settings(state_file=tmp_path / "routing.json", pools=POOLS))
    with pytest.raises(ThresholdError) as caught:
        routing.update(threshold=MAX_THRESHOLD + 1)
    assert caught.value.field == "threshold" and not (tmp_path / "routing.json").exists()


# -- live: a real gateway in front of real stand-ins, under a held load -----------------------------------


async def open_stream(client: httpx.AsyncClient) -> httpx.Response:
    response = await client.send(
        client.build_request("POST", "/v1/chat/completions", json=chat(True, LONG)), stream=True
    )
    assert response.status_code == 200
    return response


async def route_of_next(client: httpx.AsyncClient) -> str:
    response = await client.post("/v1/chat/completions", json=chat())
    assert response.status_code == 200
    return response.headers["x-crossover-pool"]


def test_spillover_under_held_load_and_a_live_threshold_change(sims, gateway):
    speculative, plain = sims
    gw = gateway([speculative.url], [plain.url], policy="spillover", threshold=3, hysteresis=0, admin_token="t0ken")

    async def scenario():
        async with (
            httpx.AsyncClient(base_url=gw.url, timeout=20, trust_env=False) as client,
            hold(client, gw.url, 5) as pools,
        ):
            assert pools == ["speculative"] * 3 + ["plain"] * 2
            assert await route_of_next(client) == "plain"
            changed = await client.put("/admin/threshold", json={"threshold": 4}, headers=ADMIN)
            assert changed.status_code == 200 and changed.json()["threshold"] == 4
            assert await route_of_next(client) == "speculative"  # the very next decision
            await client.put("/admin/threshold", json={"threshold": 0}, headers=ADMIN)
            assert await route_of_next(client) == "plain"

    asyncio.run(scenario())
    assert gw.metric("crossover_route_decisions_total", pool="speculative", reason="below_threshold") == 4
    assert gw.metric("crossover_route_decisions_total", pool="plain", reason="above_threshold") == 4
    assert gw.metric("crossover_routing_threshold") == 0


def test_spillover_with_a_share_under_held_load_and_a_live_change(sims, gateway):
    speculative, plain = sims
    gw = gateway(
        [speculative.url], [plain.url], policy="spillover", threshold=1, spillover_share=0.5, admin_token="t0ken"
    )

    async def scenario():
        async with (
            httpx.AsyncClient(base_url=gw.url, timeout=20, trust_env=False) as client,
            hold(client, gw.url, 6) as pools,
        ):
            # The threshold's one, then each request to the pool that keeps the speculative one at half.
            assert pools == ["speculative", "plain", "speculative", "plain", "speculative", "plain"]
            changed = await client.put("/admin/threshold", json={"spillover_share": 0.0}, headers=ADMIN)
            assert changed.status_code == 200 and changed.json()["spillover_share"] == 0.0
            assert await route_of_next(client) == "plain"  # the threshold alone: 3 held are past it
            bad = await client.put("/admin/threshold", json={"spillover_share": "0.5"}, headers=ADMIN)
            assert bad.status_code == 400 and bad.json()["error"]["param"] == "spillover_share"
            await client.put("/admin/threshold", json={"spillover_share": 1.0}, headers=ADMIN)
            assert await route_of_next(client) == "speculative"  # all of the load may be speculative

    asyncio.run(scenario())
    assert gw.metric("crossover_route_decisions_total", pool="speculative", reason="below_share") == 3
    assert gw.metric("crossover_routing_spillover_share") == 1.0


def test_switch_under_held_load_holds_its_side_in_the_hysteresis_band(sims, gateway):
    speculative, plain = sims
    gw = gateway([speculative.url], [plain.url], policy="switch", threshold=4, hysteresis=2)

    async def settled(load: int) -> None:
        """Wait for the gateway to see a closed stream's disconnect (it counts it until then)."""
        await asyncio.to_thread(wait_until, lambda: gw.inflight() == load, what=f"in-flight == {load}")

    async def scenario():
        async with httpx.AsyncClient(base_url=gw.url, timeout=20, trust_env=False) as client:
            held = [await open_stream(client) for _ in range(4)]  # loads 0..3 at arrival: all speculative
            assert [response.headers["x-crossover-pool"] for response in held] == ["speculative"] * 4
            sides = [await route_of_next(client)]  # load 4: plain
            # The load now hovers around the threshold: 3, 4, 3, 2. Without hysteresis: 4 flips.
            for change in (-1, +1, -1, -1):
                if change < 0:
                    await held.pop().aclose()
                else:
                    held.append(await open_stream(client))
                await settled(len(held))
                sides.append(await route_of_next(client))
            await held.pop().aclose()  # load 1 < threshold - hysteresis
            await settled(1)
            sides.append(await route_of_next(client))
            for response in held:
                await response.aclose()
            return sides

    assert asyncio.run(scenario()) == ["plain"] * 5 + ["speculative"]
    assert gw.metric("crossover_route_decisions_total", pool="plain", reason="hysteresis") >= 3


def test_a_tier_moves_its_own_request_and_not_the_switch_policys_side():
    """The headroom is per speculative server; a tiered request leaves the side the next decision starts from."""
    two = {"speculative": {"backends": ["http://s:1", "http://s:2"]}, "plain": {"backends": ["http://p:2"]}}
    settings = Settings(policy="switch", threshold=4, hysteresis=2, priority_headroom=3, pools=two)
    routing, pools = Routing.from_settings(settings), Pools.from_settings(settings)
    assert (routing.priority_headroom, routing.speculative_servers) == (3, 2)
    pools.speculative[0].inflight = 5
    assert (routing.decide(pools, "priority").pool, routing.side) == ("speculative", "plain")
    pools.speculative[1].inflight = 1  # the pool holds 6: at its headroom
    assert routing.decide(pools, "priority").pool == "plain"
    pools.speculative[0].inflight = pools.speculative[1].inflight = 0
    assert (routing.decide(pools, "flex").pool, routing.side) == ("plain", "speculative")
    pools.plain[0].healthy = False
    assert routing.decide(pools, "flex").pool == "speculative"
