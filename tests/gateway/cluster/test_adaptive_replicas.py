"""[adaptive] over real replicas: two `crossover serve` processes on one real redis-server, in front of the same
stand-ins. The speculative stand-in's acceptance drops live; only the leader (the lease holder) moves the threshold,
every replica serves it, and the follower's /admin/state `adaptive` shows the leader's last decision and move, which
reach it through the cluster's state (as the pause does). No hand-set leader flag: the lease decides."""

from __future__ import annotations

import json

import httpx

from tests.gateway.cluster_helpers import needs_redis
from tests.gateway.gateway_helpers import SIM_SCALE, chat
from tests.waiting import wait_until

pytestmark = needs_redis

TOKEN = "admin-token"
ADMIN = {"Authorization": f"Bearer {TOKEN}"}
START, MINIMUM, MAXIMUM, MAX_STEP = 22, 4, 40, 3
# At the bench's acceptance (2.4) plain catches up at 22.4; at 1.2 below the lowest level.
LEVELS = {"eagle": ((1, 100), (4, 380), (16, 1200), (32, 1600), (64, 1800)),
          "plain": ((1, 60), (4, 240), (16, 1000), (32, 1900), (64, 2600))}  # fmt: skip


def config(table, spec_url: str, plain_url: str, redis_url: str, name: str) -> str:
    return f"""
admin_token = "{TOKEN}"
threshold = {START}
[pools.speculative]
backends = ["{spec_url}"]
[pools.plain]
backends = ["{plain_url}"]
[health]
interval = 0.5
load_interval = 0.1
[adaptive]
enabled = true
table = "{table}"
bench_accept_length = 2.4
window = 0.2
max_step = {MAX_STEP}
max_levels = 0
correct = false  # the table is not the stand-ins' throughput: the acceptance alone moves it
min = {MINIMUM}
max = {MAXIMUM}
[cluster]
redis_url = "{redis_url}"
name = "{name}"
sync_interval = 0.1
lease = 1.0
"""


def state(replica) -> dict:
    return httpx.get(replica.url + "/admin/state", headers=ADMIN, timeout=10, trust_env=False).json()


def test_only_the_leader_moves_the_threshold_and_the_follower_shows_its_decisions(
    sim, gateway_process, redis_server, tmp_path, request
):
    spec, plain = sim("k25-eagle3", *SIM_SCALE), sim("k25-plain", *SIM_SCALE)
    levels = [
        {"target": target, "concurrency": c, "completed": 20, "output_throughput": tok}
        for target, points in LEVELS.items()
        for c, tok in points
    ]
    table = tmp_path / "results.json"
    table.write_text(json.dumps({"levels": levels, "crossover": {"speculative": "eagle", "plain": "plain"}}))
    text = config(table, spec.url, plain.url, redis_server.url, request.node.name[:60])
    replicas = [gateway_process(text), gateway_process(text)]
    wait_until(
        lambda: sorted(state(r)["cluster"]["role"] for r in replicas) == ["follower", "leader"], what="one leader"
    )
    leader, follower = sorted(replicas, key=lambda r: state(r)["cluster"]["role"] != "leader")

    with httpx.Client(timeout=60, trust_env=False) as client:

        def traffic_then(condition):
            """Keep the speculative stand-in generating (its acceptance is read from what it generates), through
            the follower: the leader's decisions do not depend on where the traffic enters."""

            def check() -> bool:
                client.post(follower.url + "/v1/chat/completions", json=chat(max_tokens=32)).raise_for_status()
                return condition()

            return check

        client.post(spec.url + "/sim/acceptance", json={"accept_length": 1.2}).raise_for_status()
        wait_until(
            traffic_then(lambda: all(state(r)["threshold"] == MINIMUM for r in replicas)),
            timeout=120,
            what="the threshold at min on both replicas",
        )
        # The leader's last move reaches the follower with the cluster's next sync.
        wait_until(
            lambda: state(follower)["adaptive"]["last_move"] == state(leader)["adaptive"]["last_move"],
            what="the follower showing the leader's last move",
        )

    ours, theirs = state(leader)["adaptive"], state(follower)["adaptive"]
    assert ours["deciding"] and not ours["from_leader"]
    assert not theirs["deciding"] and theirs["from_leader"]
    assert theirs["last_move"]["to"] == MINIMUM and theirs["last_move"]["reason"] == "toward_crossover"
    assert theirs["last_decision"]["prediction"]["crossover"] < MINIMUM
    assert theirs["moves"] == ours["moves"] and ours["moves"]["down"] >= (START - MINIMUM) // MAX_STEP
    # Only the leader moved: the follower's own controller counted no move.
    moves = {r.url: sum(v for (name, _), v in r.metrics().items() if name == "crossover_adaptive_moves_total")
             for r in replicas}  # fmt: skip
    assert moves[follower.url] == 0 and moves[leader.url] == ours["moves"]["down"] + ours["moves"]["up"]
