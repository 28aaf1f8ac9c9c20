"""Process and port helpers for tests that start real servers (importable as `procs`: tests/ is on sys.path)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time

import httpx

READY_TIMEOUT_S = 60.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def crossover_argv(*args: str) -> list[str]:
    """argv that runs the `crossover` CLI with this interpreter (no reliance on PATH)."""
    return [sys.executable, "-m", "gateway.cli", *args]


def wait_ready(url: str, proc: subprocess.Popen | None = None, timeout: float = READY_TIMEOUT_S) -> None:
    """Poll `url` until it answers 200; fail early if `proc` dies. Polling is the readiness wait, not a sleep."""
    deadline = time.monotonic() + timeout
    with httpx.Client(timeout=2.0) as client:
        while time.monotonic() < deadline:
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"process exited with {proc.returncode} before {url} was ready")
            with contextlib.suppress(httpx.HTTPError):
                if client.get(url).status_code == 200:
                    return
            time.sleep(0.05)
    raise TimeoutError(f"{url} not ready after {timeout} s")


def stop_process_group(proc: subprocess.Popen, grace: float = 10.0) -> None:
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(grace)
