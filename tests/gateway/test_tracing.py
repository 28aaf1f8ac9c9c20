"""OpenTelemetry (gateway/tracing.py): `crossover serve` with the standard OTEL_* variables exports a span per request
to an OTLP/HTTP receiver, and the backend gets the same trace; without the extra, it serves as before."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from crossover.gateway.tracing import Tracing, make_tracing
from tests.gateway.gateway_helpers import MODEL, SIM_SCALE, WAIT_S, Scripted, chat
from tests.waiting import wait_until

ANSWER = json.dumps(
    {"object": "chat.completion", "choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 3}}
).encode()
STREAM = [
    b'data: {"object": "chat.completion.chunk", "choices": []}\n\n',
    b'data: {"object": "chat.completion.chunk", "choices": [], '
    b'"usage": {"prompt_tokens": 5, "completion_tokens": 3}}\n\n',
    b"data: [DONE]\n\n",
]
# The otel modules hidden from a process, as if the extra were not installed.
HIDE_OTEL = """
import sys


class HideOpenTelemetry:
    def find_spec(self, name, path=None, target=None):
        if name == "opentelemetry" or name.startswith("opentelemetry."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


sys.meta_path.insert(0, HideOpenTelemetry())
"""


class Receiver:
    """An OTLP/HTTP trace receiver: POST /v1/traces (protobuf), its spans kept by attribute."""

    def __init__(self) -> None:
        self.spans: list[tuple[object, dict]] = []
        self.changed = threading.Condition()
        self.app = Starlette(routes=[Route("/v1/traces", self.traces, methods=["POST"])])

    async def traces(self, request: Request) -> Response:
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

        export = ExportTraceServiceRequest()
        export.ParseFromString(await request.body())
        with self.changed:
            for resource_spans in export.resource_spans:
                for scope_spans in resource_spans.scope_spans:
                    for span in scope_spans.spans:
                        self.spans.append((span, {kv.key: _value(kv.value) for kv in span.attributes}))
            self.changed.notify_all()
        return Response(b"", media_type="application/x-protobuf")

    def wait_for(self, found, timeout: float = WAIT_S):
        """The first span `found(span, attributes)` accepts, waiting for exports until `timeout`."""
        with self.changed:
            match = None

            def seen() -> bool:
                nonlocal match
                match = next(((s, a) for s, a in self.spans if found(s, a)), None)
                return match is not None

            assert self.changed.wait_for(seen, timeout), [a for _, a in self.spans]
            return match


def _value(value):
    return getattr(value, value.WhichOneof("value"))


def pools_toml(speculative: str, plain: str, threshold: int) -> str:
    return (
        f'threshold = {threshold}\n[pools.speculative]\nbackends = ["{speculative}"]\n'
        f'[pools.plain]\nbackends = ["{plain}"]\n'
    )


def traced_gateway(gateway_process, collector_url: str, speculative: str, plain: str, threshold: int):
    return gateway_process(
        pools_toml(speculative, plain, threshold),
        env={
            "OTEL_EXPORTER_OTLP_ENDPOINT": collector_url,
            "OTEL_SERVICE_NAME": "crossover-test",
            "OTEL_BSP_SCHEDULE_DELAY": "50",  # ms: spans leave at once, and the test waits on their arrival
        },
    )


def generations(backend: Scripted) -> list[dict[bytes, bytes]]:
    """The headers of each generation request `backend` got (not the gateway's probes)."""
    return [headers for path, headers, _ in backend.requests if path == "/v1/chat/completions"]


# A non-streamed request takes the inline lane (gateway/request/inline.py), a stream the coroutine (proxy.py).
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_a_request_is_a_span_with_its_routing_decision_and_the_backend_gets_its_trace(serve, gateway_process, stream):
    receiver = Receiver()
    collector = serve(receiver.app)
    answer = Scripted(chunks=STREAM) if stream else Scripted(body=ANSWER)
    speculative, plain = answer, Scripted(body=ANSWER)
    speculative_url = serve(speculative).url
    gw = traced_gateway(gateway_process, collector.url, speculative_url, serve(plain).url, threshold=4)
    client_trace = "0af7651916cd43dd8448eb211c80319c"
    response = httpx.post(
        gw.url + "/v1/chat/completions",
        json=chat(stream),
        headers={"traceparent": f"00-{client_trace}-b7ad6b7169203331-01"},
        timeout=WAIT_S,
        trust_env=False,
    )
    assert response.status_code == 200 and response.headers["x-crossover-pool"] == "speculative"

    span, attributes = receiver.wait_for(lambda s, a: a.get("url.path") == "/v1/chat/completions")
    assert span.kind == span.SPAN_KIND_SERVER
    assert attributes["crossover.pool"] == "speculative"
    assert attributes["crossover.threshold"] == 4
    assert attributes["crossover.topology"] == "partitioned"
    assert attributes["crossover.policy"] == "spillover"
    assert attributes["crossover.loads.speculative"] == 0
    assert attributes["crossover.outcome"] == "ok"
    assert attributes["crossover.failover.attempts"] == 1
    assert attributes["http.request.method"] == "POST"
    assert attributes["http.response.status_code"] == 200
    assert attributes["gen_ai.request.model"] == MODEL
    assert attributes["gen_ai.usage.output_tokens"] == 3
    assert attributes["crossover.backend"] == speculative_url
    # The client's trace is continued, and the backend got it, under the attempt's span.
    assert span.trace_id.hex() == client_trace
    (headers,) = generations(speculative)
    version, trace_id, parent_id, _ = headers[b"traceparent"].decode().split("-")
    assert (version, trace_id) == ("00", client_trace)
    attempt, attempt_attributes = receiver.wait_for(lambda s, a: s.span_id.hex() == parent_id)
    assert attempt.parent_span_id == span.span_id and attempt.kind == attempt.SPAN_KIND_CLIENT
    assert attempt_attributes["http.response.status_code"] == 200
    assert generations(plain) == []


def test_a_failover_is_a_second_attempt_under_the_same_span(serve, gateway_process):
    receiver = Receiver()
    collector = serve(receiver.app)
    busy = Scripted(status=503, body=b'{"object": "error", "message": "busy", "type": "ServiceUnavailable"}')
    plain = Scripted(body=ANSWER)
    plain_url = serve(plain).url
    gw = traced_gateway(gateway_process, collector.url, serve(busy).url, plain_url, threshold=4)
    response = httpx.post(gw.url + "/v1/chat/completions", json=chat(), timeout=WAIT_S, trust_env=False)
    assert response.status_code == 200 and response.headers["x-crossover-pool"] == "plain"
    span, attributes = receiver.wait_for(lambda s, a: a.get("url.path") == "/v1/chat/completions")
    assert attributes["crossover.pool"] == "speculative"  # the decision; the request ended on plain
    assert attributes["crossover.failover.attempts"] == 2
    assert attributes["crossover.backend"] == plain_url  # where it was served
    (first,) = generations(busy)
    (second,) = generations(plain)
    first_parent, second_parent = (h[b"traceparent"].split(b"-")[2].decode() for h in (first, second))
    failed, failed_attributes = receiver.wait_for(lambda s, a: s.span_id.hex() == first_parent)
    answered, _ = receiver.wait_for(lambda s, a: s.span_id.hex() == second_parent)
    assert failed.parent_span_id == answered.parent_span_id == span.span_id
    assert failed_attributes["error.type"] == "backend_busy"
    assert failed.status.code == failed.status.STATUS_CODE_ERROR


def test_without_the_extra_the_gateway_starts_and_serves_as_before(serve, gateway_process, tmp_path):
    hidden = tmp_path / "hidden"
    hidden.mkdir()
    (hidden / "sitecustomize.py").write_text(HIDE_OTEL)
    speculative, plain = Scripted(body=ANSWER), Scripted(body=ANSWER)
    gw = gateway_process(
        pools_toml(serve(speculative).url, serve(plain).url, threshold=0),
        env={"PYTHONPATH": str(hidden), "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9"},
    )
    response = httpx.post(gw.url + "/v1/chat/completions", json=chat(), timeout=WAIT_S, trust_env=False)
    assert response.status_code == 200 and response.headers["x-crossover-pool"] == "plain"
    assert response.content == ANSWER
    (headers,) = [headers for path, headers, _ in plain.requests if path == "/v1/chat/completions"]
    assert b"traceparent" not in headers
    assert "crossover[otel] is not installed" in gw.log_path.read_text()


@pytest.mark.parametrize(
    "environ",
    [
        {},
        {"OTEL_SERVICE_NAME": "x"},
        {"OTEL_TRACES_EXPORTER": "none"},
        {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://h:4318", "OTEL_SDK_DISABLED": "true"},
    ],
)
def test_tracing_is_off_unless_the_variables_say_where_spans_go(environ):
    assert make_tracing(environ) is None


class Spans:
    """A gateway's spans in memory (the SDK's own exporter), read after a flush."""

    def __init__(self) -> None:
        from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

        self.exporter = InMemorySpanExporter()
        self.tracing = Tracing([], exporter=self.exporter)

    def named(self, name: str) -> list:
        self.tracing.provider.force_flush()
        return [span for span in self.exporter.get_finished_spans() if span.name == name]


ADMIN_TOKEN = "t"
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


def test_a_switch_is_a_span_with_its_phases_and_a_request_says_the_mode_it_met(gateway, sim):
    speculative, plain = sim("k25-eagle3", *SIM_SCALE), sim("k25-plain", *SIM_SCALE)
    httpx.post(plain.url + "/release_memory_occupation", json={}, timeout=10, trust_env=False).raise_for_status()
    spans = Spans()
    gw = gateway(
        [speculative.url],
        [plain.url],
        tracing=spans.tracing,
        topology="time-shared",
        admin_token=ADMIN_TOKEN,
        switching={"mechanism": "sleep", "dwell": 3600.0, "interval": 0.05, "operator_interval": 0.0},
    )
    state = lambda: httpx.get(gw.url + "/admin/state", headers=ADMIN, timeout=10, trust_env=False).json()  # noqa: E731
    wait_until(lambda: state()["phase"] == "active", WAIT_S)
    assert httpx.post(gw.url + "/v1/chat/completions", json=chat(), timeout=WAIT_S, trust_env=False).status_code == 200
    wait_until(lambda: spans.named("POST /v1/chat/completions"), WAIT_S)
    (request,) = spans.named("POST /v1/chat/completions")
    attributes = request.attributes
    assert (attributes["crossover.topology"], attributes["crossover.mode"]) == ("time-shared", "speculative")
    assert attributes["crossover.phase"] == "active" and attributes["crossover.pool"] == "speculative"

    put = httpx.put(gw.url + "/admin/mode", json={"mode": "plain"}, headers=ADMIN, timeout=10, trust_env=False)
    assert put.status_code == 202, put.text
    wait_until(lambda: spans.named("crossover.switch"), WAIT_S)
    (switch,) = spans.named("crossover.switch")
    assert switch.attributes["crossover.switch.to"] == "plain"
    assert switch.attributes["crossover.switch.from"] == "speculative"
    assert switch.attributes["crossover.switch.outcome"] == "ok"
    assert [event.name for event in switch.events] == ["draining", "switching", "verifying", "active"]


def test_a_gate_move_is_a_span(gateway, sim):
    gated = sim("k25-eagle3", *SIM_SCALE, "--speculation-gate")
    spans = Spans()
    gw = gateway(
        [],
        [],
        tracing=spans.tracing,
        topology="in-engine",
        threshold=4,
        admin_token=ADMIN_TOKEN,
        pools={"speculative": {"backends": [gated.url]}},
    )
    put = httpx.put(gw.url + "/admin/threshold", json={"threshold": 12}, headers=ADMIN, timeout=10, trust_env=False)
    assert put.status_code == 200, put.text
    moves = [span.attributes for span in spans.named("crossover.gate")]
    assert {"crossover.backend": gated.url, "crossover.gate.to": 12} in [
        {key: move[key] for key in ("crossover.backend", "crossover.gate.to")} for move in moves
    ]


def test_an_unsampled_request_still_passes_its_trace_on_and_exports_nothing(monkeypatch):
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "always_off")
    spans = Spans()
    client_trace = "4bf92f3577b34da6a3ce929d0e0e4736"
    scope = {
        "method": "POST",
        "path": "/v1/chat/completions",
        "headers": [(b"traceparent", f"00-{client_trace}-00f067aa0ba902b7-00".encode())],
    }
    trace = spans.tracing.request(scope, time.perf_counter())
    trace.routed("plain", "above_threshold", {"threshold": 0})
    headers = trace.attempt(list(scope["headers"]), "http://127.0.0.1:1", "plain")
    trace.answered(200)
    trace.responded(200)
    trace.end("ok", 1, 1)
    (traceparent,) = [value for name, value in headers if name == b"traceparent"]
    assert traceparent.decode().split("-")[1] == client_trace and traceparent.endswith(b"-00")
    assert spans.named("POST /v1/chat/completions") == spans.named("POST") == []
