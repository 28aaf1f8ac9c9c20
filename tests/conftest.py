"""Shared fixtures: real servers on 127.0.0.1, started and always stopped by the test that needs them.

- `sim`:     factory for SGLang stand-ins in their own process (`crossover sim serve ...`),
             ready once `/health` answers 200, killed with their whole process group afterwards.
- `serve`:   factory for an ASGI app on a real uvicorn server in a thread of this process, ready once
             uvicorn says it started, shut down afterwards.

Every test that starts a live stand-in or reads a wall clock is marked `timing` (tests/timing.py says which);
`python -m tests.busy` runs them beside CPU burners. A run ends with one line naming what its skips left
unchecked and why.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass

import pytest
import uvicorn

from crossover.servers.process import free_port, spawn, stop, wait_ready
from tests.timing import involves_time

READY_TIMEOUT_S = 60.0


def missing_environment(message: str) -> None:
    """A test whose environment (a venv .ci/run builds) is not there: a check that silently did not run proves
    nothing, so under CI (CI=true) it fails, elsewhere it skips."""
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(message)
    pytest.skip(message)


def crossover_argv(*args: str) -> list[str]:
    """argv that runs the `crossover` CLI with this interpreter (no reliance on PATH)."""
    return [sys.executable, "-m", "crossover.gateway.cli", *args]


@dataclass
class SimServer:
    url: str
    port: int
    proc: subprocess.Popen

    def kill(self) -> None:
        """Hard-kill the stand-in (a backend dying mid-test)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)


@pytest.fixture
def sim():
    """Start SGLang stand-ins: `sim("k25-eagle3", "--time-scale", "50")` -> SimServer (ready)."""
    started: list[subprocess.Popen] = []

    def start(profile: str, *extra: str, port: int | None = None, wait: bool = True) -> SimServer:
        port = port or free_port()
        # pytest runs uvicorn threads (`serve`), so no preexec_fn: the finalizer below stops every stand-in.
        proc = spawn(
            # No emulated weight loading unless a test asks for it (a later --startup-delay in `extra` wins):
            # the k25 profiles' startup_s is minutes of profile time.
            crossover_argv("sim", "serve", "--profile", profile, "--port", str(port), "--startup-delay", "0", *extra),
            die_with_parent=False,
        )
        started.append(proc)
        url = f"http://127.0.0.1:{port}"
        if wait:
            wait_ready(f"{url}/health", proc, READY_TIMEOUT_S)
        return SimServer(url=url, port=port, proc=proc)

    yield start
    stop(started)


@dataclass
class ThreadServer:
    url: str
    port: int
    server: uvicorn.Server


@pytest.fixture
def serve():
    """Run ASGI apps on real uvicorn in threads: `serve(app)` -> ThreadServer (started)."""
    running: list[tuple[uvicorn.Server, threading.Thread]] = []

    def start(app, port: int | None = None, **config) -> ThreadServer:
        # The socket is bound here, before uvicorn starts, so no other process can take the port in between.
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", port or free_port()))
        port = sock.getsockname()[1]
        server = uvicorn.Server(
            uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on", **config)
        )
        thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
        thread.start()
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.01)
        running.append((server, thread))
        return ThreadServer(url=f"http://127.0.0.1:{port}", port=port, server=server)

    yield start
    for server, thread in running:
        server.should_exit = True
        thread.join(30)


# `pytest -n auto` hands out tests one by one (xdist's --dist load). The real-engine tests share engines that
# take minutes to start (tests/real_sglang/conftest.py, tests/real_vllm/conftest.py), so each folder goes to one
# worker as one unit, in its order; every other test is its own unit, handed out as before. (xdist's own --dist
# loadgroup cannot do it under pytest 9.2: it renames items through `_nodeid`, which pytest no longer reads.)
REAL_ENGINE_TESTS = ("tests/real_sglang/", "tests/real_vllm/")


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") != "load":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class RealEnginesTogether(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return next((folder for folder in REAL_ENGINE_TESTS if nodeid.startswith(folder)), nodeid)

    return RealEnginesTogether(config, log)


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "timing: starts a live stand-in or reads a wall clock (tests/timing.py finds them; tests.busy runs them)",
    )


def pytest_collection_modifyitems(items):
    for item in items:
        if involves_time(item):
            item.add_marker(pytest.mark.timing)


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_terminal_summary(terminalreporter):
    """One line after pytest's own summary: what the skipped tests left unchecked, and why (reasons, counted)."""
    yield
    skipped = terminalreporter.stats.get("skipped", [])
    reasons = Counter(skip_reason(report) for report in skipped)
    if reasons:
        listed = "; ".join(f"{reason} ({count})" for reason, count in reasons.most_common())
        terminalreporter.write_line(f"not checked: {len(skipped)} skipped - {listed}", yellow=True, bold=True)


SKIP_REASON_CHARS = 100


def skip_reason(report) -> str:
    """A skip's reason, its first clause (pytest's longrepr for a skip is (path, line, "Skipped: reason"))."""
    longrepr = report.longrepr
    reason = (longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)).removeprefix("Skipped: ")
    reason = reason.split("; ")[0]
    return reason if len(reason) <= SKIP_REASON_CHARS else reason[: SKIP_REASON_CHARS - 3] + "..."
