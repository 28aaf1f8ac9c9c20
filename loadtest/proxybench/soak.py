"""A memory soak: does the gateway's RSS stay flat under mixed traffic, in every worker?

    python -m crossover.loadtest.proxybench.soak --minutes 30 --workers 2

It starts the zero backend (two ports, one per pool; streamed tokens `--chunk-delay-ms` apart) and
`crossover serve --workers N` in front of it, then sends `--rate` requests a second, in turn of `KINDS`: whole and
streamed answers, streams the client drops mid-answer or before any answer, malformed JSON, bodies that fail
validation, an unknown model, and malformed bodies followed by a good request on one keep-alive connection. Every
`--sample-s` it reads each worker's RSS (VmRSS from /proc; the workers are the supervisor's children) and prints a
line. At the end it prints each worker's RSS at `--baseline-minutes` (the first sample from then on), at the end, and
the difference, and exits 1 if any worker grew by more than `--tolerance-mb` after the baseline, or was replaced.

Issue 39 measured 45.9 -> 58.2 MB per worker over 15 minutes of such traffic, still rising: every backend connection
an aborted stream closed stayed in memory until the cyclic collector ran (gateway/wire/http1.py's `unhook`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import socket
import struct
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

from crossover.gateway.cli import positive_float, positive_int
from crossover.loadtest.proxybench.cpu import tree_pids
from crossover.loadtest.proxybench.harness import (
    HOST,
    REPO_ROOT,
    STOP_TIMEOUT_S,
    crossover_argv,
    spawn,
    wait_serving,
    zerobackend_argv,
)
from crossover.servers import process

MODEL = "zero"  # the zero backend's
# A stream meant to be cut by its client: far longer than any soak (the zero backend's own cap).
ENDLESS = 100_000
DEFAULT_MINUTES = 30.0
DEFAULT_BASELINE_MINUTES = 5.0
DEFAULT_TOLERANCE_MB = 5.0
DEFAULT_RATE = 20.0  # requests a second: the growth showed at ~10
DEFAULT_CONCURRENCY = 8
DEFAULT_SAMPLE_S = 30.0
DEFAULT_CHUNK_DELAY_MS = 20.0
IO_TIMEOUT_S = 30.0
READY_TIMEOUT_S = 60.0
KIB = 1024
MIB = 1024 * KIB


def chat(stream: bool, max_tokens: int = 8, **extra) -> bytes:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": max_tokens}
    return json.dumps({**body, "stream": stream, **extra}).encode()


def post(body: bytes, close: bool = True) -> bytes:
    connection = b"connection: close\r\n" if close else b""
    return (
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: soak\r\ncontent-type: application/json\r\n%s"
        b"content-length: %d\r\n\r\n%s" % (connection, len(body), body)
    )


def status_of(answer: bytes) -> int:
    """The status code of a response that starts `answer` (0 if there is none)."""
    line = answer.partition(b"\r\n")[0].split()
    return int(line[1]) if len(line) > 1 and line[1].isdigit() else 0


async def read_response(reader: asyncio.StreamReader) -> int:
    """One response with a Content-Length, read whole from a keep-alive connection: its status."""
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    await reader.readexactly(length)
    return status_of(head)


Connection = tuple[asyncio.StreamReader, asyncio.StreamWriter]


async def whole(conn: Connection, body: bytes) -> int:
    reader, writer = conn
    writer.write(post(body))
    return status_of(await reader.read())  # the gateway closes the connection once the answer is out


async def good(conn: Connection) -> int:
    return await whole(conn, chat(False))


async def good_stream(conn: Connection) -> int:
    return await whole(conn, chat(True))


async def aborted_stream(conn: Connection) -> int:
    """A stream dropped by its client once its first tokens are in."""
    reader, writer = conn
    writer.write(post(chat(True, ENDLESS)))
    received = b""
    while received.count(b"data:") < 2:
        piece = await reader.read(65536)
        if not piece:
            break
        received += piece
    return status_of(received)


async def abandoned(conn: Connection) -> int:
    """A stream whose client leaves as soon as it has asked: the gateway may still be opening the backend's."""
    conn[1].write(post(chat(True, ENDLESS)))
    return 0


async def malformed_json(conn: Connection) -> int:
    return await whole(conn, b'{"model": "zero", "messages": [')


async def invalid_fields(conn: Connection) -> int:
    return await whole(conn, json.dumps({"model": MODEL, "messages": "none", "max_tokens": -3}).encode())


async def unknown_model(conn: Connection) -> int:
    return await whole(conn, chat(False, model="no-such-model"))


async def keepalive_malformed(conn: Connection) -> int:
    """Malformed bodies, then a good request, on one keep-alive connection: the last one's status."""
    reader, writer = conn
    for _ in range(2):
        writer.write(post(b"\xff not json", close=False))
        await read_response(reader)
    writer.write(post(chat(False), close=False))
    return await read_response(reader)


Kind = Callable[[Connection], Awaitable[int]]
# Each kind with the status it expects (0: none is read).
KINDS: dict[str, tuple[Kind, int]] = {
    "good": (good, 200),
    "good_stream": (good_stream, 200),
    "aborted_stream": (aborted_stream, 200),
    "abandoned": (abandoned, 0),
    "malformed_json": (malformed_json, 400),
    "invalid_fields": (invalid_fields, 400),
    "unknown_model": (unknown_model, 404),
    "keepalive_malformed": (keepalive_malformed, 200),
}
# SO_LINGER on, zero seconds: close() resets the connection, as a killed client does. Every other dropped stream
# ends so; the rest with a FIN.
RESET = struct.pack("ii", 1, 0)


@dataclass
class Traffic:
    sent: Counter = field(default_factory=Counter)
    unexpected: Counter = field(default_factory=Counter)  # (kind, status or error)


async def one(port: int, name: str, n: int, traffic: Traffic) -> None:
    kind, expected = KINDS[name]
    writer = None
    try:
        async with asyncio.timeout(IO_TIMEOUT_S):
            reader, writer = await asyncio.open_connection(HOST, port)
            status = await kind((reader, writer))
        if status != expected:
            traffic.unexpected[name, str(status)] += 1
        if name in ("aborted_stream", "abandoned") and n % 2:
            writer.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, RESET)
    except (OSError, TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError) as exc:
        traffic.unexpected[name, type(exc).__name__] += 1
    finally:
        traffic.sent[name] += 1
        if writer is not None:
            writer.close()


async def drive(port: int, rate: float, concurrency: int, until: float, traffic: Traffic) -> None:
    """`rate` requests a second, in turn of KINDS, at most `concurrency` at once, until `until` (monotonic)."""
    names = list(KINDS)
    slots = asyncio.Semaphore(concurrency)
    running: set[asyncio.Task] = set()
    start = time.monotonic()
    n = 0
    while time.monotonic() < until:
        await asyncio.sleep(max(0.0, start + n / rate - time.monotonic()))
        await slots.acquire()
        task = asyncio.create_task(one(port, names[n % len(names)], n, traffic))
        running.add(task)
        task.add_done_callback(lambda done: (running.discard(done), slots.release()))
        n += 1
    await asyncio.gather(*running)


def rss_bytes(pid: int) -> int | None:
    """VmRSS of `pid`, or None once it has gone."""
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * KIB
    return None


def workers_of(supervisor: int) -> list[int]:
    return sorted(pid for pid in tree_pids(supervisor) if pid != supervisor)


@dataclass(frozen=True)
class Verdict:
    """Each worker's RSS at the baseline and at the end (bytes), and whether any grew past the tolerance."""

    baseline: dict[int, int]
    end: dict[int, int]
    tolerance: int

    @property
    def grown(self) -> dict[int, int]:
        return {pid: self.end[pid] - self.baseline[pid] for pid in self.baseline if pid in self.end}

    @property
    def replaced(self) -> bool:
        return set(self.baseline) != set(self.end)

    @property
    def passed(self) -> bool:
        return bool(self.baseline) and not self.replaced and all(g <= self.tolerance for g in self.grown.values())


def judge(samples: list[tuple[float, dict[int, int]]], baseline_s: float, tolerance: int) -> Verdict:
    """From (seconds since the start, {worker: RSS}) samples: the first at or after `baseline_s` against the last."""
    later = [rss for at, rss in samples if at >= baseline_s]
    return Verdict(later[0] if later else {}, samples[-1][1] if samples else {}, tolerance)


def report(verdict: Verdict, baseline_minutes: float, minutes: float) -> str:
    lines = [f"{'worker':>8} {f'RSS at {baseline_minutes:g} min':>16} {f'RSS at {minutes:g} min':>16} {'grew':>9}"]
    for pid in sorted(verdict.baseline):
        end = verdict.end.get(pid)
        grew = "gone" if end is None else f"{(end - verdict.baseline[pid]) / MIB:+.2f} MB"
        at_end = "gone" if end is None else f"{end / MIB:.2f} MB"
        lines.append(f"{pid:>8} {verdict.baseline[pid] / MIB:>13.2f} MB {at_end:>16} {grew:>9}")
    for pid in sorted(set(verdict.end) - set(verdict.baseline)):
        lines.append(f"{pid:>8} {'(replacement)':>16} {verdict.end[pid] / MIB:>13.2f} MB")
    limit = f"{verdict.tolerance / MIB:g} MB"
    lines.append(
        f"PASS: no worker grew more than {limit} after minute {baseline_minutes:g}"
        if verdict.passed
        else f"FAIL: a worker grew more than {limit} after minute {baseline_minutes:g}, or was replaced"
    )
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m crossover.loadtest.proxybench.soak",
        description="RSS of each gateway worker under mixed traffic (aborted streams, malformed bodies) over time.",
    )
    parser.add_argument("--minutes", type=positive_float, default=DEFAULT_MINUTES, help="how long the traffic runs")
    parser.add_argument(
        "--baseline-minutes",
        type=positive_float,
        default=DEFAULT_BASELINE_MINUTES,
        help="RSS is judged against its value from this minute on",
    )
    parser.add_argument("--workers", type=positive_int, default=2, help="crossover serve --workers N")
    parser.add_argument("--rate", type=positive_float, default=DEFAULT_RATE, help="requests a second")
    parser.add_argument(
        "--concurrency", type=positive_int, default=DEFAULT_CONCURRENCY, help="at most this many at once"
    )
    parser.add_argument("--sample-s", type=positive_float, default=DEFAULT_SAMPLE_S, help="seconds between samples")
    parser.add_argument(
        "--tolerance-mb", type=positive_float, default=DEFAULT_TOLERANCE_MB, help="growth after the baseline allowed"
    )
    parser.add_argument(
        "--chunk-delay-ms", type=positive_float, default=DEFAULT_CHUNK_DELAY_MS, help="the zero backend's token gap"
    )
    args = parser.parse_args(argv)
    if args.baseline_minutes >= args.minutes:
        parser.error(f"--baseline-minutes ({args.baseline_minutes:g}) must be less than --minutes ({args.minutes:g})")
    return args


async def soak(args: argparse.Namespace, port: int, supervisor: int) -> list[tuple[float, dict[int, int]]]:
    traffic = Traffic()
    start = time.monotonic()
    driving = asyncio.create_task(drive(port, args.rate, args.concurrency, start + args.minutes * 60, traffic))
    samples: list[tuple[float, dict[int, int]]] = []
    while True:
        at = time.monotonic() - start
        rss = {pid: size for pid in workers_of(supervisor) if (size := rss_bytes(pid)) is not None}
        samples.append((at, rss))
        sizes = "  ".join(f"{pid}: {size / MIB:.2f} MB" for pid, size in sorted(rss.items()))
        print(f"{at / 60:6.2f} min  {sum(traffic.sent.values()):7d} requests  {sizes}", flush=True)
        if driving.done():
            break
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(driving), args.sample_s)
    await driving
    print("sent: " + ", ".join(f"{name} {traffic.sent[name]}" for name in KINDS))
    if traffic.unexpected:
        print("unexpected: " + ", ".join(f"{kind}: {what} x{n}" for (kind, what), n in traffic.unexpected.items()))
    return samples


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    procs = []
    with tempfile.TemporaryDirectory(prefix="crossover-soak-") as workdir:
        try:
            spec, plain, port = process.free_port(), process.free_port(), process.free_port()
            procs.append(spawn(zerobackend_argv(spec, plain, args.chunk_delay_ms), REPO_ROOT))
            for backend in (spec, plain):
                process.wait_ready(f"http://{HOST}:{backend}/health", procs[-1], READY_TIMEOUT_S)
            config = Path(workdir) / "crossover.toml"
            config.write_text(
                'log_level = "warning"\n'
                f'[pools.speculative]\nbackends = ["http://{HOST}:{spec}"]\n'
                f'[pools.plain]\nbackends = ["http://{HOST}:{plain}"]\n'
            )
            argv_ = crossover_argv(sys.executable, config, port, args.workers)
            procs.append(spawn(argv_, REPO_ROOT))
            wait_serving(f"http://{HOST}:{port}", procs[-1])
            print(f"soak: {' '.join(argv_)}; {args.rate:g} requests/s for {args.minutes:g} min", flush=True)
            samples = asyncio.run(soak(args, port, procs[-1].pid))
        finally:
            process.stop(procs, STOP_TIMEOUT_S)
    verdict = judge(samples, args.baseline_minutes * 60, int(args.tolerance_mb * MIB))
    print(report(verdict, args.baseline_minutes, args.minutes))
    return 0 if verdict.passed else 1


if __name__ == "__main__":
    sys.exit(main())
