"""Child processes that never outlive their parent, and readiness waits for the servers they run.

    proc = spawn([sys.executable, "-m", "crossover.gateway.cli", "sim", "serve", "--port", str(port), ...])
    wait_ready(f"http://127.0.0.1:{port}/health", proc)
    ...
    stop([proc])

Each child leads its own process group, so `stop` reaches whatever it forked (SGLang's workers hold GPU
memory if they survive). With `die_with_parent` the kernel also SIGTERMs it when the parent dies, even by
SIGKILL (Linux). That needs a preexec_fn, which is unsafe while the parent runs threads: pass False there.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Collection, Sequence

import httpx

LOOPBACK = "127.0.0.1"
READY_POLL_S = 0.05
STOP_TIMEOUT_S = 10.0
_PR_SET_PDEATHSIG = 1


class NotReady(RuntimeError):
    """A child exited, or did not answer 200, before its deadline."""


_EPHEMERAL_RANGE = "/proc/sys/net/ipv4/ip_local_port_range"
_LISTEN_SPAN = 12_000


def _listen_ports() -> range | None:
    """Ports below the kernel's ephemeral range: no outgoing connection is ever given one of them.

    A port the kernel hands out for `bind(0)` comes from the ephemeral range, which every client socket on the
    host draws its source port from too: between choosing it and the server binding it, a connection may take it
    (CI saw `address already in use` that way). None where the range cannot be read or leaves no room below.
    """
    try:
        with open(_EPHEMERAL_RANGE) as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    if low - 1024 < 1024:
        return None
    return range(max(1024, low - _LISTEN_SPAN), low)


def free_port(host: str = LOOPBACK) -> int:
    """A port nothing listens on now, outside the range client sockets draw from where the host allows it."""
    ports = _listen_ports()
    for port in random.sample(ports, 64) if ports else ():
        with socket.socket() as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def _die_with(parent: int, affinity: Collection[int] | None = None):
    def setup() -> None:
        if affinity is not None:  # before exec, so every thread and child the program starts inherits it
            os.sched_setaffinity(0, affinity)
        if sys.platform.startswith("linux"):
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:  # the parent died before prctl took effect
            os._exit(1)

    return setup


def spawn(
    argv: Sequence[str], *, die_with_parent: bool = True, affinity: Collection[int] | None = None, **popen
) -> subprocess.Popen:
    """`argv` in a session of its own; `affinity`: the CPU cores it (and all it starts) may run on."""
    if die_with_parent:
        preexec = _die_with(os.getpid(), affinity)
    else:
        preexec = None if affinity is None else lambda: os.sched_setaffinity(0, affinity)
    return subprocess.Popen(list(argv), start_new_session=True, preexec_fn=preexec, **popen)  # noqa: PLW1509


def stop(procs: Sequence[subprocess.Popen], timeout: float = STOP_TIMEOUT_S) -> None:
    """SIGTERM every child's process group, then SIGKILL what is still there after `timeout`."""
    for proc in procs:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for proc in procs:
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout)


def wait_ready(url: str, proc: subprocess.Popen | None, timeout: float, *, json: dict | None = None) -> None:
    """Poll `url` (GET, or POST `json`) until it answers 200; fail at once if `proc` exits first."""
    deadline = time.monotonic() + timeout
    with httpx.Client(timeout=5.0, trust_env=False) as client:
        while time.monotonic() < deadline:
            if proc is not None and proc.poll() is not None:
                raise NotReady(f"the process for {url} exited with code {proc.returncode} before it was ready")
            with contextlib.suppress(httpx.HTTPError):
                response = client.get(url) if json is None else client.post(url, json=json)
                if response.status_code == 200:
                    return
            time.sleep(READY_POLL_S)
    raise NotReady(f"{url} did not answer 200 within {timeout:g} s")
