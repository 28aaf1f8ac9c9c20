"""OpenTelemetry traces of every routing decision: one server span per generation request (the decision as its
attributes), a client span per backend attempt whose W3C `traceparent` the engine receives, a span per switch of a
time-shared GPU set and per gate move of an in-engine pool.

On when the `otel` extra is installed and the standard variables say where spans go (`ON_WHEN`); everything else
the SDK reads from `OTEL_*` itself (service name, resource, sampler, batch schedule, exporter headers). Off,
`make_tracing` answers None, nothing of OpenTelemetry is imported, and the request path looks once per request:

    tracing = make_tracing(os.environ)                      # None: off
    trace = tracing.request(scope, started)                 # the server span; a client's `traceparent` continued
    trace.checked(model, tier); trace.routed(pool, reason, topology.trace_view())
    headers = trace.attempt(headers, backend.url, pool)     # a child span per attempt; its traceparent sent
    trace.answered(200) | trace.attempt_failed(kind, detail)
    trace.responded(200); trace.end(outcome, output_tokens, input_tokens)
    with tracing.span("crossover.switch", {...}):           # switches and gate moves
        tracing.event("draining")
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator, Mapping
from typing import Any

log = logging.getLogger("crossover.tracing")

# Any of these set (and not "none") turns tracing on, as the OpenTelemetry SDK's own auto-configuration reads them.
ON_WHEN = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_TRACES_EXPORTER")
DEFAULT_SERVICE_NAME = "crossover"
TRACEPARENT = b"traceparent"
TRACESTATE = b"tracestate"
# The engine gets the attempt's context, never a client's.
_THEIRS = frozenset({TRACEPARENT, TRACESTATE})
# The attribute prefix of the routing decision (`Topology.trace_view`'s keys go under it).
PREFIX = "crossover."
_OPERATIONS = {"/v1/chat/completions": "chat", "/v1/completions": "text_completion"}


def make_tracing(environ: Mapping[str, str]) -> Tracing | None:
    """The gateway's tracing, or None when it is off: no endpoint or exporter named, `OTEL_SDK_DISABLED`, or the
    `otel` extra not installed (said once, since the variables ask for traces)."""
    exporters = [name.strip() for name in environ.get("OTEL_TRACES_EXPORTER", "").split(",") if name.strip()]
    if not any(environ.get(name) for name in ON_WHEN) or exporters == ["none"]:
        return None
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return None
    try:
        from opentelemetry.sdk.trace import TracerProvider  # noqa: F401
    except ImportError:
        log.warning(
            "OTEL_* asks for traces, but crossover[otel] is not installed: no traces (pip install 'crossover[otel]')"
        )
        return None
    return Tracing(
        exporters or ["otlp"], service_name=None if environ.get("OTEL_SERVICE_NAME") else DEFAULT_SERVICE_NAME
    )


class Tracing:
    """The gateway's tracer (its own provider: nothing global), made once in `create_app`; `close` flushes."""

    def __init__(self, exporters: list[str], service_name: str | None = DEFAULT_SERVICE_NAME, exporter=None) -> None:
        from opentelemetry import trace
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self._trace = trace
        self._status = trace.Status
        self._error = trace.StatusCode.ERROR
        self._server, self._client, self._internal = (
            trace.SpanKind.SERVER,
            trace.SpanKind.CLIENT,
            trace.SpanKind.INTERNAL,
        )
        self._propagator = TraceContextTextMapPropagator()
        # Resource.create reads OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES; the provider reads the sampler's.
        self.provider = TracerProvider(resource=Resource.create({"service.name": service_name} if service_name else {}))
        if exporter is not None:
            self.provider.add_span_processor(BatchSpanProcessor(exporter))
        for name in exporters:
            if name == "otlp":
                from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

                self.provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
            elif name == "console":
                self.provider.add_span_processor(BatchSpanProcessor(ConsoleSpanExporter()))
            elif name != "none":
                log.warning("OTEL_TRACES_EXPORTER=%s: not one crossover knows (otlp, console, none); ignored", name)
        self.tracer = self.provider.get_tracer("crossover.gateway")

    def close(self) -> None:
        """Export what is left (the lifespan's end)."""
        self.provider.shutdown()

    # -- one request ------------------------------------------------------------------------------------

    def request(self, scope, started: float) -> RequestTrace:
        """The server span of a request that began at `started` (`time.perf_counter()`), continuing the client's
        `traceparent` if it sent one."""
        carrier = {
            name.decode("latin-1"): value.decode("latin-1") for name, value in scope["headers"] if name in _THEIRS
        }
        parent = self._propagator.extract(carrier) if carrier else None
        path = scope["path"]
        began = time.time_ns() - int((time.perf_counter() - started) * 1e9)
        span = self.tracer.start_span(
            f"{scope['method']} {path}",
            context=parent,
            kind=self._server,
            start_time=began,
            attributes={"http.request.method": scope["method"], "url.path": path, "url.scheme": "http"},
        )
        operation = _OPERATIONS.get(path)
        if operation is not None:
            span.set_attribute("gen_ai.operation.name", operation)
        return RequestTrace(self, span)

    # -- switches and gate moves --------------------------------------------------------------------------

    @contextlib.contextmanager
    def span(self, name: str, attributes: dict[str, Any]) -> Iterator[Any]:
        """An internal span around a switch or a gate move (current in its task, so `event` lands on it)."""
        with self.tracer.start_as_current_span(name, kind=self._internal, attributes=attributes) as span:
            yield span

    def event(self, name: str, attributes: dict[str, Any] | None = None) -> None:
        """An event on the span current in this task (a switch's phases)."""
        self._trace.get_current_span().add_event(name, attributes or {})

    def failed(self, span, description: str) -> None:
        span.set_status(self._status(self._error, description))


class RequestTrace:
    """One request's server span, and its current backend attempt's client span. The server span's attributes are
    gathered here and set once, as it ends: the SDK takes a lock and checks each value on every call."""

    __slots__ = ("attempt_span", "attempts", "attributes", "span", "tracing")

    def __init__(self, tracing: Tracing, span) -> None:
        self.tracing = tracing
        self.span = span
        self.attempt_span: Any = None  # the current attempt's client span
        self.attempts = 0
        self.attributes: dict[str, Any] = {}

    def checked(self, model: str | None, tier: str | None) -> None:
        """What routing read of the body: the model asked for, the service tier (its key's, if it named none)."""
        if model is not None:
            self.attributes["gen_ai.request.model"] = model
        if tier is not None:
            self.attributes["crossover.service_tier"] = tier

    def routed(self, pool: str, reason: str, decision: dict[str, Any]) -> None:
        """The routing decision: the pool chosen and why, and what the topology saw when it chose."""
        attributes = self.attributes
        attributes["crossover.pool"] = pool
        attributes["crossover.reason"] = reason
        for key, value in decision.items():
            if value is not None:
                attributes[PREFIX + key] = value

    def attempt(self, headers: list[tuple[bytes, bytes]], backend_url: str, pool: str) -> list[tuple[bytes, bytes]]:
        """A backend attempt begins: its client span, and `headers` carrying its `traceparent` (the client's own
        trace context replaced: the engine's spans hang under the attempt)."""
        self._end_attempt()
        self.attempts += 1
        tracing = self.tracing
        if self.span.is_recording():
            span = self.attempt_span = tracing.tracer.start_span(
                "POST",
                context=tracing._trace.set_span_in_context(self.span),
                kind=tracing._client,
                attributes={"http.request.method": "POST", "url.full": backend_url, "crossover.pool": pool},
            )
        else:  # not sampled: the engine still gets the trace (unsampled), and nothing more is made of it here
            span = self.span
        context = span.get_span_context()
        traceparent = b"00-%032x-%016x-%02x" % (context.trace_id, context.span_id, context.trace_flags)
        headers = [(name, value) for name, value in headers if name not in _THEIRS]
        headers.append((TRACEPARENT, traceparent))
        if context.trace_state:
            headers.append((TRACESTATE, context.trace_state.to_header().encode("latin-1")))
        self.attributes["crossover.backend"] = backend_url
        return headers

    def answered(self, status: int) -> None:
        """The attempt's backend answered `status` (its span ends with the request: a stream is still coming)."""
        span = self.attempt_span
        if span is not None:
            span.set_attribute("http.response.status_code", status)
            if status >= 400:
                self.tracing.failed(span, str(status))

    def attempt_failed(self, kind: str, detail: str) -> None:
        """The attempt failed before the client saw a byte: its span ends here."""
        span = self.attempt_span
        if span is not None:
            span.set_attribute("error.type", kind)
            self.tracing.failed(span, detail)
            self._end_attempt()

    def responded(self, status: int) -> None:
        """The status the client got."""
        self.attributes["http.response.status_code"] = status

    def end(self, outcome: str, output_tokens: int, input_tokens: int) -> None:
        attributes = self.attributes
        attributes["crossover.outcome"] = outcome
        attributes["crossover.failover.attempts"] = self.attempts
        if output_tokens:
            attributes["gen_ai.usage.output_tokens"] = output_tokens
        if input_tokens:
            attributes["gen_ai.usage.input_tokens"] = input_tokens
        span = self.span
        if not span.is_recording():
            span.end()
            return
        span.set_attributes(attributes)
        status = attributes.get("http.response.status_code", 0)
        if status >= 500:  # a server span's error, as HTTP's conventions say (a 4xx is the client's)
            self.tracing.failed(span, str(status))
        self._end_attempt()
        span.end()

    def _end_attempt(self) -> None:
        if self.attempt_span is not None:
            self.attempt_span.end()
            self.attempt_span = None
