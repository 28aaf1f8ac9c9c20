"""The zero-delay backend in its own process for a test: `with running_zero(ports=2) as urls: ...`."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

from crossover.servers.process import free_port, spawn, stop, wait_ready

READY_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 10.0


@contextlib.contextmanager
def running_zero(*extra: str, ports: int = 1) -> Iterator[list[str]]:
    """Start the zero backend (proxybench.zerobackend) on `ports` fresh ports; yield their URLs; always stop it."""
    chosen = [free_port() for _ in range(ports)]
    argv = [sys.executable, "-m", "crossover.loadtest.proxybench.zerobackend", *extra]
    for port in chosen:
        argv += ["--port", str(port)]
    # pytest may run uvicorn threads, so no preexec_fn: the `finally` stops it.
    proc = spawn(argv, die_with_parent=False)
    urls = [f"http://127.0.0.1:{port}" for port in chosen]
    try:
        for url in urls:
            wait_ready(url + "/health", proc, READY_TIMEOUT_S)
        yield urls
    finally:
        stop([proc], STOP_TIMEOUT_S)
