"""The zero-delay backend in its own process for a test: `with running_zero(ports=2) as urls: ...`."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx

READY_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 10.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def running_zero(*extra: str, ports: int = 1) -> Iterator[list[str]]:
    """Start `python -m loadtest.zerobackend` on `ports` fresh ports; yield their URLs; always stop it."""
    chosen = [free_port() for _ in range(ports)]
    argv = [sys.executable, "-m", "loadtest.zerobackend", *extra]
    for port in chosen:
        argv += ["--port", str(port)]
    proc = subprocess.Popen(argv, start_new_session=True)
    urls = [f"http://127.0.0.1:{port}" for port in chosen]
    try:
        deadline = time.monotonic() + READY_TIMEOUT_S
        for url in urls:
            while True:  # polling is the readiness wait
                assert proc.poll() is None, f"zerobackend exited with {proc.returncode}"
                assert time.monotonic() < deadline, f"{url} not ready after {READY_TIMEOUT_S} s"
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(url + "/health", timeout=2).status_code == 200:
                        break
                time.sleep(0.05)
        yield urls
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(STOP_TIMEOUT_S)
