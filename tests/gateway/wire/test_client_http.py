"""The client-facing HTTP protocol of `crossover serve`: bounded request heads and bodies, JSON errors, and
memory that stays flat whatever a client sends. Raw sockets, since well-behaved clients cannot misbehave."""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest

from crossover.loadtest.proxybench.zerobackend import MODEL as ZERO_MODEL
from tests.gateway.gateway_helpers import Scripted, chat, raw_post, read_response
from tests.loadtest.zero_server import running_zero
from tests.waiting import wait_until

BOUNDS = """
[timeouts]
request_head = 0.5
request_body = 0.5
[limits]
max_head_bytes = 16384
"""
READ_S = 10.0


def pools(sims) -> str:
    speculative, plain = sims
    return f'[pools.speculative]\nbackends = ["{speculative.url}"]\n[pools.plain]\nbackends = ["{plain.url}"]\n'


def connect(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=READ_S)
    sock.settimeout(READ_S)
    return sock


def response_of(sock: socket.socket, headers: dict | None = None) -> tuple[int, dict, bool]:
    """(status, JSON body, whether the server then closed the connection); `headers` gets the response's."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    fields = {name.strip().lower(): value.strip() for name, _, value in (line.partition(b":") for line in lines[1:])}
    if headers is not None:
        headers.update(fields)
    length = int(fields[b"content-length"])
    while len(body) < length:
        body += sock.recv(65536)
    try:
        closed = sock.recv(1) == b""
    except ConnectionResetError:  # closed with the client's unread bytes still queued: a reset, still a close
        closed = True
    return int(lines[0].split(b" ")[1]), json.loads(body), closed


def sleep_within(seconds: float, since: float, limit: float, what: str) -> None:
    """Sleep `seconds`; skip the test if the machine stalled it past `limit` since `since` (time.monotonic()),
    where what it checks would no longer hold."""
    time.sleep(seconds)
    if time.monotonic() - since >= limit:
        pytest.skip(f"the machine stalled this test past the {what} it checks")


def flood_with_unterminated_heads(port: int, connections: int, start: bytes) -> set[int]:
    """`connections` heads that begin with `start` and then send one header of 8 MiB, unless the server hangs
    up first (it should, past its head limit); the statuses they got."""
    sockets = [connect(port) for _ in range(connections)]
    try:
        for sock in sockets:
            sock.sendall(start + b"X-Big: ")
        payload = b"a" * (256 * 1024)
        deadline = time.monotonic() + 30
        for sock in sockets:
            for _ in range(32):
                try:
                    sock.sendall(payload)
                except OSError:
                    break
                if time.monotonic() > deadline:
                    break
        return {response_of(sock)[0] for sock in sockets}
    finally:
        for sock in sockets:
            sock.close()


def test_an_oversized_head_is_431_and_closes(sims, gateway_process):
    gw = gateway_process(pools(sims) + BOUNDS)
    with connect(gw.port) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 100_000)
        status, body, closed = response_of(sock)
    assert status == 431 and closed
    assert body["error"]["code"] == "request_header_too_large" and body["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("size", [20_000, 4_000_000], ids=["just-over", "4MB"])
def test_a_whole_oversized_head_in_one_write_is_431_with_the_answer_readable(sims, gateway_process, size):
    # The head is complete and arrives in one piece: counted as the parser reads it, never forwarded. The
    # refusal reads and drops the rest, so even 4 MB the client is still writing cannot reset the answer away.
    gw = gateway_process(pools(sims) + BOUNDS)
    body = json.dumps(chat()).encode()
    with connect(gw.port) as sock:
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nX-Request-Id: big-one\r\nX-Pad: %s\r\n"
            b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (b"a" * size, len(body), body)
        )
        headers: dict = {}
        status, error, closed = response_of(sock, headers)
    assert status == 431 and closed and error["error"]["code"] == "request_header_too_large"
    assert headers[b"x-request-id"] == b"big-one"
    assert not any(name == "crossover_requests_total" for name, _ in gw.metrics())  # it never reached the proxy


def test_a_connection_that_sends_nothing_is_closed(sims, gateway_process):
    gw = gateway_process(pools(sims) + BOUNDS)
    with connect(gw.port) as sock:
        assert sock.recv(1) == b""  # within request_head (0.5 s); READ_S bounds the wait


def test_a_head_that_never_ends_is_408_and_the_log_says_so(sims, gateway_process):
    gw = gateway_process(pools(sims) + BOUNDS, env={"CROSSOVER_LOG_LEVEL": "debug"})
    with connect(gw.port) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
        headers: dict = {}
        status, body, closed = response_of(sock, headers)
    assert status == 408 and closed and body["error"]["code"] == "request_timeout"
    assert len(headers[b"x-request-id"]) == 32  # a fresh one: the client's head never finished
    # The gateway's own loggers go where uvicorn's go, formatted, at the configured level.
    wait_until(lambda: "DEBUG:" in gw.log() and "refused a request from" in gw.log(), what="the refusal logged")
    assert gw.metrics()[("crossover_client_requests_refused_total", (("reason", "head_timeout"),))] == 1


@pytest.mark.parametrize("sent", [b"{", b""], ids=["trickled", "none"])
def test_a_body_that_does_not_arrive_is_408_and_the_gateway_serves_on(sims, gateway_process, sent):
    gw = gateway_process(pools(sims) + BOUNDS)
    with connect(gw.port) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n" + sent)
        status, body, closed = response_of(sock)
    assert status == 408 and "body" in body["error"]["message"] and closed
    assert httpx.post(gw.url + "/v1/chat/completions", json=chat(), timeout=READ_S).status_code == 200
    # The client that never finished its request is counted as gone, not as the backend's failure.
    assert not any(name == "crossover_backend_ejections_total" for name, _ in gw.metrics())


# A body timer that cannot fire within the test: a request left waiting for its body hangs until READ_S fails it.
NO_BODY_TIMER = "[timeouts]\nrequest_body = 600\n"


def scripted_pools(url: str) -> str:
    return f'[pools.speculative]\nbackends = ["{url}"]\n[pools.plain]\nbackends = ["{url}"]\n'


@pytest.mark.parametrize(
    ("limit", "declared", "sent"),
    [(None, 10**9, b""), (None, 10**9, b'{"model": '), (1000, 5000, b""), (1000, 5000, b"{")],
    ids=["1GB-none", "1GB-short", "over-a-small-limit-none", "over-a-small-limit-short"],
)
def test_a_declared_body_over_the_limit_is_413_at_once(serve, gateway_process, limit, declared, sent):
    """Refused from the head alone, never held back for a body that is not coming (a 408 would need
    request_body's 600 s, and READ_S fails the wait first); the connection closes, the rest unread."""
    config = scripted_pools(serve(Scripted(body=b"{}")).url) + NO_BODY_TIMER
    if limit is not None:
        config += f"[limits]\nmax_body_bytes = {limit}\n"
    gw = gateway_process(config)
    with connect(gw.port) as sock:
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"X-Request-Id: too-big\r\nContent-Length: %d\r\n\r\n%s" % (declared, sent)
        )
        headers: dict = {}
        status, body, closed = response_of(sock, headers)
    assert status == 413 and closed and headers[b"connection"] == b"close"
    assert body["error"]["code"] == "request_too_large" and body["error"]["type"] == "invalid_request_error"
    assert headers[b"x-request-id"] == b"too-big"
    assert httpx.post(gw.url + "/v1/chat/completions", json=chat(), timeout=READ_S).status_code == 200


@pytest.mark.parametrize("limit", [1000, 100_000], ids=["under-the-direct-lane's", "over-the-direct-lane's"])
def test_a_chunked_body_growing_past_the_limit_is_413(serve, gateway_process, limit):
    """No length declared: the body is judged as it arrives, and one past the limit is refused while the
    client is still sending (the chunks so far are over it; the rest never comes)."""
    gw = gateway_process(
        scripted_pools(serve(Scripted(body=b"{}")).url) + NO_BODY_TIMER + f"[limits]\nmax_body_bytes = {limit}\n"
    )
    piece = b"x" * 4096
    with connect(gw.port) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n")
        for _ in range(2 * limit // len(piece) + 1):
            sock.sendall(b"%x\r\n%s\r\n" % (len(piece), piece))
        headers: dict = {}
        status, body, closed = response_of(sock, headers)
    assert status == 413 and closed and body["error"]["code"] == "request_too_large"


def test_a_body_gets_its_full_time_from_its_own_head(sims, gateway_process):
    """The connection's one body timer, armed by a first request's late body, fires while a second request's
    body is still within its own time: that body is waited for, then a third that never comes is 408."""
    limit = 2.0
    gw = gateway_process(pools(sims) + f"[timeouts]\nrequest_body = {limit:g}\n")
    body = json.dumps(chat()).encode()
    head = raw_post(body)[: -len(body)]
    with connect(gw.port) as sock:
        sock.sendall(head)
        time.sleep(0.2)
        sock.sendall(body)
        assert read_response(sock).startswith(b"HTTP/1.1 200 ")
        time.sleep(limit / 2)
        sock.sendall(head)
        sleep_within(limit * 3 / 4, time.monotonic(), limit, "body time")  # past the first body's, within this one's
        sock.sendall(body)
        assert read_response(sock).startswith(b"HTTP/1.1 200 ")
        sock.sendall(head)
        status, error, closed = response_of(sock)
    assert status == 408 and "body" in error["error"]["message"] and closed


def test_malformed_requests_get_json_400s_counted_not_logged_as_warnings(sims, gateway_process):
    """A fuzzer's unparsable requests each get their 400, and a count on /metrics - not a warning line each
    (uvicorn's own), which would fill the log."""
    gw = gateway_process(pools(sims) + BOUNDS, env={"CROSSOVER_LOG_LEVEL": "info"})
    for _ in range(20):
        with connect(gw.port) as sock:
            sock.sendall(b"GARBAGE\x00 / HTTP/1.1\r\n\r\n")
            status, body, closed = response_of(sock)
        assert status == 400 and closed and body["error"]["code"] == "invalid_http_request"
    assert gw.metrics()[("crossover_client_requests_refused_total", (("reason", "invalid_http"),))] == 20
    assert httpx.post(gw.url + "/v1/chat/completions", json=chat(), timeout=READ_S).status_code == 200
    assert "Invalid HTTP request" not in gw.log() and "WARNING" not in gw.log(), gw.log()


def test_memory_stays_flat_under_unterminated_heads(sims, gateway_process):
    gw = gateway_process(pools(sims))  # the default 64 KiB head limit
    before = gw.rss_bytes()
    statuses = flood_with_unterminated_heads(gw.port, 40, b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
    assert statuses == {431}
    # Uncapped, the same 40 heads took a gateway from 58 to 402 MB.
    assert gw.rss_bytes() - before < 40 * 1024 * 1024


def one_connection_request(port: int, stream: bool, close: bool) -> bytes:
    """A chat completion on a connection of its own, closed by the gateway (`close`: Connection: close) or by
    the client once the whole answer is in; the answer's status line."""
    body = json.dumps(chat(stream, 4, model=ZERO_MODEL)).encode()
    request = raw_post(body)
    if close:
        request = request.replace(b"\r\n\r\n", b"\r\nconnection: close\r\n\r\n", 1)
    with connect(port) as sock:
        sock.sendall(request)
        if not close:
            return read_response(sock).partition(b"\r\n")[0]
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    return answer.partition(b"\r\n")[0]


def test_memory_stays_flat_over_many_connections(gateway_process):
    """What a connection holds goes when it does, not when the cyclic collector next runs (rarely, here):
    4,000 requests, each on a connection of its own - non-streamed (the direct lane) and streamed (a task
    each), closed by either side - leave the gateway's RSS within 5 MB of where the first 200 left it. Before
    each connection's reference cycle was broken when it was lost: 54.5 -> 75-79 MB."""
    with running_zero(ports=2) as (speculative, plain):  # fast enough for thousands of requests in seconds
        gw = gateway_process(
            f'[pools.speculative]\nbackends = ["{speculative}"]\n[pools.plain]\nbackends = ["{plain}"]\n'
        )
        statuses = set()
        for n in range(4000):
            if n == 200:
                settled = gw.rss_bytes()
            statuses.add(one_connection_request(gw.port, stream=n % 4 == 3, close=n % 2 == 1))
        grew = gw.rss_bytes() - settled
    assert statuses == {b"HTTP/1.1 200 OK"}
    assert grew < 5 * 1024 * 1024, f"RSS grew {grew / 2**20:.1f} MB over 3,800 connections"


def test_keep_alive_closes_an_idle_connection_and_never_a_busy_one(serve, gateway_process):
    """The second answer takes longer than the keep-alive: the connection stays open through it, carries a
    third request at once, and closes once idle for the keep-alive."""
    backend = Scripted(body=b"{}", delays=[0, 2.5, 0])
    url = serve(backend).url
    gw = gateway_process(
        f'[pools.speculative]\nbackends = ["{url}"]\n[pools.plain]\nbackends = ["{url}"]\n'
        "[timeouts]\nclient_keepalive = 2\n"
    )
    request = raw_post(json.dumps(chat()).encode())
    with connect(gw.port) as sock:
        answers = []
        for _ in range(3):
            sock.sendall(request)
            answers.append(read_response(sock))
        assert all(answer.startswith(b"HTTP/1.1 200 ") for answer in answers)
        assert sock.recv(1) == b""  # closed by the gateway, idle for 2 s (READ_S bounds the wait)


def test_keep_alive_counts_from_the_last_response(serve, gateway_process):
    """A connection's one keep-alive timer, armed by its first response, fires while a later one is only
    half its keep-alive old: the connection stays open for that one's full keep-alive."""
    url = serve(Scripted(body=b"{}")).url
    keepalive = 3.0
    gw = gateway_process(
        f'[pools.speculative]\nbackends = ["{url}"]\n[pools.plain]\nbackends = ["{url}"]\n'
        f"[timeouts]\nclient_keepalive = {keepalive:g}\n"
    )
    request = raw_post(json.dumps(chat()).encode())
    with connect(gw.port) as sock:
        sock.sendall(request)
        assert read_response(sock).startswith(b"HTTP/1.1 200 ")
        time.sleep(keepalive / 2)
        sock.sendall(request)
        assert read_response(sock).startswith(b"HTTP/1.1 200 ")
        # Past the first response's keep-alive, within the second's.
        sleep_within(keepalive * 2 / 3, time.monotonic(), keepalive, "keep-alive")
        sock.sendall(request)
        assert read_response(sock).startswith(b"HTTP/1.1 200 ")
        assert sock.recv(1) == b""  # and it closes once idle again
