"""The proxy path: bytes pass through unchanged, headers are cleaned, and every request - finished, failed,
timed out or abandoned by its client - leaves nothing in flight, here or in the engine."""

from __future__ import annotations

import asyncio
import json
import logging
import random
import socket
import threading
import time

import httpx
import pytest

from crossover.gateway.app import create_app
from crossover.gateway.config import Settings, TimeoutSettings
from crossover.gateway.errors import ClientGone
from crossover.gateway.request.proxy import Exchange
from crossover.gateway.request.validation import CHAT
from tests.gateway.gateway_helpers import (
    LONG,
    Scripted,
    chat,
    content_length,
    raw_post,
    sglang_error,
    sim_running,
    sse_events,
    stream_text,
    wait_until,
)

SSE = [(b"content-type", b"text/event-stream")]
# Deliberately awkward: an event split across two chunks, a comment, a usage event, no trailing newline games.
ODD_CHUNKS = [
    b'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}\n\n',
    b'data: {"choices":[{"index":0,"delta":{"content":"Hel"}}]}\n\ndata: {"choices":[{"index":0,',
    b'"delta":{"content":"lo"}}]}\n\n: keep-alive\n\n',
    b'data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":2,"total_tokens":5}}\n\n',
    b"data: [DONE]\n\n",
]


def test_bodies_and_streams_pass_through_byte_for_byte(serve, gateway):
    backend = Scripted(chunks=ODD_CHUNKS, headers=SSE, gap_s=0.01)
    url = serve(backend).url
    gw = gateway([url], [url])
    # Field order, spacing and fields no OpenAI model has must all reach the backend untouched.
    body = json.dumps(
        {
            "stream": True,
            **chat(True),
            "logit_bias": {"42": -100},
            "chat_template_kwargs": {"thinking": True},
            "x_vendor": [1, {"a": None}],
            "stream_options": {"include_usage": True},
        },
        indent=1,
    ).encode()
    with (
        httpx.Client(base_url=gw.url, timeout=10, trust_env=False) as client,
        client.stream(
            "POST", "/v1/chat/completions", content=body, headers={"content-type": "application/json"}
        ) as response,
    ):
        raw = b"".join(response.iter_raw())
    assert response.status_code == 200
    assert raw == b"".join(ODD_CHUNKS)
    gw.settled()
    assert backend.requests[0][2] == body
    assert response.headers["x-crossover-pool"] == "speculative"
    assert gw.metric("crossover_output_tokens_total", pool="speculative") == 2
    assert gw.metric("crossover_requests_total", pool="speculative", outcome="ok") == 1
    assert gw.metric("crossover_time_to_first_token_seconds_count", pool="speculative") == 1


def test_hop_by_hop_headers_are_stripped_both_ways(serve, gateway):
    backend = Scripted(
        body=b'{"choices": [], "usage": {"completion_tokens": 4}}',
        headers=[
            (b"content-type", b"application/json"),
            (b"x-backend", b"kept"),
            (b"x-backend-hop", b"1"),
            (b"connection", b"x-backend-hop"),
            (b"keep-alive", b"timeout=5"),
        ],
    )
    url = serve(backend).url
    gw = gateway([url], [url])
    sent = {
        "connection": "keep-alive, x-client-hop",
        "x-client-hop": "1",
        "keep-alive": "timeout=9",
        "te": "trailers",
        "proxy-authorization": "Basic eA==",
        "authorization": "Bearer sk-test",
        "x-custom": "yes",
    }
    with httpx.Client(base_url=gw.url, timeout=10, trust_env=False) as client:
        response = client.post("/v1/chat/completions", json=chat(), headers=sent)
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 4
    assert response.headers["x-backend"] == "kept"
    assert "x-backend-hop" not in response.headers and "keep-alive" not in response.headers
    received = backend.requests[0][1]
    assert received[b"authorization"] == b"Bearer sk-test" and received[b"x-custom"] == b"yes"
    for hop in (b"x-client-hop", b"keep-alive", b"te", b"proxy-authorization"):
        assert hop not in received, hop
    assert received[b"x-request-id"] == response.headers["x-request-id"].encode()
    gw.settled()
    assert gw.metric("crossover_output_tokens_total", pool="speculative") == 4


def test_a_stalled_stream_ends_with_an_error_event_and_done(serve, gateway):
    backend = Scripted(chunks=ODD_CHUNKS, headers=SSE, stall_after=2)
    url = serve(backend).url
    gw = gateway([url], [url], timeouts={"between_chunks": 0.5})

    async def scenario():
        async with (
            httpx.AsyncClient(base_url=gw.url, timeout=10, trust_env=False) as client,
            client.stream("POST", "/v1/chat/completions", json=chat(True)) as response,
        ):
            chunks = response.aiter_raw()
            first = await anext(chunks)  # passed on while the backend is still going: no buffering
            rest = b"".join([chunk async for chunk in chunks])
        return first, rest

    first, rest = asyncio.run(scenario())
    assert first.startswith(ODD_CHUNKS[0])
    # The backend stalled in the middle of an event: the client gets the whole events before it, then the error.
    events = sse_events(first + rest)
    assert stream_text(events) == "Hel"
    assert events[-1] == "[DONE]"
    assert events[-2]["error"]["type"] == "timeout_error" and "stalled" in events[-2]["error"]["message"]
    gw.settled()
    assert gw.metric("crossover_requests_total", pool="speculative", outcome="timeout") == 1


class GatedStream(Scripted):
    """Streams its first `gate_after` chunks, then, once the test opens `gate`, either the next one, waiting for
    the gateway to hang up (`hung_up`) before the rest, or (`rest_at_once`) all the rest and the end in one write."""

    def __init__(self, gate_after: int, rest_at_once: bool, **script) -> None:
        super().__init__(**script)
        self.gate_after, self.rest_at_once, self.gate = gate_after, rest_at_once, threading.Event()
        self.hung_up = threading.Event()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"] in ("/health", "/v1/models"):
            await super().__call__(scope, receive, send)
            return
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": self.headers})
        for chunk in self.chunks[: self.gate_after]:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await asyncio.to_thread(self.gate.wait, 30)
        rest = self.chunks[self.gate_after :]
        if self.rest_at_once:
            await send({"type": "http.response.body", "body": b"".join(rest), "more_body": False})
            return
        await send({"type": "http.response.body", "body": rest[0], "more_body": True})
        if await self._disconnected(receive, 30):
            self.hung_up.set()
            return
        for chunk in rest[1:]:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


@pytest.mark.parametrize("rest_at_once", [False, True], ids=["piece-by-piece", "the-rest-at-once"])
def test_junk_pipelined_behind_a_stream_stops_it_and_nothing_of_it_follows_the_refusal(
    serve, gateway, caplog, rest_at_once
):
    """A stream under way goes from the backend's read callback to the client's connection. A request and junk
    pipelined behind it are refused at once (400, the connection shut for writing): nothing more of the stream is
    written after the refusal, and the stream ends as a client that left - whether what the backend sends next is
    one more piece (it hears the gateway hang up) or all the rest with the end."""
    events = [b'data: {"choices":[{"index":0,"delta":{"content":"%d"}}]}\n\n' % i for i in range(8)]
    backend = GatedStream(gate_after=2, rest_at_once=rest_at_once, chunks=events, headers=SSE)
    url = serve(backend).url
    gw = gateway([url], [url], health={"interval": 60})
    port = int(gw.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(raw_post(json.dumps(chat(stream=True)).encode()))
        received = b""
        while b'"content":"1"' not in received:  # the stream is under way
            received += sock.recv(65536)
        # A request pipelined behind it (the connection's newest), then junk: only the newest hears the refusal.
        sock.sendall(raw_post(json.dumps(chat()).encode()) + b"junk\r\n\r\n")
        while True:  # the refusal, then the connection shut for writing
            data = sock.recv(65536)
            if not data:
                break
            received += data
        backend.gate.set()
        wait_until(lambda: not gw.app.live.requests, what="the stream ended")
    if not rest_at_once:
        assert backend.hung_up.wait(10), "the backend never heard that the stream was cut"
    _, refusal = received.split(b"HTTP/1.1 400 ", 1)
    head, _, rest = refusal.partition(b"\r\n\r\n")
    length = content_length(head)
    assert json.loads(rest[:length])["error"]["code"] == "invalid_http_request"
    assert rest[length:] == b""  # nothing of the stream after the refusal
    gw.settled()
    assert gw.metric("crossover_requests_total", pool="speculative", outcome="client_disconnect") == 1
    errors = [record for record in caplog.records if record.levelno >= logging.WARNING]
    assert not errors, [record.getMessage() for record in errors]


@pytest.mark.parametrize("status", [500, 400])
def test_an_error_event_after_the_first_tokens_is_a_failure_in_the_gateways_shape(serve, gateway, status):
    """SGLang reports a failure after tokens have gone out as an event in its own shape (HTTP 200 by then). The
    client gets it in the gateway's OpenAI shape, SGLang's message and status kept, and the request counts as
    what it was: the backend's failure (a 500) or the request's (a 400) - not `ok`."""
    message = "Internal server error: CUDA error: an illegal memory access" if status == 500 else "bad logit_bias"
    kind = "InternalServerError" if status == 500 else "BadRequest"
    error = b"data: %s\n\n" % json.dumps({"error": sglang_error(message, status, kind)}).encode()
    backend = Scripted(chunks=[*ODD_CHUNKS[:3], error, b"data: [DONE]\n\n"], headers=SSE)
    url = serve(backend).url
    gw = gateway([url], [url], health={"interval": 60})
    response = httpx.post(gw.url + "/v1/chat/completions", json=chat(True), timeout=10, trust_env=False)
    events = sse_events(response.content)
    assert response.status_code == 200 and stream_text(events) == "Hello"
    assert events[-1] == "[DONE]"
    assert events[-2] == {
        "error": {"message": message, "type": "api_error" if status == 500 else "invalid_request_error",
                  "param": None, "code": status}
    }  # fmt: skip
    gw.settled()
    outcome = "backend_error" if status == 500 else "bad_request"
    assert gw.metric("crossover_requests_total", pool="speculative", outcome=outcome) == 1
    assert gw.metric("crossover_requests_total", pool="speculative", outcome="ok") == 0


@pytest.mark.parametrize(("stream", "timeouts"), [(False, {"non_stream": 0.3}), (True, {"first_byte": 0.3})])
def test_no_first_byte_in_time_is_504_and_not_retried_by_the_sdk(serve, gateway, stream, timeouts):
    url = serve(Scripted(body=b"{}", delay_s=30)).url
    gw = gateway([url], [url], timeouts=timeouts)
    with httpx.Client(base_url=gw.url, timeout=10, trust_env=False) as client:
        response = client.post("/v1/chat/completions", json=chat(stream))
    assert response.status_code == 504
    assert response.json()["error"]["code"] == "backend_timeout"
    assert response.headers["x-should-retry"] == "false"
    gw.settled()
    assert gw.metric("crossover_requests_total", pool="speculative", outcome="timeout") == 1
    # A timeout is the request's outcome, not evidence against the backend.
    assert all(backend.healthy for backend in gw.state.pools.all())


# Our server tells the app when a client leaves; on any other ASGI server the gateway listens with receive().
SERVERS = pytest.mark.parametrize("plain_uvicorn", [False, True], ids=["crossover-protocol", "plain-uvicorn"])


@SERVERS
def test_client_disconnect_mid_stream_aborts_the_backend_request(sims, gateway, plain_uvicorn):
    speculative, plain = sims
    gw = gateway([speculative.url], [plain.url], plain_uvicorn=plain_uvicorn)

    async def scenario():
        async with (
            httpx.AsyncClient(base_url=gw.url, timeout=10, trust_env=False) as client,
            client.stream("POST", "/v1/chat/completions", json=chat(True, LONG)) as response,
        ):
            await anext(response.aiter_raw())
            assert sim_running(speculative.url) == 1

    asyncio.run(scenario())
    wait_until(lambda: sim_running(speculative.url) == 0, what="the stand-in to abort the request")
    gw.settled()
    assert gw.metric("crossover_requests_total", pool="speculative", outcome="client_disconnect") == 1


def test_a_request_cut_early_stays_cut_when_its_next_phase_begins():
    unused = "http://127.0.0.1:9"  # nothing is sent: the app's lifespan never runs
    # The client leaves just as the backend answers: the answer's phase must not move the cut deadline away.
    app = create_app(Settings(pools={"speculative": {"backends": [unused]}, "plain": {"backends": [unused]}}))

    async def scenario():
        exchange = Exchange(app.proxies[CHAT], {"headers": []}, send=None)
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(None) as exchange.deadline:
                exchange._client_left()
                exchange._move_deadline(exchange.loop.time() + 60)
                await asyncio.sleep(30)
        assert isinstance(exchange.cut, ClientGone)

    asyncio.run(asyncio.wait_for(scenario(), 10))


@SERVERS
def test_client_disconnect_while_queued_in_the_engine_or_not_streaming(sim, gateway, plain_uvicorn):
    # One running slot: a stream held directly on the stand-in makes the gateway's requests wait in its queue.
    speculative = sim("k25-eagle3", "--time-scale", "20", "--max-running-requests", "1")
    gw = gateway([speculative.url], [speculative.url], plain_uvicorn=plain_uvicorn)

    async def abandoned(body: dict) -> None:
        async with httpx.AsyncClient(timeout=10, trust_env=False) as client:
            request = client.build_request("POST", gw.url + "/v1/chat/completions", json=body)
            pending = asyncio.create_task(client.send(request, stream=True))
            while sim_running(speculative.url) < 2:  # the held stream + this one, queued
                await asyncio.sleep(0.02)
            pending.cancel()  # the client gives up before it has seen a byte
            await asyncio.gather(pending, return_exceptions=True)

    async def scenario():
        async with httpx.AsyncClient(timeout=10, trust_env=False) as direct:
            request = direct.build_request("POST", speculative.url + "/v1/chat/completions", json=chat(True, LONG))
            held = await direct.send(request, stream=True)
            try:
                await abandoned(chat(True, 16))
                await asyncio.to_thread(wait_until, lambda: sim_running(speculative.url) == 1)
                await abandoned(chat(False, 16))
                await asyncio.to_thread(wait_until, lambda: sim_running(speculative.url) == 1)
            finally:
                await held.aclose()

    asyncio.run(scenario())
    wait_until(lambda: sim_running(speculative.url) == 0)
    gw.settled()
    assert gw.metric("crossover_requests_total", pool="speculative", outcome="client_disconnect") == 2


async def raw_stream(port: int, body: bytes, drop_after_events: int | None) -> str:
    """One streaming request on a fresh connection; returns "done", "dropped" or what went wrong."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: gw\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (len(body), body)
        )
        if drop_after_events == 0:
            return "dropped"
        data = b""
        while chunk := await reader.read(65536):
            data += chunk
            if drop_after_events is not None and data.count(b"data:") >= drop_after_events:
                return "dropped"
        if not data.startswith(b"HTTP/1.1 200"):
            return data.split(b"\r\n", 1)[0].decode()
        return "done" if b"data: [DONE]" in data and b'"error"' not in data else "incomplete"
    finally:
        writer.close()


def test_a_thousand_streams_with_random_disconnects_leave_nothing_in_flight(sim, gateway_process):
    speculative = sim("k25-eagle3", "--time-scale", "100")
    plain = sim("k25-plain", "--time-scale", "100")
    gw = gateway_process(
        f'threshold = 32\n[pools.speculative]\nbackends = ["{speculative.url}"]\n'
        f'[pools.plain]\nbackends = ["{plain.url}"]\n'
    )
    body = json.dumps(chat(True, 32)).encode()
    # Clients that hang up asked for long answers: if hanging up did not abort them in the engine, the
    # stand-ins would still be busy with them long after the test's wait below.
    long_body = json.dumps(chat(True, LONG)).encode()
    rng = random.Random(7)
    # 30% of clients hang up at a random point: before any byte, or after 1 to 8 events.
    plan = [rng.randint(0, 8) if rng.random() < 0.3 else None for _ in range(1000)]

    async def run_all() -> list[str]:
        limit = asyncio.Semaphore(200)

        async def one(drop: int | None) -> str:
            async with limit:
                return await asyncio.wait_for(raw_stream(gw.port, body if drop is None else long_body, drop), 120)

        return await asyncio.gather(*(one(drop) for drop in plan))

    results = asyncio.run(run_all())
    kept = [result for drop, result in zip(plan, results, strict=False) if drop is None]
    assert kept.count("done") == len(kept), sorted(set(kept))
    assert results.count("dropped") == len(plan) - len(kept)

    def settled() -> bool:
        samples = gw.metrics()
        inflight = [samples[("crossover_inflight_requests", (("pool", pool),))] for pool in ("speculative", "plain")]
        total = sum(value for (name, _), value in samples.items() if name == "crossover_requests_total")
        return inflight == [0, 0] and total == len(plan)

    wait_until(settled, what="the gateway to account for every request")
    wait_until(
        lambda: sim_running(speculative.url) == 0 and sim_running(plain.url) == 0,
        what="the stand-ins to report 0 running requests",
    )
    samples = gw.metrics()
    routed = {
        pool: samples.get(("crossover_requests_total", (("outcome", "ok"), ("pool", pool))), 0)
        for pool in ("speculative", "plain")
    }
    assert routed["speculative"] > 0 and routed["plain"] > 0  # spillover at 32 with 200 clients uses both
    assert not any(
        name == "crossover_requests_total" and dict(labels)["outcome"] not in ("ok", "client_disconnect")
        for (name, labels), value in samples.items()
        if value
    )


BIG_EVENT = b"data: " + b"x" * 65_000 + b"\n\n"


def test_a_slow_reader_gets_its_whole_stream_and_the_backend_is_not_blamed(serve, gateway):
    # ~33 MB, produced at once (more than the kernel buffers on both sides hold): the client's pause fills every
    # buffer, so the gateway's writes block for far longer than between_chunks. That silence is the client's.
    backend = Scripted(chunks=[BIG_EVENT] * 512 + [b"data: [DONE]\n\n"], headers=SSE)
    url = serve(backend).url
    gw = gateway([url], [url], timeouts={"between_chunks": 0.3})

    async def scenario():
        async with (
            httpx.AsyncClient(base_url=gw.url, timeout=30, trust_env=False) as client,
            client.stream("POST", "/v1/chat/completions", json=chat(True)) as response,
        ):
            received = 0
            async for chunk in response.aiter_raw():
                if received == 0:
                    await asyncio.sleep(1.5)
                received += len(chunk)
            return received

    received = asyncio.run(asyncio.wait_for(scenario(), 60))
    assert received == 512 * len(BIG_EVENT) + len(b"data: [DONE]\n\n")
    gw.settled()
    assert gw.metric("crossover_requests_total", pool="speculative", outcome="ok") == 1
    assert all(backend.healthy for backend in gw.state.pools.all())


SMALL_EVENT = b"data: " + b"y" * 1018 + b"\n\n"  # 1 KiB


def test_a_slow_but_steady_reader_is_never_cut(serve, gateway):
    """A client reading a little at a time, never pausing for long, from an answer produced at once. Once the
    buffers between them are full (the gateway's socket alone holds up to tcp_wmem's 4 MB), the kernel wants
    more only after a good part of them has drained, so one write of the gateway waits far longer than the
    reader takes for a little. What counts is that it keeps taking bytes. Scaled to seconds: client_write is
    0.5 s and the reader takes 20 KiB every 0.025 s (20 times inside it) of 6 MB; at that pace a blocked write
    lasts seconds."""
    total_events = 6000
    # Produced at once, in one piece: the gateway passes it on as fast as its buffers take it.
    backend = Scripted(chunks=[SMALL_EVENT * total_events, b"data: [DONE]\n\n"], headers=SSE)
    url = serve(backend).url
    gw = gateway([url], [url], timeouts={"between_chunks": 60, "client_write": 0.5}, health={"interval": 60})
    body = json.dumps(chat(True)).encode()
    received = b""
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 65536)  # before connecting: the window stays small
        sock.settimeout(30)
        sock.connect(("127.0.0.1", int(gw.url.rsplit(":", 1)[1])))
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"
            b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
        )
        while chunk := sock.recv(20480):
            received += chunk
            time.sleep(0.025)  # the reader's pace, the behaviour under test: not a wait for anything
    assert received.count(SMALL_EVENT) == total_events and received.rstrip(b"\r\n0").endswith(b"data: [DONE]")
    gw.settled()
    assert gw.metric("crossover_requests_total", pool="speculative", outcome="ok") == 1
    assert gw.metric("crossover_requests_total", pool="speculative", outcome="client_slow") == 0


def test_a_client_that_stops_reading_is_its_own_outcome_and_its_connection_is_dropped(serve, gateway):
    # The backend never goes silent (between_chunks is long): only the blocked write can cut this, after
    # client_write. The client's connection is then aborted - a graceful close would keep the descriptor and
    # every buffered byte for as long as the client cares not to read.
    backend = Scripted(chunks=[BIG_EVENT] * 512 + [b"data: [DONE]\n\n"], headers=SSE)
    url = serve(backend).url
    gw = gateway([url], [url], timeouts={"between_chunks": 60, "client_write": 0.5})
    body = json.dumps(chat(True)).encode()
    with socket.create_connection(("127.0.0.1", int(gw.url.rsplit(":", 1)[1])), timeout=10) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
        )
        assert sock.recv(100).startswith(b"HTTP/1.1 200")
        wait_until(
            lambda: gw.metric("crossover_requests_total", pool="speculative", outcome="client_slow") == 1,
            timeout=10,
            what="the stalled client's stream to be cut after client_write, not between_chunks",
        )
        with pytest.raises(ConnectionResetError):
            while sock.recv(65536):
                pass
    gw.settled()
    assert gw.metric("crossover_requests_total", pool="speculative", outcome="timeout") == 0
    assert all(backend.healthy and backend.failures == 0 for backend in gw.state.pools.all())


def test_http10_clients_get_no_chunked_encoding(serve, gateway):
    backend = Scripted(chunks=ODD_CHUNKS, headers=SSE, gap_s=0.01)
    url = serve(backend).url
    gw = gateway([url], [url])
    body = json.dumps(chat(True)).encode()
    with socket.create_connection(("127.0.0.1", int(gw.url.rsplit(":", 1)[1])), timeout=10) as sock:
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.0\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
            % (len(body), body)
        )
        raw = b""
        while chunk := sock.recv(65536):
            raw += chunk
    head, _, payload = raw.partition(b"\r\n\r\n")
    assert b"transfer-encoding" not in head.lower()
    assert b"content-length: %d" % len(payload) in head.lower()
    assert payload == b"".join(ODD_CHUNKS)


def test_the_query_string_reaches_the_backend(serve, gateway):
    backend = Scripted(body=json.dumps({"choices": []}).encode())
    url = serve(backend).url
    gw = gateway([url], [url])
    with httpx.Client(base_url=gw.url, timeout=10, trust_env=False) as client:
        assert client.post("/v1/chat/completions?api-version=2024-06-01", json=chat()).status_code == 200
    assert backend.requests[0][0] == "/v1/chat/completions"
    assert backend.queries == [b"api-version=2024-06-01"]


def test_a_200_error_body_to_a_non_streaming_request_is_not_a_success(serve, gateway):
    event = b'data: {"error": {"message": "bad logit_bias", "code": 400}}\n\ndata: [DONE]\n\n'
    url = serve(Scripted(body=event, headers=SSE)).url
    gw = gateway([url], [url])
    with httpx.Client(base_url=gw.url, timeout=10, trust_env=False) as client:
        response = client.post("/v1/chat/completions", json=chat())
    assert response.status_code == 400 and response.json()["error"]["message"] == "bad logit_bias"


def test_integer_logprobs_on_completions_pass_to_the_backend(sims, gateway):
    speculative, plain = sims
    gw = gateway([speculative.url], [plain.url])
    body = {"model": chat()["model"], "prompt": "hi", "max_tokens": 4, "logprobs": 2}
    with httpx.Client(base_url=gw.url, timeout=10, trust_env=False) as client:
        through = client.post("/v1/completions", json=body)
    direct = httpx.post(speculative.url + "/v1/completions", json=body, timeout=10, trust_env=False)
    assert through.status_code == direct.status_code == 200


def test_a_ten_minute_non_streaming_generation_completes_with_default_timeouts(sim, gateway, tmp_path):
    """The reference deployment at full load: ~7 tok/s per request, so 4,096 tokens take ~10 minutes. Run at
    100x, with every default timeout of the gateway scaled by the same factor."""
    scale = 100.0
    profile = tmp_path / "seven-tps.toml"
    profile.write_text(
        'kind = "measured"\nmodel_name = "moonshotai/Kimi-K2.5"\n'
        "[[points]]\nconcurrency = 1\nper_request_throughput = 7.0\nttft_s = 1.0\n"
    )
    speculative = sim(str(profile), "--time-scale", str(scale))
    plain = sim(str(profile), "--time-scale", str(scale))
    defaults = TimeoutSettings()
    scaled = {
        name: value / scale
        for name, value in defaults.model_dump().items()
        if isinstance(value, float) and name not in ("backend_keepalive", "client_keepalive")
    }
    gw = gateway([speculative.url], [plain.url], timeouts=scaled)
    with httpx.Client(base_url=gw.url, timeout=60, trust_env=False) as client:
        response = client.post("/v1/chat/completions", json=chat(False, 4096, ignore_eos=True))
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 4096
