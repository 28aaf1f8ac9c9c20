"""The fence against a paused leader, with real processes: two `crossover serve` replicas on one real redis-server.
Time-shared by restart through a real agent over stand-ins: the leader is SIGSTOPped with its stop of the serving
server already sent (held in front of the agent), the other replica takes the lease and moves the GPU set, and the
old leader's call, let through once it has acted, is refused by the agent's fence: the server the new leader serves
from stays up. In-engine over a gated stand-in, alike with a gate write. Every wait is on an event (a state read
back), never on a sleep."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import threading

import httpx
import pytest
import redis
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from crossover.gateway.engines.fence import FENCE_HEADER
from tests.gateway.cluster_helpers import needs_redis
from tests.gateway.topology.switching.test_controller import TOKEN, admin_state, put_mode, wait_phase
from tests.gateway.topology.switching.test_controller_restart import AGENT_TOKEN, AgentBox, agent_box  # noqa: F401 - a fixture
from tests.gateway.topology.test_gates import engine_gate, faulty  # noqa: F401 - a fixture
from tests.waiting import wait_until

pytestmark = needs_redis
AGENT_AUTH = {"authorization": f"Bearer {AGENT_TOKEN}"}
ADMIN = {"authorization": f"Bearer {TOKEN}"}
# Between two reads of the agent's view of the GPU set while the test runs.
WATCH_POLL_S = 0.05


class HeldAgentCalls:
    """A test-only front of the agent: forwards every call; while `hold` is set, an operation (a POST) waits here,
    already sent by its caller, until `release` is set. Records the operations held and each one's answer."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream
        self.hold = threading.Event()
        self.release = threading.Event()
        self.held: list[tuple[str, str | None]] = []  # (path, fencing token) of each operation held
        self.answered: list[tuple[str, str | None, int, dict]] = []  # ... and the agent's status and body

    def app(self) -> Starlette:
        return Starlette(routes=[Route("/{path:path}", self._handle, methods=["GET", "POST"])])

    async def _handle(self, request: Request) -> Response:
        path = "/" + request.path_params["path"]
        fence = request.headers.get(FENCE_HEADER)
        operation = request.method == "POST"
        if operation and self.hold.is_set():
            self.held.append((path, fence))
            while not self.release.is_set():
                await asyncio.sleep(0.02)
        forwarded = ("authorization", "content-type", FENCE_HEADER.lower())
        headers = {k: v for k, v in request.headers.items() if k.lower() in forwarded}
        async with httpx.AsyncClient(timeout=60, trust_env=False) as client:
            answer = await client.request(
                request.method, self.upstream + path, content=await request.body(), headers=headers
            )
        if operation:
            self.answered.append((path, fence, answer.status_code, answer.json()))
        return Response(answer.content, answer.status_code, media_type=answer.headers.get("content-type"))


class AgentWatch:
    """Reads the agent's view of every server of the GPU set, over and over, until stopped."""

    def __init__(self, box: AgentBox) -> None:
        self.box = box
        self.seen: list[dict[str, str]] = []
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(timeout=10, trust_env=False, headers=AGENT_AUTH) as client:
            while not self._done.is_set():
                with contextlib.suppress(httpx.HTTPError):
                    servers = client.get(self.box.agent_url + "/servers").json()["servers"]
                    self.seen.append({server["name"]: server["state"] for server in servers})
                self._done.wait(WATCH_POLL_S)

    def __enter__(self) -> AgentWatch:
        self._thread.start()
        return self

    def __exit__(self, *_) -> None:
        self._done.set()
        self._thread.join(30)


def replica_config(box: AgentBox, agent_url: str, cluster: dict) -> str:
    """A time-shared replica switching by restart through `agent_url` (the agent, or a front of it)."""
    return f"""
topology = "time-shared"
admin_token = "{TOKEN}"
threshold = 4
hysteresis = 2
[pools.speculative]
backends = ["{box.urls["speculative"]}"]
[pools.plain]
backends = ["{box.urls["plain"]}"]
[health]
interval = 0.5
[switching]
mechanism = "restart"
dwell = 3600.0
window = 1.0
interval = 0.1
operator_interval = 0.0
# Long enough that the held call is answered (refused), not given up on, whenever the process runs again.
control_timeout = 600.0
agent_url = "{agent_url}"
agent_token = "{AGENT_TOKEN}"
[switching.agent_servers]
speculative = "speculative"
plain = "plain"
[cluster]
redis_url = "{cluster["redis_url"]}"
name = "{cluster["name"]}"
sync_interval = 0.1
lease = 1.0
"""


def role(gw) -> str:
    return admin_state(gw)["cluster"]["role"]


def agent_metric(box: AgentBox, sample: str) -> float:
    text = httpx.get(box.agent_url + "/metrics", timeout=10, trust_env=False).text
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(sample + " ")]
    return values[0] if values else 0.0


@pytest.mark.parametrize(
    "new_leader_acts",
    [
        pytest.param(True, id="after-the-new-leader-moved-the-gpu-set"),
        # Adoption reads the servers' status with its token: that alone raises the agent's fence.
        pytest.param(False, id="after-the-new-leader-only-adopted"),
    ],
)
def test_a_leader_sigstopped_with_its_stop_sent_then_resumed_past_its_lease_is_refused_by_the_agents_fence(
    agent_box,  # noqa: F811
    gateway_process,
    serve,
    redis_server,
    request,
    new_leader_acts,
):
    box = agent_box()
    front = HeldAgentCalls(box.agent_url)
    held_front = serve(front.app())
    cluster = {"redis_url": redis_server.url, "name": request.node.name[:60]}
    stale = gateway_process(replica_config(box, held_front.url, cluster))  # started first: it takes the lease
    wait_until(lambda: role(stale) == "leader", what="the first replica leading")
    wait_phase(stale, "active", "speculative")
    taking = gateway_process(replica_config(box, box.agent_url, cluster))
    wait_phase(taking, "active", "speculative")
    assert role(taking) == "follower"
    stale_token = admin_state(stale)["cluster"]["fence"]
    paused = False
    with AgentWatch(box) as watch:
        try:
            front.hold.set()
            assert put_mode(stale, "plain").status_code == 202
            wait_until(lambda: front.held, what="the leader's stop of the serving server sent, and held")
            assert front.held == [("/servers/speculative/stop", str(stale_token))]
            os.kill(stale.proc.pid, signal.SIGSTOP)
            paused = True
            wait_until(lambda: role(taking) == "leader", what="the other replica taking the lease")
            taking_token = admin_state(taking)["cluster"]["fence"]
            assert taking_token > stale_token
            # It adopts what serves (the held stop never reached the agent), then moves the GPU set itself - to plain
            # and back - so the agent has accepted its token and speculative serves again, from the new leader (or,
            # the known gap, only adopts).
            wait_phase(taking, "active", "speculative")
            for mode in ("plain", "speculative") if new_leader_acts else ():
                assert put_mode(taking, mode).status_code == 202
                assert wait_phase(taking, "active", mode)["last_switch"]["outcome"] == "ok"
            assert box.status("speculative")["state"] == "ready" and box.status("plain")["state"] == "stopped"
            # The old leader's stop, sent under its expired lease, reaches the agent now: refused, not run.
            front.release.set()
            wait_until(lambda: front.answered, what="the agent answering the held stop")
            os.kill(stale.proc.pid, signal.SIGCONT)
            paused = False
            wait_until(lambda: role(stale) == "follower", what="the old leader stepping down")
            wait_phase(stale, "active", "speculative")  # it follows the new leader
            wait_until(lambda: len(watch.seen) >= 2, what="the agent's view read after the old leader resumed")
        finally:
            front.release.set()
            if paused:
                os.kill(stale.proc.pid, signal.SIGCONT)

    path, fence, status, body = front.answered[0]
    assert (path, fence, status) == ("/servers/speculative/stop", str(stale_token), 409)
    assert body["error"]["code"] == "fenced", body
    assert len(front.answered) == 1, front.answered  # resumed, it sent nothing more on the GPU set
    # The server the new leader serves from never stopped; at no moment did both servers serve.
    assert box.status("speculative")["state"] == "ready" and box.status("plain")["state"] == "stopped"
    assert watch.seen and all(list(states.values()).count("ready") <= 1 for states in watch.seen), watch.seen
    assert agent_metric(box, 'crossover_agent_fenced_total{operation="stop"}') == 1
    assert agent_metric(box, 'crossover_agent_operations_total{operation="stop",outcome="fenced"}') == 1
    assert f"refused stop of 'speculative': fenced: this call carries token {stale_token}" in box.log()
    # The old leader is a follower that acts on nothing; the new one still leads, under the same token.
    view = admin_state(stale)["cluster"]
    assert view["role"] == "follower" and view["fence"] is None
    assert stale.metrics()[("crossover_cluster_leader", ())] == 0
    assert admin_state(taking)["cluster"]["fence"] == taking_token and role(taking) == "leader"
    assert taking.metrics()[("crossover_cluster_fenced_total", ())] == 0
    # Resumed, it found its lease gone by its own clock (or its call refused, whichever it read first) and stood back.
    assert "no longer acting on the GPU set" in stale.log() or "stepping down" in stale.log(), stale.log()


def in_engine_config(backend: str, cluster: dict) -> str:
    return f"""
topology = "in-engine"
admin_token = "{TOKEN}"
threshold = 4
[pools.speculative]
backends = ["{backend}"]
[health]
interval = 0.2
timeout = 600.0
[cluster]
redis_url = "{cluster["redis_url"]}"
name = "{cluster["name"]}"
sync_interval = 0.1
lease = 1.0
"""


def put_threshold(gw, threshold: int, timeout: float = 10) -> httpx.Response:
    return httpx.put(
        gw.url + "/admin/threshold", json={"threshold": threshold}, headers=ADMIN, timeout=timeout, trust_env=False
    )


def cluster_control(redis_url: str, name: str) -> dict:
    """The cluster's control state as stored in Redis (gateway/cluster/redis_store.py's `NAME:control`)."""
    with redis.Redis.from_url(redis_url) as direct:
        return json.loads(direct.get(f"{name}:control"))


def engine_fence(url: str) -> dict:
    """The stand-in gate's fence: the highest token accepted and how many calls it refused."""
    return httpx.get(url + "/speculative/adaptive", timeout=10, trust_env=False).json()["fence"]


class GateWatch(AgentWatch):
    """Reads one engine's gate over and over, until stopped: (zero_steps_above_bs, generation) each time."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.seen: list[tuple[int | None, int]] = []
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._done.is_set():
            with contextlib.suppress(httpx.HTTPError):
                gate = engine_gate(self.url)
                self.seen.append((gate["zero_steps_above_bs"], gate["generation"]))
            self._done.wait(WATCH_POLL_S)


def test_in_engine_a_leader_sigstopped_with_its_gate_write_sent_then_resumed_is_refused_by_the_engines_fence(
    faulty,  # noqa: F811
    gateway_process,
    redis_server,
    request,
):
    ((engine, faults, front),) = faulty(1)
    cluster = {"redis_url": redis_server.url, "name": request.node.name[:60]}
    stale = gateway_process(in_engine_config(front, cluster))  # started first: it takes the lease
    wait_until(lambda: role(stale) == "leader", what="the first replica leading")
    wait_until(lambda: engine_gate(engine.url)["zero_steps_above_bs"] == 4, what="the leader's gate on the engine")
    taking = gateway_process(in_engine_config(engine.url, cluster))
    assert role(taking) == "follower"
    stale_token = admin_state(stale)["cluster"]["fence"]
    startup_writes = len(faults.write_fences)
    paused, putting = False, None
    with GateWatch(engine.url) as watch:
        try:
            faults.hang_writes.set()
            stored: list[int] = []  # the cluster's threshold as each held write arrived
            faults.on_held = lambda: stored.append(cluster_control(redis_server.url, cluster["name"])["threshold"])
            # The PUT writes every gate before it answers: it waits, as its write does, in the background.
            answers: list[httpx.Response] = []
            putting = threading.Thread(target=lambda: answers.append(put_threshold(stale, 12, timeout=120)))
            putting.start()
            wait_until(lambda: faults.held_writes, what="the leader's gate write sent, and held")
            # The change the dry run accepted was the cluster's before its gate write was sent, not whenever the
            # next sync came: else the old leader, resumed, publishes its 12 over the 20 below, for the new leader
            # to write.
            assert stored[0] == 12, stored
            os.kill(stale.proc.pid, signal.SIGSTOP)
            paused = True
            wait_until(lambda: role(taking) == "leader", what="the other replica taking the lease")
            taking_token = admin_state(taking)["cluster"]["fence"]
            assert taking_token > stale_token
            # The new leader writes a gate of its own under its token.
            assert put_threshold(taking, 20).status_code == 200
            wait_until(lambda: engine_gate(engine.url)["zero_steps_above_bs"] == 20, what="the new leader's next gate")
            generation = engine_gate(engine.url)["generation"]
            faults.release.set()  # the old leader's write of 12 reaches the engine now
            sent = lambda: len(faults.write_fences) - startup_writes  # noqa: E731 - the old leader's since its PUT
            wait_until(lambda: engine_fence(engine.url)["refused"] == sent(), what="the engine refusing every one")
            writes = len(faults.write_fences)
            os.kill(stale.proc.pid, signal.SIGCONT)
            paused = False
            wait_until(lambda: role(stale) == "follower", what="the old leader stepping down")
            wait_until(
                lambda: admin_state(stale)["threshold"] == 20,
                what="the old leader taking the cluster's newer threshold",
            )
            read = len(watch.seen)
            wait_until(lambda: len(watch.seen) >= read + 2, what="the gate read after the old leader took it")
        finally:
            faults.release.set()
            if paused:
                os.kill(stale.proc.pid, signal.SIGCONT)
            if putting is not None:
                putting.join(120)

    # Its PUT's own write was among them: the PUT says the threshold is not on that engine's gate, and why.
    assert answers[0].status_code == 502 and "fenced" in answers[0].text, answers[0].text
    gate = httpx.get(engine.url + "/speculative/adaptive", timeout=10, trust_env=False).json()
    assert gate["state"]["zero_steps_above_bs"] == 20 and gate["state"]["generation"] == generation
    # Every write the old leader sent (its start-up gate, then the held ones) carried its token; those sent before
    # the pause were refused (its PUT's, and its gate round's if one had begun); resumed, it sent no other.
    assert gate["fence"] == {"highest": taking_token, "refused": sent()}, gate["fence"]
    assert set(faults.write_fences) == {str(stale_token)} and len(faults.write_fences) == writes
    # Once the new leader's 20 was on the gate, nothing moved it: the old leader's 12 was never applied.
    after = watch.seen[next(i for i, (value, _) in enumerate(watch.seen) if value == 20) :]
    assert {value for value, _ in after} == {20}, watch.seen
    view = admin_state(stale)["cluster"]
    assert view["role"] == "follower" and view["fence"] is None
    assert stale.metrics()[("crossover_cluster_leader", ())] == 0
    assert admin_state(taking)["cluster"]["fence"] == taking_token and role(taking) == "leader"
    assert taking.metrics()[("crossover_cluster_fenced_total", ())] == 0
