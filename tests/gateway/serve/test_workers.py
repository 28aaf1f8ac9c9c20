"""`crossover serve --workers 2` as one gateway, in front of a backend the test holds and releases.

A test reaches a given worker the way a client does: it opens connections (one per client, kept alive) until the
kernel has given it one on that worker; `/health` on a connection names the worker that answers it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import tempfile
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from crossover.gateway.admission import Admission
from crossover.gateway.cluster.host import FOLDER_PREFIX, HEARTBEAT, PID, Host, Worker, heartbeat_ms, remove_orphans
from crossover.gateway.serve.workers import share, silent
from tests.gateway.cluster_helpers import RedisServer, needs_redis
from tests.gateway.gateway_helpers import MODEL, SIM_SCALE, chat, sse_events, wait_until

WORKERS = 2
TRIES = 200  # connections opened, at most, to find a worker (the kernel spreads them evenly)
# A client on one worker keeps its one connection however long it idles (httpx would drop it after 5 s, and the
# next request could land on the other worker).
ONE_CONNECTION = httpx.Limits(max_connections=1, keepalive_expiry=None)
# A worker may be silent this long (config.MIN_WORKER_TIMEOUT_S is 1): a test waits for the kill, never times it;
# long enough that a healthy worker starved on a busy machine is not killed by mistake.
WORKER_TIMEOUT_S = 5.0


class HeldBackend:
    """An OpenAI-shaped backend whose generations wait while it is held: a stream sends its first event at once and
    the rest once released, a whole response waits whole."""

    def __init__(self) -> None:
        self.open = threading.Event()
        self.open.set()
        self.pending = 0  # generations started and not ended

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            while (message := await receive())["type"] != "lifespan.shutdown":
                await send({"type": message["type"] + ".complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        if scope["path"] == "/v1/models":
            await self.answer(send, {"object": "list", "data": [{"id": MODEL, "object": "model"}]})
            return
        if scope["path"] != "/v1/chat/completions":
            await self.answer(send, {})
            return
        self.pending += 1
        try:
            if json.loads(body).get("stream"):
                await self.stream(send)
            else:
                await self.held()
                await self.answer(send, completion())
        finally:
            self.pending -= 1

    async def held(self) -> None:
        while not self.open.is_set():
            await asyncio.sleep(0.005)

    async def stream(self, send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        await send({"type": "http.response.body", "body": event(chunk("a")), "more_body": True})
        await self.held()
        await send({"type": "http.response.body", "body": event(chunk("b")) + b"data: [DONE]\n\n"})

    @staticmethod
    async def answer(send, payload: dict) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": json.dumps(payload).encode()})


def completion() -> dict:
    message = {"role": "assistant", "content": "ok"}
    usage = {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}
    return {
        "id": "c",
        "object": "chat.completion",
        "model": MODEL,
        "choices": [{"index": 0, "message": message}],
        "usage": usage,
    }


def chunk(text: str) -> dict:
    return {
        "id": "c",
        "object": "chat.completion.chunk",
        "model": MODEL,
        "choices": [{"index": 0, "delta": {"content": text}}],
    }


def event(payload: dict) -> bytes:
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


def held_workers(serve, gateway_process, settings: str = ""):
    backend = HeldBackend()
    server = serve(backend)
    gw = gateway_process(
        f'workers = {WORKERS}\nadmin_token = "t"\nthreshold = 32\n{settings}'
        f'[pools.speculative]\nbackends = ["{server.url}"]\n[pools.plain]\nbackends = ["{server.url}"]\n'
    )
    yield gw, backend
    backend.open.set()


@pytest.fixture
def two_workers(serve, gateway_process):
    yield from held_workers(serve, gateway_process)


@pytest.fixture
def watched_workers(serve, gateway_process):
    """Two workers, each killed and replaced once its loop is silent for WORKER_TIMEOUT_S."""
    yield from held_workers(serve, gateway_process, f"worker_timeout = {WORKER_TIMEOUT_S}\n")


ADMIN = {"authorization": "Bearer t"}


def on_worker(url: str, wanted: int) -> httpx.Client:
    """A client whose one kept-alive connection is on worker `wanted`."""
    for _ in range(TRIES):
        client = httpx.Client(base_url=url, limits=ONE_CONNECTION, trust_env=False, timeout=30)
        if client.get("/health").json()["worker"] == wanted:
            return client
        client.close()
    raise AssertionError(f"no connection reached worker {wanted} in {TRIES} tries")


def each_worker(url: str) -> dict[int, httpx.Client]:
    return {worker: on_worker(url, worker) for worker in range(WORKERS)}


def scrape(client: httpx.Client) -> dict[tuple[str, tuple], float]:
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(client.get("/metrics").text)
        for sample in family.samples
    }


def total(samples: dict, name: str, **labels: str) -> float:
    return sum(
        value for (sample, pairs), value in samples.items() if sample == name and set(labels.items()) <= set(pairs)
    )


async def wait_for(condition, what: str) -> None:
    await asyncio.to_thread(wait_until, condition, what=what)


def test_requests_spread_over_both_workers_and_either_one_reports_the_sum(two_workers):
    async def scenario() -> None:
        gw, backend = two_workers
        backend.open.clear()  # all 200 at once: each on its own connection
        async with httpx.AsyncClient(limits=httpx.Limits(max_connections=200), trust_env=False, timeout=60) as client:
            sent = [asyncio.create_task(client.post(gw.url + "/v1/chat/completions", json=chat())) for _ in range(200)]
            await wait_for(lambda: backend.pending == 200, "200 requests at the backend")
            backend.open.set()
            responses = await asyncio.gather(*sent)
        assert [response.status_code for response in responses] == [200] * 200

        for worker, client in each_worker(gw.url).items():
            with contextlib.closing(client):
                wait_until(
                    lambda c=client: total(scrape(c), "crossover_requests_total", outcome="ok") == 200, what="the sum"
                )
                samples = scrape(client)
                split = [total(samples, "crossover_worker_requests_total", worker=str(slot)) for slot in range(WORKERS)]
                assert sum(split) == 200 and min(split) > 0, (worker, split)
                assert total(samples, "crossover_request_duration_seconds_count") == 200
                assert total(samples, "crossover_inflight_requests") == 0

    asyncio.run(scenario())


def test_inflight_counts_are_the_hosts_from_either_worker_and_routing_reads_them(two_workers):
    async def scenario() -> None:
        gw, backend = two_workers
        backend.open.clear()
        async with httpx.AsyncClient(limits=httpx.Limits(max_connections=50), trust_env=False, timeout=60) as client:
            sent = []
            for held in range(1, 51):  # one after another, so spillover's decisions are deterministic
                sent.append(asyncio.create_task(client.post(gw.url + "/v1/chat/completions", json=chat())))
                await wait_for(lambda held=held: backend.pending == held, f"{held} requests at the backend")
            for worker, admin in each_worker(gw.url).items():
                with contextlib.closing(admin):
                    state = admin.get("/admin/state", headers=ADMIN).json()
                    assert state["worker"]["slot"] == worker
                    # Spillover at 32 over the host's load: 32 speculative, the rest plain, whichever worker took them.
                    assert (state["pools"]["speculative"]["inflight"], state["pools"]["plain"]["inflight"]) == (32, 18)
                    samples = scrape(admin)
                    assert total(samples, "crossover_inflight_requests", pool="speculative") == 32
                    assert total(samples, "crossover_backend_inflight_requests") == 50
            backend.open.set()
            assert {response.status_code for response in await asyncio.gather(*sent)} == {200}

    asyncio.run(scenario())


async def held_streams(url: str, per_worker: int) -> dict[int, list[tuple[httpx.AsyncClient, AsyncIterator[bytes]]]]:
    """`per_worker` streams on each worker, each past its first event (the backend holds the rest)."""
    streams: dict[int, list] = {worker: [] for worker in range(WORKERS)}
    for _ in range(TRIES):
        if all(len(held) == per_worker for held in streams.values()):
            return streams
        client = httpx.AsyncClient(base_url=url, limits=ONE_CONNECTION, trust_env=False, timeout=60)
        worker = (await client.get("/health")).json()["worker"]
        if len(streams[worker]) == per_worker:
            await client.aclose()
            continue
        request = client.build_request("POST", "/v1/chat/completions", json=chat(stream=True))
        response = await client.send(request, stream=True)
        assert response.status_code == 200
        parts = response.aiter_raw()
        await anext(parts)
        streams[worker].append((client, parts))
    raise AssertionError(f"{per_worker} streams per worker not reached in {TRIES} connections")


async def finished(client: httpx.AsyncClient, parts: AsyncIterator[bytes]) -> bool:
    """Whether the rest of the stream came, to its [DONE]."""
    try:
        rest = b"".join([part async for part in parts])
    except httpx.TransportError:
        return False
    finally:
        await client.aclose()
    return "[DONE]" in sse_events(rest)


def worker_pid(url: str, worker: int) -> int:
    with contextlib.closing(on_worker(url, worker)) as client:
        return client.get("/admin/state", headers=ADMIN).json()["worker"]["pid"]


async def worker_0_with_streams(gw, backend: HeldBackend, per_worker: int) -> tuple[int, dict[int, list]]:
    """Worker 0's pid, and `per_worker` streams on each worker held by the backend (held_streams)."""
    pid = worker_pid(gw.url, 0)
    backend.open.clear()
    return pid, await held_streams(gw.url, per_worker)


async def replaced(gw, backend: HeldBackend, streams: dict[int, list], dead: int) -> None:
    """Worker 0 (pid `dead`) died during `streams` (held_streams): once the backend lets them end, worker 1's end
    whole and worker 0's are cut, and a replacement serves in slot 0."""
    backend.open.set()
    survivors = await asyncio.gather(*(finished(*held) for held in streams[1]))
    assert survivors == [True] * len(streams[1])
    cut = await asyncio.gather(*(finished(*held) for held in streams[0]))
    assert cut == [False] * len(streams[0])
    await wait_for(lambda: worker_pid(gw.url, 0) != dead, "a replacement in slot 0")


def test_a_worker_killed_under_load_leaves_the_others_streams_whole_and_is_replaced(two_workers):
    async def scenario() -> None:
        gw, backend = two_workers
        with contextlib.closing(on_worker(gw.url, 0)) as client:
            for _ in range(3):
                assert client.post("/v1/chat/completions", json=chat()).status_code == 200
        with contextlib.closing(on_worker(gw.url, 1)) as client:  # a scrape asks worker 0 to publish its count
            wait_until(lambda: total(scrape(client), "crossover_worker_requests_total", worker="0") == 3)
        killed, streams = await worker_0_with_streams(gw, backend, 3)
        os.kill(killed, signal.SIGKILL)
        await wait_for(lambda: b"was killed by SIGKILL" in gw.log().encode(), "the supervisor to see the death")
        await replaced(gw, backend, streams, killed)
        with contextlib.closing(on_worker(gw.url, 0)) as client:
            assert client.post("/v1/chat/completions", json=chat()).status_code == 200
            # The dead worker's streams no longer count; what it had served before still does, in its slot too.
            samples = scrape(client)
            assert total(samples, "crossover_inflight_requests") == 0
            assert total(samples, "crossover_backend_inflight_requests") == 0
            assert total(samples, "crossover_worker_requests_total", worker="0") == 4

    asyncio.run(scenario())


def test_sigterm_drains_every_worker_then_exits_0(two_workers):
    async def scenario() -> None:
        gw, backend = two_workers
        backend.open.clear()
        streams = await held_streams(gw.url, 2)
        gw.proc.send_signal(signal.SIGTERM)

        def refused() -> bool:
            # Refused, or reset unanswered: a connection the kernel queued on a listening socket as it closed is
            # reset with it (SO_REUSEPORT), which to a client is the same - nothing was served.
            with contextlib.suppress(httpx.ConnectError, httpx.ReadError, httpx.RemoteProtocolError):
                httpx.get(gw.url + "/health", timeout=5, trust_env=False)
                return False
            return True

        await wait_for(refused, "new connections refused")
        backend.open.set()
        done = await asyncio.gather(*(finished(*held) for held in streams[0] + streams[1]))
        assert done == [True] * 4
        assert await asyncio.to_thread(gw.proc.wait, 30) == 0

    asyncio.run(scenario())


def test_limits_are_the_hosts_split_exactly_between_the_workers(serve, gateway_process):
    assert [share(5, 2, slot) for slot in range(2)] == [3, 2]
    assert [share(0, 3, slot) for slot in range(3)] == [0, 0, 0]
    assert sum(share(1024, 7, slot) for slot in range(7)) == 1024

    backend = HeldBackend()
    backend.open.clear()
    server = serve(backend)
    gw = gateway_process(
        f"workers = {WORKERS}\n[limits]\nmax_inflight = 4\nmax_queued = 0\n"
        f'[pools.speculative]\nbackends = ["{server.url}"]\n[pools.plain]\nbackends = ["{server.url}"]\n'
    )
    # Two requests on each worker's connection: its share, so all four are admitted and nothing more.
    clients = [on_worker(gw.url, worker) for worker in range(WORKERS) for _ in range(2)]
    pool = [
        threading.Thread(target=client.post, args=("/v1/chat/completions",), kwargs={"json": chat()})
        for client in clients
    ]
    for thread in pool:
        thread.start()
    wait_until(lambda: backend.pending == 4, what="four requests admitted")
    with contextlib.closing(on_worker(gw.url, 0)) as extra:
        refused = extra.post("/v1/chat/completions", json=chat())
    assert refused.status_code == 429 and backend.pending == 4
    backend.open.set()
    for thread in pool:
        thread.join(60)
    for client in clients:
        client.close()


def test_more_workers_than_max_inflight_is_refused(tmp_path):
    from tests.gateway.serve.test_commands import refused_serve

    config = tmp_path / "many.toml"
    config.write_text(
        'workers = 3\n[limits]\nmax_inflight = 2\n[pools.speculative]\nbackends = ["http://127.0.0.1:1"]\n'
        '[pools.plain]\nbackends = ["http://127.0.0.1:1"]\n'
    )
    result = refused_serve(config)
    assert result.returncode == 2 and "workers = 3 is more than limits.max_inflight = 2" in result.stderr


def test_a_threshold_put_on_one_worker_reads_back_on_the_other_and_one_worker_leads(two_workers):
    gw, _ = two_workers
    workers = each_worker(gw.url)
    try:
        put = workers[0].put("/admin/threshold", headers=ADMIN, json={"threshold": 7, "hysteresis": 2})
        assert put.status_code == 200, put.text

        def read_back() -> dict:
            return workers[1].get("/admin/threshold", headers=ADMIN).json()

        assert read_back()["threshold"] == 7  # right after the 200: a GET reads what the other worker wrote first
        assert {key: read_back()[key] for key in ("threshold", "hysteresis", "policy")} == {
            "threshold": 7,
            "hysteresis": 2,
            "policy": "spillover",
        }
        assert total(scrape(workers[1]), "crossover_routing_threshold") == 7

        roles = [client.get("/admin/state", headers=ADMIN).json()["cluster"]["role"] for client in workers.values()]
        assert sorted(roles) == ["follower", "leader"]
        assert total(scrape(workers[0]), "crossover_cluster_leader") == 1  # the host's: one of its workers
    finally:
        for client in workers.values():
            client.close()


@needs_redis
def test_with_redis_the_hosts_counts_are_published_once_and_not_counted_twice(serve, gateway_process):
    redis = RedisServer.start()
    try:
        backend = HeldBackend()
        server = serve(backend)
        # The cluster counts by backend URL: the plain pool's is another name for the same server.
        plain = server.url.replace("127.0.0.1", "localhost")
        config = (
            f'admin_token = "t"\nthreshold = 32\n[cluster]\nredis_url = "{redis.url}"\nsync_interval = 0.1\n'
            f'[pools.speculative]\nbackends = ["{server.url}"]\n[pools.plain]\nbackends = ["{plain}"]\n'
        )
        host = gateway_process(f"workers = {WORKERS}\n" + config)
        replica = gateway_process(config)
        backend.open.clear()

        async def scenario() -> None:
            async with httpx.AsyncClient(
                limits=httpx.Limits(max_connections=10), trust_env=False, timeout=60
            ) as client:
                sent = [
                    asyncio.create_task(client.post(host.url + "/v1/chat/completions", json=chat())) for _ in range(10)
                ]
                await wait_for(lambda: backend.pending == 10, "10 requests at the backend")

                def load(url: str) -> int:
                    return httpx.get(url + "/admin/state", headers=ADMIN, trust_env=False).json()["pools"][
                        "speculative"
                    ]["load"]

                # The other replica sees the host's 10 (all its workers publish the same host count, under one name).
                await wait_for(lambda: load(replica.url) == 10, "the replica to see the host's requests")
                for worker, admin in each_worker(host.url).items():
                    with contextlib.closing(admin):
                        state = admin.get("/admin/state", headers=ADMIN).json()["pools"]["speculative"]
                        assert (state["inflight"], state["load"]) == (10, 10), worker  # not 20: its own, once
                backend.open.set()
                assert {response.status_code for response in await asyncio.gather(*sent)} == {200}

        asyncio.run(scenario())
    finally:
        redis.stop()


@pytest.mark.parametrize("leader_ends", ["killed", "hung"])
def test_time_shared_one_worker_leads_and_an_operator_switch_on_a_follower_is_one_switch(
    sim, gateway_process, leader_ends
):
    speculative, plain = sim("k25-eagle3", *SIM_SCALE), sim("k25-plain", *SIM_SCALE)
    httpx.post(plain.url + "/release_memory_occupation", json={}, timeout=30, trust_env=False).raise_for_status()
    gw = gateway_process(
        f'workers = {WORKERS}\nworker_timeout = {WORKER_TIMEOUT_S}\nadmin_token = "t"\ntopology = "time-shared"\n'
        'policy = "switch"\nthreshold = 6\nhysteresis = 3\n[switching]\nmechanism = "sleep"\ndwell = 3600.0\n'
        "interval = 0.05\nwindow = 0.5\noperator_interval = 0.0\n"
        f'[pools.speculative]\nbackends = ["{speculative.url}"]\n[pools.plain]\nbackends = ["{plain.url}"]\n'
    )
    workers = each_worker(gw.url)
    try:

        def state(worker: int) -> dict:
            seen = workers[worker].get("/admin/state", headers=ADMIN).json()
            assert seen["worker"]["slot"] == worker
            return seen

        wait_until(
            lambda: sorted(state(w)["cluster"]["role"] for w in workers) == ["follower", "leader"], what="a leader"
        )
        follower = next(w for w in workers if state(w)["cluster"]["role"] == "follower")
        # Once the leader has published what serves (a follower's request written before that is overwritten by it:
        # the control state is last-writer-wins, gateway/cluster/coordination.py).
        wait_until(lambda: state(1 - follower)["last_decision"] is not None, what="the leader deciding")
        wait_until(lambda: state(follower)["phase"] == "active", what="the follower to see the mode")
        assert workers[follower].put("/admin/mode", headers=ADMIN, json={"mode": "plain"}).status_code == 202
        for worker in workers:
            wait_until(lambda w=worker: (state(w)["phase"], state(w)["mode"]) == ("active", "plain"), 60, "plain")
        switches = total(scrape(workers[0]), "crossover_mode_switches_total", to="plain")
        assert switches == 1  # the leader's, once: the follower ran none
        assert workers[follower].post("/v1/chat/completions", json=chat()).headers["x-crossover-pool"] == "plain"

        # The leader killed, or hung (stopped: it would hold its lock for as long as it is) until the supervisor kills
        # it for its silence: the kernel drops its lock, and the follower or the leader's replacement takes the
        # lease, with a larger token, on the mode the GPU set is in.
        leader = 1 - follower
        token, pid = state(leader)["cluster"]["fence"], state(leader)["worker"]["pid"]

        def led_again() -> bool:  # asked on a new connection each time: whichever worker the kernel picks (one that
            # lands on the hung worker's socket waits in its backlog for the replacement)
            seen = httpx.get(gw.url + "/admin/state", headers=ADMIN, timeout=60, trust_env=False).json()
            return seen["cluster"]["role"] == "leader" and seen["cluster"]["fence"] > token and seen["mode"] == "plain"

        if leader_ends == "killed":
            os.kill(pid, signal.SIGKILL)
        with stopped(pid) if leader_ends == "hung" else contextlib.nullcontext():
            wait_until(led_again, 60, "a new leader")
        assert total(scrape(workers[follower]), "crossover_workers_killed_total") == int(leader_ends == "hung")
        # One leader on the host: the dead one's gauge is not kept.
        wait_until(lambda: total(scrape(workers[follower]), "crossover_cluster_leader") == 1, what="one leader")
    finally:
        for client in workers.values():
            client.close()


def test_sigint_stops_every_worker_and_exits_130(serve, gateway_process):
    server = serve(HeldBackend())
    gw = gateway_process(
        f'workers = {WORKERS}\nadmin_token = "t"\n'
        f'[pools.speculative]\nbackends = ["{server.url}"]\n[pools.plain]\nbackends = ["{server.url}"]\n'
    )
    pids = {worker_pid(gw.url, worker) for worker in range(WORKERS)}
    gw.proc.send_signal(signal.SIGINT)
    assert gw.proc.wait(30) == 130
    for pid in pids:  # gone, not orphaned
        wait_until(lambda pid=pid: not os.path.exists(f"/proc/{pid}"), what=f"worker {pid} to end")


@contextlib.contextmanager
def stopped(pid: int) -> Iterator[None]:
    """`pid` stopped (SIGSTOP) as a hung worker is; let go after, so a failed test leaves no stopped process."""
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)


def test_a_stopped_worker_is_killed_and_replaced_while_the_other_serves_on(watched_workers):
    async def scenario() -> None:
        gw, backend = watched_workers
        hung, streams = await worker_0_with_streams(gw, backend, 2)
        async with httpx.AsyncClient(limits=httpx.Limits(max_connections=10), trust_env=False, timeout=60) as client:
            with stopped(hung):
                # New connections meanwhile: those the kernel gives the stopped worker's socket wait in its backlog,
                # for the replacement.
                sent = [
                    asyncio.create_task(client.post(gw.url + "/v1/chat/completions", json=chat())) for _ in range(10)
                ]
                await wait_for(lambda: f"worker 0 (pid {hung}) silent for" in gw.log(), "the supervisor to kill it")
                await wait_for(lambda: "was killed by SIGKILL" in gw.log(), "the supervisor to see the death")
            await replaced(gw, backend, streams, hung)
            assert [response.status_code for response in await asyncio.gather(*sent)] == [200] * 10
        for worker, client in each_worker(gw.url).items():
            with contextlib.closing(client):
                assert client.post("/v1/chat/completions", json=chat()).status_code == 200, worker
                assert total(scrape(client), "crossover_workers_killed_total") == 1, worker

    asyncio.run(scenario())


def test_while_draining_a_silent_worker_is_killed_and_a_draining_one_is_not(watched_workers):
    async def scenario() -> None:
        gw, backend = watched_workers
        hung, streams = await worker_0_with_streams(gw, backend, 1)
        with stopped(hung):
            gw.proc.send_signal(signal.SIGTERM)  # worker 0 will never drain; worker 1 drains its held stream
            await wait_for(lambda: f"worker 0 (pid {hung}) silent for" in gw.log(), "the supervisor to kill it")
        # Worker 1 drained for as long (a drain's loop still beats): never judged silent.
        assert "worker 1 (pid" not in gw.log()
        backend.open.set()
        assert [await finished(*held) for held in streams[1] + streams[0]] == [True, False]
        assert await asyncio.to_thread(gw.proc.wait, 30) == 0

    asyncio.run(scenario())


def test_only_a_worker_that_serves_and_has_beaten_is_judged_silent(tmp_path):
    host = Host(3, 2, tmp_path)
    pids = {101: 0, 102: 1, 103: 2}
    now, timeout_ms = heartbeat_ms(), WORKER_TIMEOUT_S * 1000
    host.row(1)[PID] = 102  # serves, but its loop has not beaten yet; slot 0 has not even served
    assert silent(host, pids, now + 10**9, timeout_ms) == []

    host.row(1)[HEARTBEAT] = now
    host.row(2)[PID], host.row(2)[HEARTBEAT] = 103, now
    assert silent(host, pids, now + int(timeout_ms), timeout_ms) == []
    late = now + int(timeout_ms) + 1
    assert silent(host, pids, late, timeout_ms) == [(102, 1, late - now), (103, 2, late - now)]
    # A replacement starting in slot 2 (its predecessor's row zeroed when it was reaped) is not judged on it.
    host.retire(2)
    assert silent(host, {**pids, 104: 2}, late, timeout_ms) == [(102, 1, late - now)]


def test_the_heartbeat_comes_from_the_workers_event_loop(tmp_path):
    worker = Worker(Host(1, 2, tmp_path), 0)

    async def scenario() -> None:
        worker.serving()
        beating = asyncio.create_task(worker.publish_every(CollectorRegistry(), Admission(8, 8, 1.0)))
        assert worker.host.silent_ms(0, heartbeat_ms()) is None  # serving, not beaten yet: not judged
        await asyncio.sleep(0)  # the loop turns once
        assert 0 <= worker.host.silent_ms(0, heartbeat_ms()) < WORKER_TIMEOUT_S * 1000
        beating.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await beating

    asyncio.run(scenario())


def test_the_folder_of_a_supervisor_killed_by_sigkill_is_removed_by_the_next_one(serve, gateway_process):
    backend = serve(HeldBackend())
    config = f'workers = {WORKERS}\n[pools.speculative]\nbackends = ["{backend.url}"]\n'
    config += f'[pools.plain]\nbackends = ["{backend.url}"]\n'
    first = gateway_process(config)
    parent = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    (folder,) = parent.glob(f"{FOLDER_PREFIX}{first.proc.pid}-*")
    first.proc.kill()  # no cleanup runs: the folder stays behind
    first.proc.wait(30)
    assert folder.is_dir()
    second = gateway_process(config)
    assert not folder.exists()
    assert list(parent.glob(f"{FOLDER_PREFIX}{second.proc.pid}-*"))  # its own is there


def test_only_the_folders_of_supervisors_that_are_gone_are_removed(tmp_path):
    ended = subprocess.Popen(["true"])  # its pid: nothing runs under it once it is reaped
    ended.wait()
    dead = tmp_path / f"{FOLDER_PREFIX}{ended.pid}-abc"
    alive = tmp_path / f"{FOLDER_PREFIX}{os.getpid()}-def"
    other = tmp_path / "crossover-workers-notapid"
    for folder in (dead, alive, other):
        folder.mkdir()
    remove_orphans(tmp_path)
    assert not dead.exists() and alive.is_dir() and other.is_dir()
