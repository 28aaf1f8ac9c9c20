"""One interface per deployment shape: each topology answers for itself what routing, the admin API and the lanes
ask, and refuses with a 409 what it cannot honour. (Over HTTP: test_admin.py, test_in_engine.py,
test_switching_settings.py; every object built whole: test_app.py.)"""

from __future__ import annotations

import asyncio

import pytest

from crossover.gateway.app import build_state
from crossover.gateway.config import Settings
from crossover.gateway.errors import NotForTopology
from crossover.gateway.policies.route import IN_ENGINE
from crossover.gateway.topology.factory import InEngine, Partitioned, TimeShared

POOLS = {"speculative": {"backends": ["http://127.0.0.1:9"]}, "plain": {"backends": ["http://127.0.0.1:10"]}}


def topology_of(**settings):
    return build_state(Settings(**settings)).topology


def test_the_factory_builds_the_topology_the_settings_name():
    partitioned = topology_of(pools=POOLS)
    shared = topology_of(topology="time-shared", pools=POOLS)
    engine = topology_of(topology="in-engine", pools={"speculative": POOLS["speculative"]})
    assert (type(partitioned), type(shared), type(engine)) == (Partitioned, TimeShared, InEngine)
    # Only a request that waits on nothing takes the direct lane; only a pool beside another may fail over to it.
    assert [t.direct_lane for t in (partitioned, shared, engine)] == [True, False, True]
    assert [t.other_pool for t in (partitioned, shared, engine)] == [True, False, True]
    assert engine.route(None) == ("speculative", IN_ENGINE)


def test_partitioned_routes_by_its_policy_and_has_no_mode():
    topology = topology_of(pools=POOLS, policy="spillover", threshold=1)
    topology.pools.speculative[0].inflight = 1
    assert topology.route(None) == ("plain", "above_threshold")
    topology.check_threshold_update({"threshold", "hysteresis", "policy"})  # all three are its
    for ask in (topology.mode_view, lambda: asyncio.run(topology.set_mode(None, True))):
        with pytest.raises(NotForTopology) as refused:
            ask()
        assert (refused.value.status, refused.value.code) == (409, "no_mode_to_switch")


@pytest.mark.parametrize(
    "settings",
    [
        {"topology": "time-shared", "pools": POOLS},
        {"topology": "in-engine", "pools": {"speculative": POOLS["speculative"]}},
    ],
)
def test_one_gpu_set_refuses_a_routing_policy_and_takes_the_rest(settings):
    topology = topology_of(**settings)
    with pytest.raises(NotForTopology) as refused:
        topology.check_threshold_update({"threshold", "policy"})
    assert (refused.value.status, refused.value.code, refused.value.param) == (409, "no_routing_policy", "policy")
    topology.check_threshold_update({"threshold", "hysteresis"})
