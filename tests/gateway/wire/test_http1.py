"""Http1Transport against real servers on loopback: uvicorn in a thread for normal traffic, small raw asyncio
servers (in the test's own loop) for what well-behaved servers never do. Every scenario runs on both event
loops the gateway may use, and ends by checking that nothing leaked: no busy or half-open connections, no
waiters, no live timers.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import hashlib
import json
import socket
import ssl
import threading
from collections.abc import Awaitable, Callable

import httpx
import pytest
import trustme
import uvloop

from crossover.gateway.wire import http1
from crossover.gateway.wire.client_http import CHUNK
from crossover.gateway.wire.http1 import HIGH_WATER, Http1Transport
from tests.gateway.gateway_helpers import LONG, chat, content_length, raw_post, sim_running, sse_events, wait_until
from tests.gateway.gateway_helpers import read_all as read_request_body

SCENARIO_TIMEOUT_S = 30.0
SHORT = 0.3  # a timeout meant to expire
LIMITS = httpx.Limits(max_connections=8, max_keepalive_connections=8, keepalive_expiry=4.0)
EVENTS = 20


@pytest.fixture(params=["asyncio", "uvloop"])
def run(request):
    """run(scenario) -> its result, on the parametrised event loop, bounded by SCENARIO_TIMEOUT_S."""
    factory = uvloop.new_event_loop if request.param == "uvloop" else None

    def runner(scenario: Callable[[], Awaitable]):
        async def bounded():
            return await asyncio.wait_for(scenario(), SCENARIO_TIMEOUT_S)

        with asyncio.Runner(loop_factory=factory) as loop_runner:
            return loop_runner.run(bounded())

    return runner


def post(url: str, body: bytes = b"{}", timeout: float = 10.0, **kwargs) -> httpx.Request:
    return httpx.Request("POST", url, content=body, extensions={"timeout": httpx.Timeout(timeout).as_dict()}, **kwargs)


def assert_settled(transport: Http1Transport) -> None:
    """Every open connection is idle in the pool, nobody waits, and (asyncio) no timer is left armed."""
    assert transport._connecting == 0
    assert len(transport._conns) == transport._idle_count
    assert not transport._waiters
    scheduled = getattr(asyncio.get_running_loop(), "_scheduled", [])  # uvloop keeps its timers out of reach
    assert [handle for handle in scheduled if handle._callback is http1._expire and not handle.cancelled()] == []


async def read_all(response: httpx.Response) -> list[bytes]:
    try:
        return [chunk async for chunk in response.stream]
    finally:
        await response.aclose()


def connections_in_memory(closed: bool | None = None) -> int:
    """How many of the transport's connection objects exist (only the closed ones, or the open ones)."""
    return sum(
        1 for obj in gc.get_objects() if type(obj) is http1._Connection and (closed is None or obj.closed == closed)
    )


async def wait_for_condition(condition: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    """Poll `condition` on the loop (a readiness wait, bounded), never a fixed sleep."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        await asyncio.sleep(0.005)


# -- uvicorn: normal traffic ---------------------------------------------------------------------------------


def make_app(seen_ports: list[int]):
    """/sse: EVENTS events; /json: echoes the request; /large?n=: n bytes in 64 KiB pieces."""

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        seen_ports.append(scope["client"][1])
        body = await read_request_body(receive)
        path = scope["path"]
        if path == "/sse":
            await send(
                {"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]}
            )
            for i in range(EVENTS):
                await send({"type": "http.response.body", "body": b"data: %d\n\n" % i, "more_body": True})
                await asyncio.sleep(0)  # separate writes, as a token stream makes them
            await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})
        elif path == "/json":
            headers = dict(scope["headers"])
            answer = json.dumps(
                {
                    "body": json.loads(body),
                    "length": headers.get(b"content-length", b"").decode(),
                    "host": headers[b"host"].decode(),
                    "query": scope["query_string"].decode(),
                }
            )
            await send(
                {"type": "http.response.start", "status": 201, "headers": [(b"content-type", b"application/json")]}
            )
            await send({"type": "http.response.body", "body": answer.encode()})
        elif path == "/large":
            size = int(scope["query_string"].decode().split("=")[1])
            await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"%d" % size)]})
            piece = bytes(range(256)) * 256
            for start in range(0, size, len(piece)):
                await send({"type": "http.response.body", "body": piece[: size - start], "more_body": True})
            await send({"type": "http.response.body", "body": b""})

    return app


@pytest.fixture
def backend(serve):
    """A uvicorn server running make_app: (url, client ports it has seen, one per request)."""
    ports: list[int] = []
    return serve(make_app(ports)).url, ports


def test_streams_an_sse_body_whole_and_in_order(run, backend):
    url, _ = backend

    async def scenario():
        async with Http1Transport(LIMITS) as transport:
            response = await transport.handle_async_request(post(url + "/sse"))
            chunks = await read_all(response)
            assert_settled(transport)
            return response, chunks

    response, chunks = run(scenario)
    assert response.status_code == 200
    assert response.headers["content-type"] == "text/event-stream"
    assert response.extensions == {"http_version": b"HTTP/1.1", "reason_phrase": b"OK"}
    assert b"".join(chunks) == b"".join(b"data: %d\n\n" % i for i in range(EVENTS)) + b"data: [DONE]\n\n"


def test_sends_json_with_length_and_host_and_query(run, backend):
    url, _ = backend

    async def scenario():
        async with Http1Transport(LIMITS) as transport:
            response = await transport.handle_async_request(post(url + "/json?a=1&b=%20", b'{"x": [1, 2]}'))
            await response.aread()
            return response

    response = run(scenario)
    assert response.status_code == 201
    assert response.json() == {"body": {"x": [1, 2]}, "length": "13", "host": url.split("//")[1], "query": "a=1&b=%20"}


def test_streamed_request_bodies_go_whole(run, backend):
    url, _ = backend

    async def parts():
        yield b'{"x": '
        yield b"7}"

    async def scenario():
        async with Http1Transport(LIMITS) as transport:
            response = await transport.handle_async_request(post(url + "/json", parts()))
            await response.aread()
            return response.json()

    assert run(scenario)["body"] == {"x": 7}


def test_a_large_body_arrives_intact_and_unread_bytes_stop_the_socket(run, backend):
    url, _ = backend
    size = 16 * 1024 * 1024
    piece = bytes(range(256)) * 256
    expected = hashlib.sha256(piece * (size // len(piece))).hexdigest()

    async def scenario():
        async with Http1Transport(LIMITS) as transport:
            response = await transport.handle_async_request(post(url + f"/large?n={size}"))
            chunks = aiter(response.stream)
            digest = hashlib.sha256(await anext(chunks))
            conn = response.stream._conn
            # Not consuming: the transport must stop reading rather than buffer the whole body.
            await wait_for_condition(lambda: conn.reading_paused, "reading paused")
            largest = 0
            async for chunk in chunks:
                largest = max(largest, len(chunk))
                digest.update(chunk)
            await response.aclose()
            assert_settled(transport)
            return digest.hexdigest(), largest

    digest, largest = run(scenario)
    assert digest == expected
    assert largest <= 2 * HIGH_WATER  # what was buffered when reading paused, plus one socket read


def test_many_concurrent_requests_share_a_small_pool(run, backend):
    url, ports = backend
    limit = 4

    async def one(transport):
        response = await transport.handle_async_request(post(url + "/sse"))
        return b"".join(await read_all(response))

    async def scenario():
        async with Http1Transport(httpx.Limits(max_connections=limit, keepalive_expiry=4.0)) as transport:
            bodies = await asyncio.gather(*(one(transport) for _ in range(40)))
            assert_settled(transport)
            assert len(transport._conns) <= limit
            return bodies

    bodies = run(scenario)
    assert len(set(bodies)) == 1 and bodies[0].endswith(b"data: [DONE]\n\n")
    assert len(ports) == 40
    assert len(set(ports)) <= limit


def test_keeps_connections_alive_between_requests(run, backend):
    url, ports = backend

    async def scenario():
        async with Http1Transport(LIMITS) as transport:
            for path in ("/json", "/sse", "/json", "/large?n=100000"):
                response = await transport.handle_async_request(post(url + path))
                await response.aread()

    run(scenario)
    assert len(ports) == 4 and len(set(ports)) == 1


def test_works_under_httpx_async_client(run, backend):
    url, _ = backend

    async def scenario():
        async with httpx.AsyncClient(transport=Http1Transport(LIMITS)) as client:
            got = await client.get(url + "/sse")
            posted = await client.post(url + "/json", json={"y": 1})
            return got.text, posted.json()["body"]

    text, body = run(scenario)
    assert text.endswith("data: [DONE]\n\n") and body == {"y": 1}


def test_head_responses_have_no_body(run, backend):
    url, ports = backend

    async def scenario():
        async with Http1Transport(LIMITS) as transport:
            for _ in range(2):
                request = httpx.Request("HEAD", url + "/large?n=1000")
                response = await transport.handle_async_request(request)
                assert (response.headers["content-length"], await response.aread()) == ("1000", b"")
            assert_settled(transport)

    run(scenario)
    assert len(set(ports)) == 2  # the parser cannot tell where a HEAD response ends: never reused


def test_connections_idle_past_the_expiry_are_not_reused(run, backend):
    url, ports = backend
    expiry = 4.0

    async def scenario():
        async with Http1Transport(httpx.Limits(max_connections=4, keepalive_expiry=expiry)) as transport:
            response = await transport.handle_async_request(post(url + "/json"))
            await response.aread()
            (first,) = transport._conns
            first.idle_since -= expiry  # as if it had been idle that long
            response = await transport.handle_async_request(post(url + "/json"))
            await response.aread()
            assert first.closed and first not in transport._conns and len(transport._conns) == 1
            assert_settled(transport)

    run(scenario)
    assert len(set(ports)) == 2


def test_connections_idle_past_the_expiry_are_closed_as_traffic_passes(run, backend):
    url, _ = backend
    expiry = 4.0

    async def one(transport):
        response = await transport.handle_async_request(post(url + "/sse"))
        return await read_all(response)

    async def scenario():
        async with Http1Transport(httpx.Limits(max_connections=4, keepalive_expiry=expiry)) as transport:
            await asyncio.gather(one(transport), one(transport))
            older, newer = transport._idle[next(iter(transport._idle))]
            older.idle_since -= expiry  # as if it had been idle that long
            await one(transport)  # on `newer`
            assert older.closed and transport._conns == {newer}
            assert_settled(transport)

    run(scenario)


def test_keeps_at_most_max_keepalive_connections(run, backend):
    url, _ = backend

    async def one(transport):
        response = await transport.handle_async_request(post(url + "/sse"))
        return await read_all(response)

    async def scenario():
        async with Http1Transport(httpx.Limits(max_connections=4, max_keepalive_connections=1)) as transport:
            await asyncio.gather(*(one(transport) for _ in range(8)))
            assert_settled(transport)
            return len(transport._conns)

    assert run(scenario) == 1


def test_speaks_https(run, serve, tmp_path):
    authority = trustme.CA()
    pem = tmp_path / "server.pem"
    authority.issue_cert("127.0.0.1").private_key_and_cert_chain_pem.write_to_path(str(pem))
    url = serve(make_app([]), ssl_certfile=str(pem)).url.replace("http://", "https://")
    trusting = ssl.create_default_context()
    authority.configure_trust(trusting)

    async def scenario():
        async with Http1Transport(LIMITS) as transport:
            with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
                await transport.handle_async_request(post(url + "/json"))
        async with Http1Transport(LIMITS, ssl_context=trusting) as transport:
            response = await transport.handle_async_request(post(url + "/sse"))
            body = b"".join(await read_all(response))
            assert_settled(transport)
            return body

    assert run(scenario).endswith(b"data: [DONE]\n\n")


def test_an_idle_connection_is_evicted_for_another_host(run, backend):
    url, _ = backend

    async def handler(reader, writer):
        while await read_request(reader):
            writer.write(OK)

    async def scenario():
        async with raw_server(handler) as other, Http1Transport(httpx.Limits(max_connections=1)) as transport:
            for target in (url + "/json", other, url + "/json"):
                request = post(target)
                request.extensions["timeout"]["pool"] = SHORT
                response = await transport.handle_async_request(request)
                await response.aread()
            assert_settled(transport)
            assert len(transport._conns) == 1

    run(scenario)


# -- raw asyncio servers: edge cases --------------------------------------------------------------------------

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@contextlib.asynccontextmanager
async def raw_server(handler: Handler):
    """Serve `handler` on a loopback port: yields the URL; on exit stops it and cancels its connections."""
    tasks: set[asyncio.Task] = set()

    async def tracked(reader, writer):
        tasks.add(asyncio.current_task())
        try:
            await handler(reader, writer)
        finally:
            writer.close()

    server = await asyncio.start_server(tracked, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    finally:
        server.close()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await server.wait_closed()


async def refused_url() -> str:
    """A loopback URL that was just listening and no longer is: connections to it are refused."""
    server = await asyncio.start_server(lambda reader, writer: None, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    server.close()
    await server.wait_closed()
    return f"http://127.0.0.1:{port}/"


async def read_request(reader: asyncio.StreamReader) -> bytes | None:
    """One request's head and body, or None when the client closed the connection."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError:
        return None
    return head + await reader.readexactly(content_length(head, missing=0))


OK = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"


def test_keeps_raw_header_order_and_reads_close_delimited_bodies(run):
    async def handler(reader, writer):
        await read_request(reader)
        writer.write(b"HTTP/1.1 299 Fine Thanks\r\nX-B: 1\r\nx-a: 2\r\nX-B: 3\r\n\r\nuntil the end")
        await writer.drain()

    async def scenario():
        async with raw_server(handler) as url, Http1Transport(LIMITS) as transport:
            response = await transport.handle_async_request(post(url))
            body = b"".join(await read_all(response))
            assert_settled(transport)
            assert not transport._conns  # a close-delimited body leaves nothing to reuse
            return response, body

    response, body = run(scenario)
    assert response.headers.raw == [(b"X-B", b"1"), (b"x-a", b"2"), (b"X-B", b"3")]
    assert response.extensions["reason_phrase"] == b"Fine Thanks"
    assert (response.status_code, body) == (299, b"until the end")


def test_a_connection_is_pooled_as_its_last_bytes_go_out_with_nodelay(run):
    async def handler(reader, writer):
        while await read_request(reader):
            writer.write(OK)

    async def scenario():
        async with raw_server(handler) as url, Http1Transport(LIMITS) as transport:
            response = await transport.handle_async_request(post(url))
            (conn,) = transport._conns
            assert conn.transport.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
            assert await anext(aiter(response.stream)) == b"ok"
            assert transport._idle_count == 1  # before the consumer even asks for the end
            await response.aclose()
            assert_settled(transport)

    run(scenario)


@pytest.mark.parametrize("status_line", [b"HTTP/1.1 200 OK\r\nConnection: close", b"HTTP/1.0 200 OK"])
def test_a_connection_the_server_means_to_close_is_not_reused(run, status_line):
    connections = 0

    async def handler(reader, writer):
        nonlocal connections
        connections += 1
        while await read_request(reader):  # it says close, but would carry on: the client must not
            writer.write(status_line + b"\r\nContent-Length: 2\r\n\r\nok")

    async def scenario():
        async with raw_server(handler) as url, Http1Transport(LIMITS) as transport:
            for _ in range(2):
                response = await transport.handle_async_request(post(url))
                assert await response.aread() == b"ok"
            assert_settled(transport)

    run(scenario)
    assert connections == 2


def test_a_body_after_a_head_response_is_not_passed_on(run):
    async def handler(reader, writer):
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello")

    async def scenario():
        async with raw_server(handler) as url, Http1Transport(LIMITS) as transport:
            response = await transport.handle_async_request(httpx.Request("HEAD", url))
            assert await response.aread() == b""
            assert_settled(transport)
            assert not transport._conns

    run(scenario)


def test_a_request_the_server_read_is_never_sent_again(run):
    received = []

    async def handler(reader, writer):
        # Answer the first request of each connection; read the second whole and close without a word: to the
        # client just like an idle close that crossed the request, but this server got it.
        received.append(await read_request(reader))
        writer.write(OK)
        await writer.drain()
        received.append(await read_request(reader))  # then the connection closes, unanswered

    async def scenario():
        async with raw_server(handler) as url, Http1Transport(LIMITS) as transport:
            first = await (await transport.handle_async_request(post(url))).aread()
            with pytest.raises(httpx.RemoteProtocolError, match="without a response"):
                await transport.handle_async_request(post(url))
            third = await (await transport.handle_async_request(post(url))).aread()
            assert_settled(transport)
            return first, third

    assert run(scenario) == (b"ok", b"ok")
    assert len([request for request in received if request]) == 3  # each request arrived once


def test_an_idle_connection_the_server_closed_is_dropped_before_anything_is_written(run):
    """The server's close is in the socket but the event loop has not delivered it yet (it was busy): the pool
    must not write on that connection, and takes a new one."""
    listener = socket.create_server(("127.0.0.1", 0))
    close_now, closed, requests = threading.Event(), threading.Event(), []

    def server():
        for index in range(2):
            conn, _ = listener.accept()
            with conn:
                requests.append(conn.recv(65536))
                conn.sendall(OK)
                if index == 0:
                    close_now.wait(10)
                else:
                    conn.recv(1)  # until the client closes
            closed.set()

    thread = threading.Thread(target=server, daemon=True)
    thread.start()
    stale = []

    async def scenario():
        url = f"http://127.0.0.1:{listener.getsockname()[1]}"
        async with Http1Transport(LIMITS, on_stale=lambda: stale.append(1)) as transport:
            assert await (await transport.handle_async_request(post(url))).aread() == b"ok"
            (idle,) = transport._conns
            # The loop is held (no await) while the server closes: its FIN waits in the socket, undelivered.
            close_now.set()
            assert closed.wait(10)
            assert idle.poller.poll(10_000)  # the FIN is in the socket
            assert await (await transport.handle_async_request(post(url))).aread() == b"ok"
            assert idle.closed and stale == [1]
            assert_settled(transport)

    try:
        run(scenario)
    finally:
        thread.join(10)
        listener.close()
    assert len(requests) == 2  # one per connection: nothing was written on the closed one


def test_a_fresh_connection_closed_without_a_response_is_an_error(run):
    async def handler(reader, writer):
        await read_request(reader)

    async def scenario():
        async with raw_server(handler) as url, Http1Transport(LIMITS) as transport:
            with pytest.raises(httpx.RemoteProtocolError, match="without a response"):
                await transport.handle_async_request(post(url))
            assert_settled(transport)
            assert not transport._conns

    run(scenario)


def test_a_close_mid_body_is_an_error(run):
    async def handler(reader, writer):
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nonly ten b")
        await writer.drain()

    async def scenario():
        async with raw_server(handler) as url, Http1Transport(LIMITS) as transport:
            response = await transport.handle_async_request(post(url))
            with pytest.raises((httpx.RemoteProtocolError, httpx.ReadError)):
                await response.aread()
            assert_settled(transport)
            assert not transport._conns

    run(scenario)


@pytest.mark.parametrize("reply", [b"NOT HTTP AT ALL\r\n\r\n", b"HTTP/1.1 200 OK\r\nContent-Length: x\r\n\r\n"])
def test_a_malformed_response_is_a_protocol_error(run, reply):
    async def handler(reader, writer):
        await read_request(reader)
        writer.write(reply)
        await writer.drain()
        await reader.read()

    async def scenario():
        async with raw_server(handler) as url, Http1Transport(LIMITS) as transport:
            with pytest.raises(httpx.RemoteProtocolError, match="malformed"):
                await transport.handle_async_request(post(url))
            assert_settled(transport)
            assert not transport._conns

    run(scenario)


@pytest.mark.parametrize("separately", [False, True])
def test_bytes_after_the_response_close_the_connection(run, separately):
    connections = 0

    async def scenario():
        junk_sent = asyncio.Event()

        async def handler(reader, writer):
            nonlocal connections
            connections += 1
            while await read_request(reader):
                writer.write(OK if separately else OK + b"HTTP/1.1 200 OK\r\n")
                await writer.drain()
                if separately:
                    await junk_sent.wait()
                    writer.write(b"HTTP/1.1 200 OK\r\n")  # to an idle connection
                    await writer.drain()

        async with raw_server(handler) as url, Http1Transport(LIMITS) as transport:
            for _ in range(2):
                response = await transport.handle_async_request(post(url))
                assert await response.aread() == b"ok"
                junk_sent.set()
                await wait_for_condition(lambda: not transport._conns, "the connection dropped")
            assert_settled(transport)

    run(scenario)
    assert connections == 2


def test_headers_that_never_come_are_a_read_timeout(run):
    async def scenario():
        closed = asyncio.Event()

        async def handler(reader, writer):
            await read_request(reader)
            await reader.read()  # until the client gives up
            closed.set()

        async with raw_server(handler) as url, Http1Transport(LIMITS) as transport:
            request = httpx.Request("GET", url, extensions={"timeout": httpx.Timeout(10.0, read=SHORT).as_dict()})
            with pytest.raises(httpx.ReadTimeout):
                await transport.handle_async_request(request)
            await asyncio.wait_for(closed.wait(), 10)
            assert_settled(transport)

    run(scenario)


async def read_by_iterating(stream, got: list[bytes]) -> None:
    async for piece in stream:
        got.append(piece)


async def read_by_pumping(stream, got: list[bytes]) -> None:
    await http1.pump(stream, lambda piece, ended: got.append(piece))


@pytest.mark.parametrize("read", [read_by_iterating, read_by_pumping])
def test_a_body_that_stalls_is_a_read_timeout(run, read):
    async def handler(reader, writer):
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n")
        await writer.drain()
        await reader.read()

    async def scenario():
        async with raw_server(handler) as url, Http1Transport(LIMITS) as transport:
            response = await transport.handle_async_request(post(url, timeout=SHORT))
            got: list[bytes] = []
            with pytest.raises(httpx.ReadTimeout):
                await read(response.stream, got)
            assert got == [b"hello"]  # what came before the silence was passed on
            await response.aclose()
            assert_settled(transport)
            assert not transport._conns

    run(scenario)


class Relay:
    """A relay (`http1.Relay`) over one end of a socket pair made a transport by the loop under test, as the
    gateway's client connections are; `received(expected)` reads the far end until `expected` has come."""

    frame = CHUNK
    ends = (b"\n\n",)
    mark = b"!"

    def __init__(self, out: asyncio.WriteTransport, far: socket.socket) -> None:
        self.out = self.transport = out
        self.far = far
        self.previous_chunk = self.last_chunk = b""
        self.last_chunk_at = 0.0
        self.seen = b""

    async def received(self, expected: bytes) -> bytes:
        loop = asyncio.get_running_loop()
        while expected not in self.seen:
            self.seen += await loop.sock_recv(self.far, 65536)
        return self.seen


@contextlib.asynccontextmanager
async def relay_pair(relay_type: type[Relay] = Relay):
    loop = asyncio.get_running_loop()
    near, far = socket.socketpair()
    far.setblocking(False)
    out, _ = await loop.connect_accepted_socket(asyncio.Protocol, sock=near)
    try:
        yield relay_type(out, far)
    finally:
        out.close()
        far.close()


def sse_server(events: list[bytes], passed: asyncio.Event):
    """A server that streams `events` as HTTP chunks, then ends the body: each once the test set `passed` (for the
    first, once the reader waits; then once the last was passed on), so that each comes in a read of its own."""

    async def handler(reader, writer):
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        await writer.drain()
        for chunk in [b"%x\r\n%s\r\n" % (len(event), event) for event in events] + [b"0\r\n\r\n"]:
            await passed.wait()
            passed.clear()
            writer.write(chunk)
            await writer.drain()
        await reader.read()

    return raw_server(handler)


def test_a_relay_writes_whole_events_on_as_http_chunks_from_the_read_callback(run):
    # Whole events go to the relay's transport, each as one chunk, with nothing delivered; one holding the mark,
    # and half an event, wake the task instead, which delivers them in order; the last piece ends the body there.
    events = [b"a\n\n", b"b!\n\n", b"c", b"\n\n", b"d\n\n"]
    passed = asyncio.Event()

    async def scenario():
        async with sse_server(events, passed) as url, relay_pair() as relay, Http1Transport(LIMITS) as transport:
            response = await transport.handle_async_request(post(url, timeout=30.0))
            delivered: list[tuple[bytes, bool]] = []

            def deliver(piece, ended):  # as the gateway's relay does: none while part of an event is held
                delivered.append((piece, ended))
                relay.out = relay.transport if piece.endswith(b"\n\n") else None
                passed.set()

            async def watch_relayed() -> None:  # the server goes on once the relay wrote a piece
                for framed in (b"3\r\na\n\n\r\n", b"3\r\nd\n\n\r\n"):
                    await relay.received(framed)
                    passed.set()

            watcher = asyncio.create_task(watch_relayed())
            passed.set()  # the server sends the first event only once the pump below waits
            await http1.pump(response.stream, deliver, relay)
            await watcher
            assert relay.seen == b"3\r\na\n\n\r\n3\r\nd\n\n\r\n"
            assert delivered == [(b"b!\n\n", False), (b"c", False), (b"\n\n", False), (b"", True)]
            assert (relay.previous_chunk, relay.last_chunk) == (b"a\n\n", b"d\n\n")
            assert relay.last_chunk_at > 0
            assert response.stream._conn is None and response.stream.ended  # read to its end, pooled again
            assert_settled(transport)

    run(scenario)


@pytest.mark.parametrize("why", ["taken back", "closing", "holding unsent bytes"])
def test_a_relay_that_cannot_write_now_leaves_the_piece_to_the_task(run, why):
    passed = asyncio.Event()

    async def scenario():
        async with sse_server([b"a\n\n"], passed) as url, relay_pair() as relay, Http1Transport(LIMITS) as transport:
            if why == "taken back":
                relay.out = None
            elif why == "closing":
                relay.out.close()
            else:  # a client behind: the far end reads nothing while a large write waits in the transport
                relay.out.write(b"x" * (16 * 1024 * 1024))
                assert relay.out.get_write_buffer_size() > 0
            response = await transport.handle_async_request(post(url, timeout=30.0))
            delivered: list[bytes] = []

            def deliver(piece, ended):
                delivered.append(piece)
                passed.set()

            passed.set()
            await http1.pump(response.stream, deliver, relay)
            assert delivered == [b"a\n\n", b""]
            assert relay.last_chunk == b"" and relay.last_chunk_at == 0.0
            assert_settled(transport)

    run(scenario)


def test_a_piece_the_relay_declines_goes_to_deliver_and_nothing_overtakes_it(run):
    # The relay declines the first piece (half an event). Before the waiting task can take it, another read
    # arrives (fed straight into the connection, queued ahead of the task's wake-up): it must not be relayed past
    # the piece still buffered, but delivered after it. Later pieces are relayed again.
    head_in, passed = asyncio.Event(), asyncio.Event()

    async def handler(reader, writer):
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        await writer.drain()
        await head_in.wait()
        writer.write(b"1\r\na\r\n")
        await writer.drain()
        await passed.wait()
        passed.clear()
        writer.write(b"3\r\nc\n\n\r\n")
        await writer.drain()
        await passed.wait()
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        await reader.read()

    class Injecting(Relay):
        """Feeds the connection one more read, queued ahead of the task's wake-up, the first time it is asked."""

        conn = None

        @property
        def out(self) -> asyncio.WriteTransport:
            if self.conn is not None:
                self.conn.loop.call_soon(self.conn.data_received, b"3\r\nb\n\n\r\n")
                self.conn = None
            return self.transport

        @out.setter
        def out(self, value: asyncio.WriteTransport | None) -> None:
            pass

    async def scenario():
        async with raw_server(handler) as url, relay_pair(Injecting) as relay, Http1Transport(LIMITS) as transport:
            response = await transport.handle_async_request(post(url, timeout=30.0))
            relay.conn = response.stream._conn
            delivered: list[bytes] = []

            def deliver(piece, ended):
                delivered.append(piece)
                if b"b\n\n" in piece:
                    passed.set()

            async def watch_relayed() -> None:
                await relay.received(b"3\r\nc\n\n\r\n")
                passed.set()

            watcher = asyncio.create_task(watch_relayed())
            head_in.set()  # the server runs again only once the pump below waits
            await http1.pump(response.stream, deliver, relay)
            await watcher
            assert delivered == [b"ab\n\n", b""]  # the declined piece and the one behind it, in order
            assert relay.seen == b"3\r\nc\n\n\r\n"  # the piece behind a buffered one was never relayed
            assert_settled(transport)

    run(scenario)


def test_a_relayed_stream_keeps_its_wait_bound_from_its_last_piece(run):
    # The relay takes pieces while the task stays in one wait, so the wait's bound runs from the last piece the
    # relay took: a stream longer than the read timeout is not cut however steadily it flows, and one that stops
    # is. Nothing is timed: the wait's timer is fired by hand, as if its time had come.
    passed = asyncio.Event()

    async def scenario():
        timeout = 30.0
        async with (
            sse_server([b"a\n\n", b"b\n\n"], passed) as url,
            relay_pair() as relay,
            Http1Transport(LIMITS) as transport,
        ):
            response = await transport.handle_async_request(post(url, timeout=timeout))
            conn = response.stream._conn
            pumping = asyncio.create_task(http1.pump(response.stream, lambda piece, ended: None, relay))
            passed.set()
            await relay.received(b"3\r\na\n\n\r\n")
            conn.wait_due = conn.loop.time() - 1.0  # the wait began more than `timeout` ago
            conn._wait_timer()
            assert not pumping.done()
            assert conn.timer.when() == pytest.approx(relay.last_chunk_at + timeout, abs=0.01)
            relay.last_chunk_at -= timeout + 1.0  # and so did the relay's last piece: the backend is silent
            conn._wait_timer()
            with pytest.raises(httpx.ReadTimeout):
                await pumping
            await response.aclose()
            assert_settled(transport)

    run(scenario)


def test_a_server_that_does_not_read_is_a_write_timeout(run):
    async def scenario():
        async def handler(reader, writer):
            await asyncio.Event().wait()  # never reads; cancelled when the server stops

        async with raw_server(handler) as url, Http1Transport(LIMITS) as transport:
            request = post(url, b"x" * (64 * 1024 * 1024), timeout=10.0)
            request.extensions["timeout"]["write"] = SHORT
            with pytest.raises(httpx.WriteTimeout):
                await transport.handle_async_request(request)
            assert_settled(transport)

    run(scenario)


def test_a_refused_port_is_a_connect_error(run):
    async def scenario():
        async with Http1Transport(LIMITS) as transport:
            with pytest.raises(httpx.ConnectError):
                await transport.handle_async_request(post(await refused_url()))
            assert_settled(transport)

    run(scenario)


def test_unsupported_schemes_and_smuggled_headers_are_refused(run):
    async def scenario():
        async with Http1Transport(LIMITS) as transport:
            with pytest.raises(httpx.UnsupportedProtocol):
                await transport.handle_async_request(httpx.Request("GET", "ftp://127.0.0.1/"))
            with pytest.raises(httpx.LocalProtocolError):
                await transport.handle_async_request(post("http://127.0.0.1:9/", headers={"x": "1\r\nHost: evil"}))
            assert not transport._conns

    run(scenario)


CHUNKED_START = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n6\r\nfirst\n\r\n"
UNTIL_CLOSE_START = b"HTTP/1.1 200 OK\r\n\r\nfirst\n"


async def holding_server(scenario: Callable[[str, asyncio.Event], Awaitable], start: bytes = CHUNKED_START):
    """Run scenario(url, closed) against a server that sends `start` (a head and the first bytes of a body),
    then holds the response open; `closed` is set when the client closes its side."""
    closed = asyncio.Event()

    async def handler(reader, writer):
        await read_request(reader)
        writer.write(start)
        await writer.drain()
        await reader.read()  # EOF: the client is gone
        closed.set()

    async with raw_server(handler) as url:
        return await scenario(url, closed)


def test_an_exhausted_pool_is_a_pool_timeout(run):
    async def scenario(url, closed):
        async with Http1Transport(httpx.Limits(max_connections=1)) as transport:
            held = await transport.handle_async_request(post(url))
            request = post(url)
            request.extensions["timeout"]["pool"] = SHORT
            with pytest.raises(httpx.PoolTimeout):
                await transport.handle_async_request(request)
            await held.aclose()
            assert_settled(transport)

    run(lambda: holding_server(scenario))


def test_closing_a_body_early_closes_the_connection(run):
    async def scenario(url, closed):
        async with Http1Transport(LIMITS) as transport:
            response = await transport.handle_async_request(post(url))
            assert await anext(aiter(response.stream)) == b"first\n"
            await response.aclose()
            await asyncio.wait_for(closed.wait(), 10)
            assert_settled(transport)
            assert not transport._conns

    run(lambda: holding_server(scenario))


def test_a_connection_closed_or_never_opened_is_freed_without_the_cyclic_collector(run, without_cyclic_collector):
    """A connection closed mid-response - what each aborted stream leaves - and one that never opened are freed as
    soon as they are let go. Its parser holds its callbacks: before they were let go at the close, every one waited
    for the cyclic collector (RSS +4.7 KB per aborted stream under `crossover serve`)."""

    async def scenario(url, closed):
        async with Http1Transport(LIMITS) as transport:
            for _ in range(3):
                response = await transport.handle_async_request(post(url))
                assert await anext(aiter(response.stream)) == b"first\n"
                await response.aclose()
            with pytest.raises(httpx.ConnectError):
                await transport.handle_async_request(post(await refused_url()))
            await wait_for_condition(lambda: connections_in_memory() == 0, "closed connections freed")
            assert_settled(transport)

    run(lambda: holding_server(scenario))


def test_cancelling_the_reader_closes_the_connection(run):
    async def scenario(url, closed):
        async with Http1Transport(LIMITS) as transport:
            response = await transport.handle_async_request(post(url))
            reader = asyncio.create_task(read_all(response))  # gets "first", then waits for more
            await wait_for_condition(lambda: response.stream._conn.waiter is not None, "reader waiting")
            reader.cancel()
            with pytest.raises(asyncio.CancelledError):
                await reader
            await asyncio.wait_for(closed.wait(), 10)
            assert_settled(transport)
            assert not transport._conns

    run(lambda: holding_server(scenario))


@pytest.mark.parametrize("start", [CHUNKED_START, UNTIL_CLOSE_START])
def test_closing_the_transport_wakes_pool_waiters_and_ends_streams(run, start):
    async def scenario(url, closed):
        transport = Http1Transport(httpx.Limits(max_connections=1))
        held = await transport.handle_async_request(post(url))
        requests = [post(url) for _ in range(3)]
        for request in requests:
            request.extensions["timeout"]["pool"] = None  # only aclose can end these waits
        waiters = [asyncio.create_task(transport.handle_async_request(request)) for request in requests]
        await wait_for_condition(lambda: len(transport._waiters) == 3, "three pool waiters")
        await transport.aclose()
        for waiter in waiters:
            with pytest.raises(httpx.ConnectError, match="closed"):
                await waiter
        with pytest.raises(httpx.TransportError):  # not a body cut short that looks complete
            await held.aread()
        await asyncio.wait_for(closed.wait(), 10)
        assert not transport._conns and not transport._waiters

    run(lambda: holding_server(scenario, start))


def test_a_pool_wakeup_is_not_lost_to_a_cancelled_waiter(run):
    async def scenario(url, closed):
        async with Http1Transport(httpx.Limits(max_connections=1)) as transport:
            held = await transport.handle_async_request(post(url))
            first = asyncio.create_task(transport.handle_async_request(post(url)))
            second = asyncio.create_task(transport.handle_async_request(post(url)))
            await wait_for_condition(lambda: len(transport._waiters) == 2, "two pool waiters")
            await held.aclose()  # wakes `first`, which is cancelled before it can run
            first.cancel()
            response = await second
            assert response.status_code == 200
            await response.aclose()
            with pytest.raises(asyncio.CancelledError):
                await first
            assert_settled(transport)

    run(lambda: holding_server(scenario))


def test_a_failed_connect_frees_its_slot_for_a_waiter(run, backend):
    url, _ = backend

    async def scenario():
        async with Http1Transport(httpx.Limits(max_connections=1)) as transport:
            failing = asyncio.create_task(transport.handle_async_request(post(await refused_url())))
            waiting = asyncio.create_task(transport.handle_async_request(post(url + "/json")))
            with pytest.raises(httpx.ConnectError):
                await failing
            response = await waiting
            await response.aread()
            assert_settled(transport)
            return response.status_code

    assert run(scenario) == 201


def test_a_connection_whose_last_bytes_paused_reading_is_pooled_readable(run):
    # HIGH_WATER + 1 bytes, unread: the last byte crosses the mark, so reading pauses as the response completes.
    async def handler(reader, writer):
        while await read_request(reader):
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % (HIGH_WATER + 1) + b"x" * (HIGH_WATER + 1))

    async def scenario():
        async with raw_server(handler) as url, Http1Transport(LIMITS) as transport:
            response = await transport.handle_async_request(post(url))
            conn = response.stream._conn
            await wait_for_condition(lambda: conn.complete, "the whole body buffered")
            await response.aclose()
            response = await transport.handle_async_request(post(url))
            assert len(await response.aread()) == HIGH_WATER + 1
            assert transport._conns == {conn}
            assert_settled(transport)

    run(scenario)


# -- the gateway on this transport -----------------------------------------------------------------------------


def test_the_gateway_proxies_through_it_and_a_client_disconnect_reaches_the_backend(sims, gateway):
    speculative, plain = sims
    gw = gateway([speculative.url], [plain.url], transport=Http1Transport(LIMITS))

    async def scenario():
        async with httpx.AsyncClient(base_url=gw.url, timeout=20, trust_env=False) as client:
            answer = await client.post("/v1/chat/completions", json=chat(max_tokens=8))
            assert answer.status_code == 200 and answer.json()["choices"][0]["message"]["content"]
            streamed = await client.post("/v1/chat/completions", json=chat(True, 16))
            assert streamed.status_code == 200 and sse_events(streamed.content)[-1] == "[DONE]"
            async with client.stream("POST", "/v1/chat/completions", json=chat(True, LONG)) as response:
                await anext(response.aiter_raw())
                assert sim_running(speculative.url) == 1

    asyncio.run(asyncio.wait_for(scenario(), SCENARIO_TIMEOUT_S))
    wait_until(lambda: sim_running(speculative.url) == 0, what="the stand-in to abort the request")
    gw.settled()


ABORTED_STREAMS = 20


def test_streams_the_client_abandons_leave_no_backend_connection_behind(sims, gateway, without_cyclic_collector):
    """Streams cut by their clients mid-answer (each closes its backend connection, so the backend aborts the
    request) leave no connection object behind, with no cyclic collection: before, every one stayed until the
    collector ran, seldom under `crossover serve` - the RSS growth of issue 39 under mixed traffic."""
    speculative, plain = sims
    gw = gateway([speculative.url], [plain.url])
    request = raw_post(json.dumps(chat(True, LONG)).encode())
    for _ in range(ABORTED_STREAMS):
        with socket.create_connection(("127.0.0.1", httpx.URL(gw.url).port), timeout=SCENARIO_TIMEOUT_S) as sock:
            sock.sendall(request)
            received = b""
            while b"data:" not in received:  # the stream is under way
                received += sock.recv(65536)
    wait_until(lambda: sim_running(speculative.url) + sim_running(plain.url) == 0, what="the stand-ins to abort")
    gw.settled()
    wait_until(lambda: connections_in_memory(closed=True) == 0, what="the closed backend connections freed")
