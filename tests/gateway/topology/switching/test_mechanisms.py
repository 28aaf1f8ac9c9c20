"""The mechanisms under a fencing token, against the real GPU-host agent over stand-ins: two holders of a lease on
one GPU set (tokens 1 and 2, two mechanisms sharing nothing but the agent), as a gateway paused past its lease and
the replica that took the lease over are. After 2 acted, 1's late call is refused (`Fenced`, a `SwitchFailed`),
nothing moves, and the GPU set is never in two modes; restart and sleep (through the agent) alike."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import httpx
import pytest

from crossover.gateway.backends.pools import Pools
from crossover.gateway.cluster.coordination import Cluster, Control
from crossover.gateway.cluster.redis_store import RedisStore
from crossover.gateway.config import Settings, SwitchingSettings
from crossover.gateway.engines import fence
from crossover.gateway.modes import MODES
from crossover.gateway.topology.switching.mechanisms import Fenced, Mechanism, SwitchFailed, Target, make_mechanism
from tests.gateway.cluster_helpers import needs_redis
from tests.gateway.topology.switching.test_controller_restart import AGENT_TOKEN, AgentBox, agent_box  # noqa: F401 - a fixture

Scenario = Callable[[Mechanism, Mechanism], Awaitable[None]]


def run_two_leaders(box: AgentBox, mechanism: str, scenario: Scenario) -> None:
    """`scenario(old, new)`: mechanisms holding tokens 1 and 2 on `box`'s GPU set."""
    settings = SwitchingSettings(
        mechanism=mechanism,
        agent_url=box.agent_url,
        agent_token=AGENT_TOKEN,
        agent_servers={mode: mode for mode in MODES},
    )
    targets = {mode: Target(box.urls[mode]) for mode in MODES}

    async def run() -> None:
        async with httpx.AsyncClient(trust_env=False) as client:
            old, new = (
                make_mechanism(settings, targets, client, lambda _mode: 0, fence=lambda token=token: token)
                for token in (1, 2)
            )
            await scenario(old, new)

    asyncio.run(run())


def ready_modes(box: AgentBox) -> list[str]:
    """The modes whose server holds the GPU set now (a GPU set in two modes would list both)."""
    return [mode for mode in MODES if box.status(mode)["state"] == "ready"]


def agent_metric(box: AgentBox, line: str) -> bool:
    return line in httpx.get(box.agent_url + "/metrics", timeout=10).text


def test_restart_a_stale_leaders_stop_is_refused_and_the_new_leaders_mode_keeps_the_gpu_set(agent_box):  # noqa: F811 - the fixture imported above
    box = agent_box()

    async def scenario(old: Mechanism, new: Mechanism) -> None:
        await old.hand_over("speculative", "plain")  # token 1 leads, switches ...
        assert ready_modes(box) == ["plain"]
        await new.hand_over("plain", "speculative")  # ... is paused past its lease; token 2 takes over, switches back
        await new.verify("speculative")
        assert ready_modes(box) == ["speculative"]
        with pytest.raises(Fenced) as caught:  # token 1 resumes and carries on with a switch to plain
            await old.hand_over("speculative", "plain")
        assert isinstance(caught.value, SwitchFailed) and isinstance(caught.value, fence.Fenced)
        # Refused at its first call, the status read before the stop (status reads carry the token too).
        assert caught.value.step == "status" and "token 1" in str(caught.value) and "token 2" in str(caught.value)
        assert ready_modes(box) == ["speculative"], "nothing moved"
        await new.verify("speculative")
        await new.hand_over("speculative", "plain")  # the holder of token 2 still acts
        assert ready_modes(box) == ["plain"]

    run_two_leaders(box, "restart", scenario)
    assert agent_metric(box, 'crossover_agent_fenced_total{operation="status"} 1.0')
    assert agent_metric(box, 'crossover_agent_fence_token{server="plain"} 2.0')


def test_sleep_through_the_agent_a_stale_leaders_release_is_refused(agent_box):  # noqa: F811 - the fixture imported above
    box = agent_box(mechanism="sleep")  # speculative serves, plain is released

    def info(mode: str) -> dict:
        return httpx.get(box.urls[mode] + "/server_info", timeout=10).json()

    def memory(mode: str) -> dict:
        return info(mode)["memory"]

    async def scenario(old: Mechanism, new: Mechanism) -> None:
        await old.hand_over("speculative", "plain")  # token 1: release speculative, resume plain (the agent's)
        await old.verify("plain")
        assert (box.status("speculative")["state"], box.status("plain")["state"]) == ("released", "ready")
        new.adopted("plain")  # token 2 takes over, finds plain serving and switches back
        await new.hand_over("plain", "speculative")
        await new.verify("speculative")
        released = memory("speculative")["release_total"]

        old.adopted("speculative")  # token 1 resumes, sees speculative serve and switches it away
        with pytest.raises(Fenced) as caught:
            await old.hand_over("speculative", "plain")
        assert caught.value.step == "release"
        assert (box.status("speculative")["state"], box.status("plain")["state"]) == ("ready", "released")
        assert memory("speculative")["release_total"] == released, "the serving server was never released"
        # Nor paused: the pause that drains a server before its release is the agent's, behind the same fence.
        assert info("speculative")["internal_states"][0]["generation_paused"] is False
        with pytest.raises(Fenced):  # nor is the released one resumed beside it
            await old.restore("plain", failed=None)
        await new.verify("speculative")
        assert memory("plain")["resume_not_released_total"] == 0

    run_two_leaders(box, "sleep", scenario)
    assert agent_metric(box, 'crossover_agent_fenced_total{operation="release"} 1.0')
    assert agent_metric(box, 'crossover_agent_fenced_total{operation="resume"} 1.0')


@needs_redis
def test_a_replica_whose_lease_ran_out_between_two_calls_sends_no_call_without_its_token(
    agent_box,  # noqa: F811 - the fixture imported above
    redis_server,
    request,
):
    # A replica paused between its look at the serving server and its stop, resumed past its lease before anyone
    # else acted (so no fence has risen yet): were the stop sent with no token, as a gateway without a cluster's
    # is, the agent would run it and stop what the replica that took the lease over serves from.
    box = agent_box()
    settings = Settings(pools={mode: {"backends": [box.urls[mode]]} for mode in MODES})
    now = [0.0]
    cluster = Cluster(
        RedisStore(redis_server.url, request.node.name[:60], timeout_s=2.0),
        Pools.from_settings(settings),
        lease_s=5.0,
        interval_s=60.0,
        clock=lambda: now[0],
    )
    local = Control(threshold=settings.threshold, hysteresis=settings.hysteresis, policy=settings.policy)
    switching = SwitchingSettings(
        mechanism="restart",
        agent_url=box.agent_url,
        agent_token=AGENT_TOKEN,
        agent_servers={mode: mode for mode in MODES},
    )

    async def run() -> None:
        await cluster.start(lambda: local, lambda _control: asyncio.sleep(0))
        try:
            assert cluster.leader
            async with httpx.AsyncClient(trust_env=False) as client:
                targets = {mode: Target(box.urls[mode]) for mode in MODES}
                mechanism = make_mechanism(switching, targets, client, lambda _mode: 0, fence=cluster.token)
                now[0] += cluster.lease_s  # its lease ran out by its own clock (the store has not said so yet)
                with pytest.raises(Fenced) as caught:
                    await mechanism.hand_over("speculative", "plain")
                assert caught.value.step == "status" and "the call is not sent" in caught.value.message
        finally:
            await cluster.stop()

    asyncio.run(run())
    assert ready_modes(box) == ["speculative"], "nothing moved"
    metrics = httpx.get(box.agent_url + "/metrics", timeout=10).text
    assert 'crossover_agent_operations_total{operation="stop",outcome="ok"} 0.0' in metrics  # never sent
    assert 'crossover_agent_fenced_total{operation="stop"} 0.0' in metrics
