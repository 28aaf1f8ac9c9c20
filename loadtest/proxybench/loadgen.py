"""A closed-loop HTTP load generator cheap enough to share two cores with the proxy it measures.

C workers each hold one keep-alive connection and send the same chat completion request back to back,
for a duration (after a warm-up) or for a fixed number of requests. With --ramp the workers start one
after another instead of all at once: long requests started together stay in lock-step (they end
together and restart together), a burst pattern no real population of clients produces. The client is a
bare asyncio protocol on httptools and uvloop: a general-purpose client would spend more CPU per request
than the proxies under test do. Prints one JSON object: req/s, p50/p99 latency and time to first body
chunk (ms), errors by kind, and `sent == ok + errors` over the whole run so no request goes unaccounted.
With --cpu-pid it also reports the CPU that process's tree spent in the window (`proxybench.cpu`), per request:
the window's edges are known here, nowhere else. Several generators (a host whose load needs more than one core)
share one window through --start-at and --samples, and `merge` makes their reports one.

    python -m crossover.loadtest.proxybench.loadgen --url http://127.0.0.1:8000 --concurrency 32 --stream --duration 5
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import httptools
import uvloop

from crossover.gateway.cli import non_negative_float, positive_float, positive_int
from crossover.loadtest.percentile import percentiles
from crossover.loadtest.proxybench.cores import format_cpu_list
from crossover.loadtest.proxybench.cpu import tree_cpu_seconds

DEFAULT_MAX_TOKENS = 64
DEFAULT_MODEL = "zero"  # the zero backend's; a gateway that knows its models refuses any other
DEFAULT_REQUEST_TIMEOUT_S = 60.0
DEFAULT_CONNECT_TIMEOUT_S = 10.0
PATH = "/v1/chat/completions"
DONE_MARK = b"data: [DONE]"


class RequestFailed(Exception):
    """A request that did not end in a complete 200 response; `kind` names the failure for the report."""

    def __init__(self, kind: str) -> None:
        super().__init__(kind)
        self.kind = kind


class Connection(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection carrying one request at a time."""

    def __init__(self, loop: asyncio.AbstractEventLoop, stream: bool) -> None:
        self.loop = loop
        self.stream = stream
        self.parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.waiter: asyncio.Future | None = None
        self.first_chunk_at = 0.0
        self.tail = b""
        self.reusable = True

    def send(self, request: bytes) -> asyncio.Future:
        assert self.transport is not None
        self.waiter = self.loop.create_future()
        self.first_chunk_at = 0.0
        self.tail = b""
        self.transport.write(request)
        return self.waiter

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        transport.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self.fail("bad http")

    def connection_lost(self, exc: Exception | None) -> None:
        self.reusable = False
        self.fail("connection lost")

    def on_body(self, body: bytes) -> None:
        if not self.first_chunk_at:
            self.first_chunk_at = time.perf_counter()
        # Only the end matters for completeness; keep enough of it to see a marker split across reads.
        self.tail = (self.tail + body)[-64:]

    def on_message_complete(self) -> None:
        self.reusable = self.parser.should_keep_alive()
        status = self.parser.get_status_code()
        waiter, self.waiter = self.waiter, None
        if waiter is None or waiter.done():
            return
        if status != 200:
            waiter.set_exception(RequestFailed(f"http {status}"))
        elif self.stream and DONE_MARK not in self.tail:
            waiter.set_exception(RequestFailed("stream without [DONE]"))
        else:
            waiter.set_result(self.first_chunk_at)

    def fail(self, kind: str) -> None:
        """End the request in flight (if any) as failed, and drop the connection."""
        waiter, self.waiter = self.waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_exception(RequestFailed(kind))
        if self.transport is not None:
            self.transport.close()


@dataclass
class Tally:
    """Counts over the whole run, and (start, first chunk, end) of every successful request."""

    sent: int = 0
    ok: int = 0
    errors: Counter = field(default_factory=Counter)
    window_errors: int = 0
    done: list[tuple[float, float, float]] = field(default_factory=list)

    def rate(self, start: float, end: float) -> float:
        """Requests per second in [start, end], each request counted by the share of it inside the window.

        Counting whole completions instead would be biased when requests are long and synchronised:
        C streams of 1.3 s that start together finish in waves, and a window holds 7 or 8 waves.
        """
        share = 0.0
        for t0, _, t1 in self.done:
            overlap = min(t1, end) - max(t0, start)
            if overlap > 0:
                share += overlap / (t1 - t0)
        return share / (end - start)


@dataclass
class LoadSpec:
    url: str
    concurrency: int
    stream: bool
    max_tokens: int = DEFAULT_MAX_TOKENS
    duration: float = 5.0
    warmup: float = 1.0
    requests: int | None = None  # a fixed count instead of a timed window
    timeout: float = DEFAULT_REQUEST_TIMEOUT_S
    ramp: float = 0.0  # worker i sends its first request at i/C of this (seconds)
    cpu_pid: int | None = None  # the process whose tree's CPU time is measured over the window
    model: str = DEFAULT_MODEL
    # When to start, on time.monotonic()'s clock (shared by every process on the host): several load generators
    # given one start measure one window. None: now.
    start_at: float | None = None
    samples: bool = False  # also report every measured request's latency and time to first chunk (seconds)


def build_request(spec: LoadSpec) -> bytes:
    parts = urlsplit(spec.url)
    body = json.dumps(
        {
            "model": spec.model,
            "messages": [{"role": "user", "content": "Say something."}],
            "max_tokens": spec.max_tokens,
            "stream": spec.stream,
        }
    ).encode()
    head = (
        f"POST {parts.path.rstrip('/')}{PATH} HTTP/1.1\r\nHost: {parts.netloc}\r\n"
        f"Content-Type: application/json\r\nAccept: */*\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


def _p50_p99_ms(values: list[float]) -> tuple[float | None, float | None]:
    if not values:
        return None, None
    p50, p99 = percentiles(values, (50, 99))
    return round(p50 * 1000.0, 3), round(p99 * 1000.0, 3)


async def run_load(spec: LoadSpec) -> dict:
    """Drive `spec` and return the report dict (see module docstring)."""
    loop = asyncio.get_running_loop()
    parts = urlsplit(spec.url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    request = build_request(spec)
    tally = Tally()
    start = time.perf_counter()
    if spec.start_at is not None:
        start += max(spec.start_at - time.monotonic(), 0.0)
        await asyncio.sleep(start - time.perf_counter())
    window_start = start if spec.requests is not None else start + spec.warmup
    window_end = float("inf") if spec.requests is not None else window_start + spec.duration
    remaining = [spec.requests] if spec.requests is not None else None
    cpu: list[float] = []

    def sample_cpu() -> None:
        if spec.cpu_pid is not None:
            cpu.append(tree_cpu_seconds(spec.cpu_pid))

    async def sample_window() -> None:
        await asyncio.sleep(window_start - time.perf_counter())
        sample_cpu()
        await asyncio.sleep(window_end - time.perf_counter())
        sample_cpu()

    async def worker(index: int) -> None:
        if spec.ramp > 0:
            await asyncio.sleep(spec.ramp * index / spec.concurrency)
        conn: Connection | None = None
        while True:
            if remaining is not None:
                if remaining[0] <= 0:
                    break
                remaining[0] -= 1
            elif time.perf_counter() >= window_end:
                break
            tally.sent += 1
            t0 = time.perf_counter()
            timer = None
            try:
                if conn is None or not conn.reusable:
                    _, conn = await asyncio.wait_for(
                        loop.create_connection(lambda: Connection(loop, spec.stream), host, port),
                        DEFAULT_CONNECT_TIMEOUT_S,
                    )
                waiter = conn.send(request)
                timer = loop.call_later(spec.timeout, conn.fail, "timeout")
                first = await waiter
            except (TimeoutError, RequestFailed, OSError) as exc:
                tally.errors[getattr(exc, "kind", type(exc).__name__)] += 1
                if window_start <= time.perf_counter() <= window_end:
                    tally.window_errors += 1
                if conn is not None:
                    conn.fail("closed")  # never reuse a connection that saw a failure
                conn = None
                continue
            finally:
                if timer is not None:
                    timer.cancel()
            t1 = time.perf_counter()
            tally.ok += 1
            tally.done.append((t0, first, t1))
        if conn is not None and conn.transport is not None:
            conn.transport.close()

    if spec.requests is None:
        sampler = asyncio.create_task(sample_window())
    else:
        sample_cpu()
    await asyncio.gather(*(worker(i) for i in range(spec.concurrency)))
    if spec.requests is not None:
        window_end = time.perf_counter()
        sample_cpu()
    else:
        await sampler
    # Latency samples: the requests that completed inside the window.
    measured = [(t0, first, t1) for t0, first, t1 in tally.done if window_start <= t1 <= window_end]
    latency_p50, latency_p99 = _p50_p99_ms([t1 - t0 for t0, _, t1 in measured])
    ttfc_p50, ttfc_p99 = _p50_p99_ms([first - t0 for t0, first, _ in measured])
    rate = tally.rate(window_start, window_end)
    # The window's CPU over the requests inside it, each counted by its share in the window (as the rate is).
    requests_in_window = rate * (window_end - window_start)
    cpu_s = cpu[1] - cpu[0] if len(cpu) == 2 else None
    cpu_ms = round(cpu_s * 1000.0 / requests_in_window, 4) if cpu_s is not None and requests_in_window else None
    report = {
        "url": spec.url,
        "concurrency": spec.concurrency,
        "stream": spec.stream,
        "max_tokens": spec.max_tokens,
        "window_s": round(window_end - window_start, 3),
        "completed": len(measured),
        "rps": round(rate, 1),
        "latency_p50_ms": latency_p50,
        "latency_p99_ms": latency_p99,
        "ttfc_p50_ms": ttfc_p50,
        "ttfc_p99_ms": ttfc_p99,
        "sent": tally.sent,
        "ok": tally.ok,
        "errors": sum(tally.errors.values()),
        "window_errors": tally.window_errors,
        "error_kinds": dict(tally.errors),
        "cpu_s": None if cpu_s is None else round(cpu_s, 3),
        "cpu_ms_per_request": cpu_ms,
        "load_cores": [format_cpu_list(frozenset(os.sched_getaffinity(0)))],  # where this generator ran
    }
    if spec.samples:
        report["latency_s"] = [round(t1 - t0, 6) for t0, _, t1 in measured]
        report["ttfc_s"] = [round(first - t0, 6) for t0, first, _ in measured]
    return report


def merge(reports: list[dict]) -> dict:
    """Several generators' reports of one window (one `start_at`, each with `samples`) as one: counts and rates
    summed, percentiles over the pooled samples, CPU per request from the one that measured CPU over all of them."""
    merged = {key: value for key, value in reports[0].items() if key not in ("latency_s", "ttfc_s")}
    for key in ("concurrency", "completed", "sent", "ok", "errors", "window_errors"):
        merged[key] = sum(report[key] for report in reports)
    merged["rps"] = round(sum(report["rps"] for report in reports), 1)
    kinds: Counter = Counter()
    for report in reports:
        kinds.update(report["error_kinds"])
    merged["error_kinds"] = dict(kinds)
    latency = [value for report in reports for value in report["latency_s"]]
    ttfc = [value for report in reports for value in report["ttfc_s"]]
    merged["latency_p50_ms"], merged["latency_p99_ms"] = _p50_p99_ms(latency)
    merged["ttfc_p50_ms"], merged["ttfc_p99_ms"] = _p50_p99_ms(ttfc)
    cpu_s = next((report["cpu_s"] for report in reports if report["cpu_s"] is not None), None)
    requests_in_window = merged["rps"] * merged["window_s"]
    merged["cpu_s"] = cpu_s
    merged["cpu_ms_per_request"] = (
        round(cpu_s * 1000.0 / requests_in_window, 4) if cpu_s is not None and requests_in_window else None
    )
    merged["processes"] = len(reports)
    merged["load_cores"] = [cores for report in reports for cores in report["load_cores"]]
    return merged


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m crossover.loadtest.proxybench.loadgen", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--url", required=True, help="base URL, e.g. http://127.0.0.1:8000")
    parser.add_argument("--concurrency", type=positive_int, default=1)
    parser.add_argument("--stream", action="store_true")
    parser.add_argument("--max-tokens", type=positive_int, default=DEFAULT_MAX_TOKENS, help="chunks per stream")
    parser.add_argument("--duration", type=positive_float, default=5.0, help="measured seconds")
    parser.add_argument("--warmup", type=non_negative_float, default=1.0, help="unmeasured seconds first")
    parser.add_argument("--requests", type=positive_int, help="send exactly this many instead (no warm-up)")
    parser.add_argument("--timeout", type=positive_float, default=DEFAULT_REQUEST_TIMEOUT_S, help="per request")
    parser.add_argument(
        "--ramp",
        type=non_negative_float,
        default=0.0,
        help="spread the workers' first requests evenly over this many seconds",
    )
    parser.add_argument("--cpu-pid", type=positive_int, help="report this process tree's CPU time per request")
    parser.add_argument("--model", default=DEFAULT_MODEL, help="the request's model (default: %(default)s)")
    parser.add_argument(
        "--start-at", type=float, help="start at this time.monotonic() value (several generators, one window)"
    )
    parser.add_argument("--samples", action="store_true", help="report each measured request's latency and TTFC")
    args = parser.parse_args(argv)
    spec = LoadSpec(
        args.url,
        args.concurrency,
        args.stream,
        args.max_tokens,
        args.duration,
        args.warmup,
        args.requests,
        args.timeout,
        args.ramp,
        args.cpu_pid,
        args.model,
        args.start_at,
        args.samples,
    )
    json.dump(uvloop.run(run_load(spec)), sys.stdout)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
