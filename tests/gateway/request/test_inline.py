"""The direct lane (gateway/request/inline.py): a client gets from it exactly what the ordinary path gives, it takes
only what has nothing to wait for, and a request it took is accounted for once, however it ends.

Each comparison runs the same requests through a gateway whose direct lane is on and one whose lane declines
everything (the ordinary coroutine path, on the same client protocol), and checks that the direct lane really
took them."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import socket
import threading

import httpx
import pytest

from crossover.gateway.request import lifecycle
from crossover.gateway.request.lifecycle import SHUTDOWN_MESSAGE
from crossover.gateway.request.validation import parse_generation
from tests.gateway.gateway_helpers import Scripted, chat, raw_post, read_response, wait_until

ANSWER = json.dumps({"id": "x", "object": "chat.completion", "choices": [], "usage": {"completion_tokens": 7}}).encode()
SGLANG_400 = json.dumps({"object": "error", "message": "bad role", "type": "BadRequest", "code": 400}).encode()
ERROR_EVENT = b'data: {"error": {"message": "boom", "code": 500}}\n\n'


@pytest.fixture
def serve(lane_serve):
    return lane_serve


@pytest.fixture
def gateway(lane_gateway):
    return lane_gateway


def seen(response: httpx.Response) -> tuple:
    """What a client sees of a response, but for its date."""
    headers = sorted((name, value) for name, value in response.headers.items() if name != "date")
    return response.status_code, headers, response.content


SCENARIOS = {
    # name: (speculative backend, plain backend, request body, query)
    "answer": (lambda: Scripted(body=ANSWER, headers=[(b"content-type", b"application/json")]), None, chat(), ""),
    "query": (lambda: Scripted(body=ANSWER), None, chat(), "?trace=1"),
    # Larger than the transport's read-ahead bound: read whole all the same.
    "big": (lambda: Scripted(body=b'{"text": "' + b"x" * 2_000_000 + b'"}'), None, chat(), ""),
    "400": (lambda: Scripted(status=400, body=SGLANG_400), None, chat(), ""),
    "500": (lambda: Scripted(status=500, body=b"Internal Server Error"), None, chat(), ""),
    "error-event": (lambda: Scripted(body=ERROR_EVENT), None, chat(), ""),
    "503-fails-over": (
        lambda: Scripted(status=503, body=b"busy"),
        lambda: Scripted(body=ANSWER),
        chat(),
        "",
    ),
    "502-everywhere": (
        lambda: Scripted(status=502, body=b"bad gateway"),
        lambda: Scripted(status=502, body=b"bad gateway"),
        chat(),
        "",
    ),
}


def run_scenario(serve, gateway, name: str) -> tuple:
    """(what the client saw of three requests, the request metrics, requests each backend got, queries)."""
    make_speculative, make_plain, body, query = SCENARIOS[name]
    speculative = make_speculative()
    plain = make_plain() if make_plain else Scripted(body=ANSWER)
    gw = gateway([serve(speculative).url], [serve(plain).url], health={"interval": 60})
    with httpx.Client(base_url=gw.url, timeout=10, trust_env=False) as client:
        # The first health round left a pooled connection to each backend: the lane needs one.
        responses = [
            seen(client.post("/v1/chat/completions" + query, json=body, headers={"x-request-id": f"r{n}"}))
            for n in range(3)
        ]
    gw.settled()
    counted = {
        key: value
        for key, value in gw.samples().items()
        if key[0] in ("crossover_requests_total", "crossover_failovers_total", "crossover_route_decisions_total")
        or key[0] == "crossover_output_tokens_sum"
    }
    return responses, counted, [len(speculative.requests), len(plain.requests)], speculative.queries


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_the_direct_lane_answers_as_the_ordinary_path_does(serve, gateway, lanes, name):
    direct = run_scenario(serve, gateway, name)
    took = list(lanes)
    lanes.off = True
    ordinary = run_scenario(serve, gateway, name)
    # The lane took the first request at least (a 500 asks for a health probe, which may hold the pooled
    # connection the next request would have taken: that one goes the ordinary way).
    assert took[0] is True, took
    assert direct == ordinary
    status = direct[0][0][0]
    assert status == {"answer": 200, "query": 200, "400": 400, "500": 500, "error-event": 500}.get(name, status)


def test_a_deadline_ends_the_request_and_the_backend_hears_it(serve, gateway, lanes):
    backend = Scripted(body=ANSWER, delay_s=30)
    gw = gateway([serve(backend).url], [serve(backend).url], health={"interval": 60}, timeouts={"non_stream": 0.5})
    response = httpx.post(gw.url + "/v1/chat/completions", json=chat(), timeout=10, trust_env=False)
    assert lanes == [True]
    assert response.status_code == 504
    assert response.json()["error"]["message"] == "no response from the backend within 0.5 s"
    wait_until(lambda: backend.hangups == 1, what="the backend heard the gateway hang up")
    gw.settled()
    assert gw.metric("crossover_requests_total", pool="speculative", outcome="timeout") == 1
    assert gw.state.admission.active == 0


def test_a_deadline_on_a_reused_connection_is_its_own_request_s(serve, gateway, lanes):
    """The backend connection's one timer was set for the first request; the second, sent on the same
    connection later, still ends at its own deadline."""
    backend = Scripted(body=ANSWER, delays=[0], delay_s=30)
    gw = gateway([serve(backend).url], [serve(backend).url], health={"interval": 60}, timeouts={"non_stream": 2})
    with httpx.Client(base_url=gw.url, timeout=20, trust_env=False) as client:
        first = client.post("/v1/chat/completions", json=chat())
        second = client.post("/v1/chat/completions", json=chat())
    assert lanes == [True, True]
    assert first.status_code == 200
    assert second.status_code == 504
    assert second.json()["error"]["message"] == "no response from the backend within 2 s"
    wait_until(lambda: backend.hangups == 1, what="the backend heard the gateway hang up")


def test_a_client_that_leaves_frees_its_place_and_the_backend_hears_it(serve, gateway, lanes):
    backend = Scripted(body=ANSWER, delay_s=30)
    gw = gateway([serve(backend).url], [serve(backend).url], health={"interval": 60})
    port = int(gw.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(raw_post(json.dumps(chat()).encode()))
        wait_until(lambda: len(backend.requests) == 1, what="the request reached the backend")
    wait_until(lambda: backend.hangups == 1, what="the backend heard the gateway hang up")
    assert lanes == [True]
    gw.settled()
    assert gw.metric("crossover_requests_total", pool="speculative", outcome="client_disconnect") == 1
    assert gw.state.admission.active == 0 and not gw.app.live.requests


def test_a_shutdown_cut_answers_503(serve, gateway, lanes):
    backend = Scripted(body=ANSWER, delay_s=30)
    gw = gateway([serve(backend).url], [serve(backend).url], health={"interval": 60})
    port = int(gw.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(raw_post(json.dumps(chat()).encode()))
        wait_until(lambda: len(backend.requests) == 1, what="the request reached the backend")
        exchange = next(iter(gw.app.live.requests))
        exchange.loop.call_soon_threadsafe(gw.app.live.cut_all)
        answer = read_response(sock)
    assert lanes == [True]
    assert answer.startswith(b"HTTP/1.1 503 ")
    assert json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]["message"] == SHUTDOWN_MESSAGE
    wait_until(lambda: backend.hangups == 1, what="the backend heard the gateway hang up")
    gw.settled()
    assert gw.metric("crossover_requests_total", pool="speculative", outcome="shutdown") == 1


def test_pipelined_requests_are_answered_in_order(serve, gateway, lanes):
    backend = Scripted(body=ANSWER, delay_s=0.2)
    gw = gateway([serve(backend).url], [serve(backend).url], health={"interval": 60})
    port = int(gw.url.rsplit(":", 1)[1])
    body = json.dumps(chat()).encode()
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(raw_post(body, b"first") + raw_post(body, b"second"))
        answers = [read_response(sock), read_response(sock)]
    assert [b"x-request-id: first" in answers[0], b"x-request-id: second" in answers[1]] == [True, True]
    assert all(answer.startswith(b"HTTP/1.1 200 ") for answer in answers)
    assert lanes[0] is True  # the second waited in uvicorn's pipeline and went the ordinary way


@pytest.mark.parametrize(
    "body, status",
    [
        (json.dumps(chat(stream=True)).encode(), 200),  # streams
        (b"{not json", 400),  # errors are answered the ordinary way
        (json.dumps({"model": "nope", "messages": [{"role": "user", "content": "x"}]}).encode(), 404),
    ],
    ids=["stream", "bad-json", "unknown-model"],
)
def test_what_is_not_a_plain_answer_goes_the_ordinary_way(serve, gateway, lanes, body, status):
    backend = Scripted(chunks=[b'data: {"choices": []}\n\n', b"data: [DONE]\n\n"])
    gw = gateway([serve(backend).url], [serve(backend).url], health={"interval": 60})
    response = httpx.post(
        gw.url + "/v1/chat/completions", content=body, headers={"content-type": "application/json"}, timeout=10
    )
    assert response.status_code == status
    assert lanes == [False]


def test_a_stream_the_lane_leaves_is_parsed_once(serve, gateway, lanes, monkeypatch):
    parsed = []

    def counting(body, models):
        parsed.append(body)
        return parse_generation(body, models)

    monkeypatch.setattr(lifecycle, "parse_generation", counting)
    backend = Scripted(chunks=[b'data: {"choices": []}\n\n', b"data: [DONE]\n\n"])
    gw = gateway([serve(backend).url], [serve(backend).url], health={"interval": 60})
    response = httpx.post(gw.url + "/v1/chat/completions", json=chat(stream=True), timeout=10, trust_env=False)
    assert response.status_code == 200 and response.text.endswith("data: [DONE]\n\n")
    assert lanes == [False] and len(parsed) == 1


def test_a_small_body_that_comes_after_its_head_is_taken_once_it_is_in(serve, gateway, lanes):
    """Clients (httpx, so the OpenAI SDK) write a request's head and body apart: the lane waits for the body."""
    backend = Scripted(body=ANSWER)
    gw = gateway([serve(backend).url], [serve(backend).url], health={"interval": 60})
    port = int(gw.url.rsplit(":", 1)[1])
    request = raw_post(json.dumps(chat()).encode())
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(request[:-5])
        connections = gw.server.server_state.connections
        wait_until(lambda: any(c._deferred for c in connections), what="the head read, its body not yet")
        sock.sendall(request[-5:])
        answer = read_response(sock)
    assert answer.startswith(b"HTTP/1.1 200 ") and answer.endswith(ANSWER)
    assert lanes == [True]


def test_a_client_that_waits_for_100_continue_gets_it(serve, gateway, lanes):
    backend = Scripted(body=ANSWER)
    gw = gateway([serve(backend).url], [serve(backend).url], health={"interval": 60})
    port = int(gw.url.rsplit(":", 1)[1])
    head, _, body = raw_post(json.dumps(chat()).encode()).partition(b"\r\n\r\n")
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(head + b"\r\nexpect: 100-continue\r\n\r\n")
        interim = b""
        while b"\r\n\r\n" not in interim:
            interim += sock.recv(65536)
        assert interim.startswith(b"HTTP/1.1 100 ")
        sock.sendall(body)
        answer = read_response(sock)
    assert answer.startswith(b"HTTP/1.1 200 ") and answer.endswith(ANSWER)
    assert lanes == []  # it waited in the ordinary way


def test_a_client_that_leaves_before_its_body_is_in_is_counted(serve, gateway, lanes):
    backend = Scripted(body=ANSWER)
    gw = gateway([serve(backend).url], [serve(backend).url], health={"interval": 60})
    port = int(gw.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(raw_post(json.dumps(chat()).encode())[:-5])
    wait_until(
        lambda: gw.metric("crossover_requests_total", pool="none", outcome="client_disconnect") == 1,
        what="the request counted as the client's disconnect",
    )
    assert lanes == [] and not backend.requests


class Gated(Scripted):
    """Answers each request once the test opens `gate`."""

    def __init__(self, **script) -> None:
        super().__init__(**script)
        self.gate = threading.Event()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"] not in ("/health", "/v1/models"):
            await asyncio.to_thread(self.gate.wait, 30)
        await super().__call__(scope, receive, send)


def test_a_full_gateway_queues_the_ordinary_way(serve, gateway, lanes):
    backend = Gated(body=ANSWER)
    gw = gateway([serve(backend).url], [serve(backend).url], health={"interval": 60}, limits={"max_inflight": 1})
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        post = lambda: httpx.post(gw.url + "/v1/chat/completions", json=chat(), timeout=30, trust_env=False)  # noqa: E731
        one = pool.submit(post)
        wait_until(lambda: gw.state.admission.active == 1, what="the first request in flight")
        two = pool.submit(post)
        wait_until(lambda: gw.state.admission.queued == 1, what="the second request waiting for a slot")
        backend.gate.set()
        responses = [one.result(), two.result()]
    assert [response.status_code for response in responses] == [200, 200]
    assert lanes == [True, False]  # the second found no free slot: it queued the ordinary way


@pytest.mark.parametrize("delay_s", [0.0, 0.2], ids=["answered-while-refused", "answered-after-the-client-left"])
def test_pipelined_requests_then_junk_end_without_an_error_logged(serve, gateway, lanes, caplog, delay_s):
    """The junk is refused at once (400, then the connection closes): the requests ahead of it find their
    client's connection going, and end as a client that left, with nothing written on it and nothing logged."""
    backend = Scripted(body=ANSWER, delay_s=delay_s)
    gw = gateway([serve(backend).url], [serve(backend).url], health={"interval": 60})
    port = int(gw.url.rsplit(":", 1)[1])
    body = json.dumps(chat()).encode()
    for stream in (False, True):
        request = raw_post(json.dumps(chat(stream=stream)).encode()) if stream else raw_post(body)
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(request + request + b"junk\r\n\r\n")
            sock.recv(65536)
        wait_until(lambda: len(backend.requests) >= 1 and not gw.app.live.requests, what="every request ended")
    gw.settled()
    assert gw.state.admission.active == 0
    errors = [record for record in caplog.records if record.levelname in ("ERROR", "CRITICAL")]
    assert not errors, [record.getMessage() for record in errors]
