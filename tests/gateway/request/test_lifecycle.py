"""One request's lifecycle (gateway/request/lifecycle.py), on each of its drivers: whatever step raises, the client gets
an answer (a clean error event and `[DONE]` once its stream began, nothing more once its response is complete),
and the request is accounted for exactly once - its in-flight count, admission slot, backend lease and
crossover_requests_total all balance afterwards.

The lanes: the direct lane (a non-streamed request served from callbacks), the ordinary coroutine path on the
gateway's own client protocol (non-streamed and streamed), and the coroutine path under plain uvicorn."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.gateway.gateway_helpers import Scripted, chat, sse_events, wait_until

HUGE = "1" + "0" * 4999  # 5,000 digits: more than int() converts (sys.get_int_max_str_digits)
SSE = [(b"content-type", b"text/event-stream")]
JSON = [(b"content-type", b"application/json")]
ANSWER = json.dumps({"id": "x", "object": "chat.completion", "choices": [], "usage": {"completion_tokens": 7}}).encode()
EVENTS = [b'data: {"choices": [{"index": 0, "delta": {"content": "hi"}}]}\n\n', b"data: [DONE]\n\n"]
# lane: (streamed, on plain uvicorn, direct lane on)
LANES = {
    "direct": (False, False, True),
    "ordinary": (False, False, False),
    "ordinary-stream": (True, False, False),
    "asgi": (False, True, False),
    "asgi-stream": (True, True, False),
}


def huge_usage(stream: bool) -> Scripted:
    """A backend whose answer counts 5,000 digits of output tokens."""
    if stream:
        usage = b'data: {"choices": [], "usage": {"completion_tokens": %s}}\n\n' % HUGE.encode()
        return Scripted(chunks=[EVENTS[0], usage, EVENTS[1]], headers=SSE)
    return Scripted(body=b'{"choices": [], "usage": {"completion_tokens": %s}}' % HUGE.encode(), headers=JSON)


def start(lane_serve, lane_gateway, lanes, lane: str, backend: Scripted, **settings):
    stream, plain_uvicorn, direct = LANES[lane]
    lanes.off = not direct
    url = lane_serve(backend).url
    return lane_gateway([url], [url], plain_uvicorn=plain_uvicorn, health={"interval": 60}, **settings), stream


def post(gw, stream: bool) -> httpx.Response:
    return httpx.post(gw.url + "/v1/chat/completions", json=chat(stream), timeout=30, trust_env=False)


def assert_balanced(gw, requests: int) -> None:
    """Nothing of the requests is left in flight anywhere, and each is counted exactly once. (A client may have its
    answer before the request's end ran: waited for.)"""

    def counted() -> float:
        return sum(value for (name, _), value in gw.samples().items() if name == "crossover_requests_total")

    wait_until(lambda: counted() >= requests and not gw.app.live.requests, what="every request ended")
    gw.settled()
    assert counted() == requests
    assert gw.state.admission.active == 0


@pytest.mark.parametrize("lane", list(LANES))
def test_a_huge_usage_count_is_answered_and_accounted_for_once(lane_serve, lane_gateway, lanes, caplog, lane):
    backend = huge_usage(LANES[lane][0])
    gw, stream = start(lane_serve, lane_gateway, lanes, lane, backend)
    responses = [post(gw, stream) for _ in range(3)]
    assert [response.status_code for response in responses] == [200] * 3
    # Passed on as the backend sent it, and nothing after it.
    assert all(response.content == (b"".join(backend.chunks) if stream else backend.body) for response in responses)
    if lane == "direct":
        assert lanes[0] is True
    assert_balanced(gw, 3)
    assert gw.metric("crossover_requests_total", pool="speculative", outcome="ok") == 3
    assert "after response already completed" not in caplog.text


def boom(*args, **kwargs):
    raise RuntimeError("an injected fault")


# step: what raises on the direct lane, and on the coroutine path (None: the step is the lane's alone). The
# direct lane declines a request whose steps fail before it holds a slot: the coroutine path then answers it.
FAULTS = {
    "check": ("gateway.request.lifecycle.parse_generation", "gateway.request.lifecycle.parse_generation"),
    "admit": ("gateway.admission.Admission.take_free", "gateway.admission.Admission.take_free"),
    "route": ("gateway.topology.partitioned.Partitioned.route", "gateway.topology.partitioned.Partitioned.route"),
    "choose": ("gateway.request.failover.Failover.choose", "gateway.request.failover.Failover.choose"),
    "send": ("gateway.wire.http1.Http1Transport.dispatch", "gateway.wire.http1.Http1Transport.open"),
    "sent": ("gateway.request.inline.InlineExchange._dispatched", None),  # between the write and the bookkeeping
    "settle": ("gateway.request.lifecycle.Request._whole", "gateway.request.lifecycle.Request._whole"),
    "relay": (None, "gateway.request.proxy.Exchange._deliver"),  # a stream's pieces after its first
    "cut": ("gateway.request.inline.InlineExchange._expire", "gateway.request.proxy.Exchange._deadline_passed"),
}
CUT_TIMEOUTS = {"non_stream": 0.5, "first_byte": 0.5}


def faults() -> list:
    cases = []
    for step, (direct, coroutine) in FAULTS.items():
        for lane, (stream, _, on) in LANES.items():
            target = direct if on else coroutine
            # The whole answer's steps and the stream's are apart: `_whole` is never a stream's, `_deliver` always.
            if target is None or (step == "settle" and stream) or (step == "relay" and not stream):
                continue
            cases.append(pytest.param(step, lane, "crossover." + target, id=f"{step}-{lane}"))
    return cases


@pytest.mark.parametrize("step, lane, target", faults())
def test_a_step_that_raises_is_answered_and_accounted_for_once(
    lane_serve, lane_gateway, lanes, monkeypatch, step, lane, target
):
    stream = LANES[lane][0]
    if step == "cut":  # the deadline cuts a backend that does not answer in time
        backend = Scripted(body=ANSWER, chunks=EVENTS if stream else [], headers=SSE if stream else JSON, delay_s=30)
        gw, _ = start(lane_serve, lane_gateway, lanes, lane, backend, timeouts=CUT_TIMEOUTS)
    else:
        backend = Scripted(chunks=EVENTS, headers=SSE, gap_s=0.05) if stream else Scripted(body=ANSWER, headers=JSON)
        gw, _ = start(lane_serve, lane_gateway, lanes, lane, backend)
    monkeypatch.setattr(target, boom)
    response = post(gw, stream)
    if lane == "direct":
        assert lanes[0] is (step in ("send", "sent", "settle", "cut"))  # past the slot: the lane's to answer
    if step == "relay":  # the stream began: it ends cleanly, with an error event if it had not said [DONE]
        assert response.status_code == 200
        events = sse_events(response.content)
        assert events.count("[DONE]") == 1 and events[-1] == "[DONE]"
        assert all("error" not in event for event in events[:-2])
    else:
        assert response.status_code == 500
        assert response.json()["error"]["message"] == "internal gateway error"
    assert_balanced(gw, 1)
    pool = response.headers.get("x-crossover-pool", "none")
    assert gw.metric("crossover_requests_total", pool=pool, outcome="backend_error") == 1


@pytest.mark.parametrize("lane", list(LANES))
def test_a_fault_in_the_accounting_still_gives_everything_back(lane_serve, lane_gateway, lanes, caplog, lane):
    stream = LANES[lane][0]
    backend = Scripted(chunks=EVENTS, headers=SSE) if stream else Scripted(body=ANSWER, headers=JSON)
    gw, _ = start(lane_serve, lane_gateway, lanes, lane, backend)
    gw.state.metrics.duration.observe = boom  # `end`'s second record, after the request's count
    response = post(gw, stream)
    assert response.status_code == 200
    assert_balanced(gw, 1)
    assert "its accounting failed" in caplog.text
