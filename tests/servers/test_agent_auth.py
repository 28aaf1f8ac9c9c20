"""The GPU-host agent cannot be talked past: its token check is on the routes, not on a URL the client shapes
(the Host-header trick, `?`/`#`/`//`/encoded paths), and 15+ other ways to send a wrong or partial token get
401 and start nothing; request heads are bounded in size and time with memory flat; the token never reaches
the servers it starts and a blank one is refused at start-up. Run against the agent as a process."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from crossover.servers.agent import HEAD_TIMEOUT_S
from crossover.servers.process import free_port
from tests.conftest import crossover_argv
from tests.gateway.wire.test_client_http import READ_S, connect, flood_with_unterminated_heads, response_of
from tests.servers.conftest import TOKEN
from tests.servers.test_agent import recorded_groups_of, run_agent_without_a_usable_token

# Raw requests: what a client that means harm sends (httpx would normalise most of these away).
START = "POST /servers/plain/start HTTP/1.1\r\n"


def raw(port: int, request: str) -> int:
    line, _, rest = request.partition("\r\n")
    with connect(port) as sock:  # closed after the answer: response_of waits for the close
        sock.sendall(f"{line}\r\nConnection: close\r\n{rest}".encode("latin-1"))
        status, _, _ = response_of(sock)
    return status


VARIANTS = {
    # The Host-header trick: Starlette < 1.0.1 built request.url (and its path) from the Host header.
    "host with a path and ?": f"{START}Host: x/health?\r\nContent-Length: 0\r\n\r\n",
    "host with a path and #": f"{START}Host: x/metrics#\r\nContent-Length: 0\r\n\r\n",
    "host that is a URL": f"{START}Host: http://x/health?a=\r\nContent-Length: 0\r\n\r\n",
    "absolute-form target": (
        "POST http://x/health?/servers/plain/start HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n"
    ),
    "no token": f"{START}Host: x\r\nContent-Length: 0\r\n\r\n",
    "wrong token": f"{START}Host: x\r\nAuthorization: Bearer wrong\r\nContent-Length: 0\r\n\r\n",
    "token with a suffix": f"{START}Host: x\r\nAuthorization: Bearer {TOKEN}x\r\nContent-Length: 0\r\n\r\n",
    "token prefix": f"{START}Host: x\r\nAuthorization: Bearer {TOKEN[:-1]}\r\nContent-Length: 0\r\n\r\n",
    "empty bearer": f"{START}Host: x\r\nAuthorization: Bearer \r\nContent-Length: 0\r\n\r\n",
    "scheme only": f"{START}Host: x\r\nAuthorization: Bearer\r\nContent-Length: 0\r\n\r\n",
    "token without a scheme": f"{START}Host: x\r\nAuthorization: {TOKEN}\r\nContent-Length: 0\r\n\r\n",
    "basic scheme": f"{START}Host: x\r\nAuthorization: Basic {TOKEN}\r\nContent-Length: 0\r\n\r\n",
    "two spaces": f"{START}Host: x\r\nAuthorization: Bearer  {TOKEN}\r\nContent-Length: 0\r\n\r\n",
    "trailing space inside": f"{START}Host: x\r\nAuthorization: Bearer {TOKEN} x\r\nContent-Length: 0\r\n\r\n",
    "token in the query": f"POST /servers/plain/start?token={TOKEN} HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n",
    "token in another header": f"{START}Host: x\r\nX-Token: {TOKEN}\r\nContent-Length: 0\r\n\r\n",
    "token in a cookie": f"{START}Host: x\r\nCookie: token={TOKEN}\r\nContent-Length: 0\r\n\r\n",
    "a wrong and a right header": (
        f"{START}Host: x\r\nAuthorization: Bearer wrong\r\nAuthorization: Bearer {TOKEN}\r\nContent-Length: 0\r\n\r\n"
    ),
    "double slash": "POST //servers/plain/start HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n",
    "encoded slash": "POST /servers%2Fplain/start HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n",
    "path with health prefix": "POST /health/../servers/plain/start HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n",
    "list with a forged host": "GET /servers HTTP/1.1\r\nHost: x/health?\r\n\r\n",
    "status with a forged host": "GET /servers/plain HTTP/1.1\r\nHost: x/metrics?\r\n\r\n",
}


def test_no_url_a_client_shapes_and_no_partial_token_gets_past_the_agent(standin_profile, start_agent):
    agent = start_agent(standin_profile("standin-time-shared"))
    port = int(agent.url.rsplit(":", 1)[1])
    assert len(VARIANTS) >= 16
    statuses = {name: raw(port, request) for name, request in VARIANTS.items()}
    # 401 wherever a protected route was reached; a refusal of another kind (404, 405) only where the path
    # names no protected route at all. Never a 2xx.
    assert all(400 <= status < 500 for status in statuses.values()), statuses
    elsewhere = {"absolute-form target", "double slash", "encoded slash", "path with health prefix"}
    assert {name for name, status in statuses.items() if status != 401} <= elsewhere, statuses
    assert recorded_groups_of(agent) == {}, "a refused request starts nothing"
    assert agent.client().get("/servers").status_code == 200  # the right token still works


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_an_oversized_head_is_refused_with_memory_flat_and_an_unfinished_one_times_out(
    standin_profile,
    start_agent,
):
    agent = start_agent(standin_profile("standin-time-shared"))
    port = int(agent.url.rsplit(":", 1)[1])
    before = rss_bytes(agent.proc.pid)
    statuses = flood_with_unterminated_heads(port, 20, b"GET /servers HTTP/1.1\r\nHost: x\r\n")
    assert statuses == {431}
    # Unbounded, 20 such heads took the agent from 67 to 253 MB.
    assert rss_bytes(agent.proc.pid) - before < 40 * 1024 * 1024

    with connect(port) as sock:  # a head that never ends: 408 after the head timeout, not an open socket forever
        sock.settimeout(HEAD_TIMEOUT_S + READ_S)  # waiting longer than the agent does: no race with its timer
        sock.sendall(b"GET /servers HTTP/1.1\r\nHost: x\r\n")
        status, body, closed = response_of(sock)
    assert status == 408 and closed, body


@pytest.mark.parametrize("token", ["", "   ", "\t"])
def test_a_blank_token_is_refused_at_start(standin_profile, token):
    result = run_agent_without_a_usable_token(standin_profile, {**os.environ, "CROSSOVER_AGENT_TOKEN": token})
    assert result.returncode == 2, result.stderr
    assert "empty" in result.stderr


def test_the_token_comes_from_a_file_and_never_reaches_the_servers_it_starts(standin_profile, tmp_path, state_dir):
    from crossover.servers.process import spawn, stop, wait_ready

    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    token_file.chmod(0o600)  # the agent refuses a token file others may read
    port = free_port()
    env = {**os.environ, "CROSSOVER_AGENT_TOKEN": "not-this-one"}
    argv = [
        *crossover_argv("servers", "agent", str(standin_profile("standin-time-shared")), "--port", str(port)),
        *("--state-dir", str(state_dir), "--token-file", str(token_file)),
    ]
    proc = spawn(argv, die_with_parent=False, env=env)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_ready(f"{url}/health", proc, 30)
        import httpx

        headers = {"authorization": f"Bearer {TOKEN}"}
        with httpx.Client(base_url=url, headers=headers, timeout=10, trust_env=False) as client:
            assert client.post("/servers/plain/start").status_code == 202
            deadline = time.monotonic() + 60
            while client.get("/servers/plain").json()["state"] != "ready":
                assert time.monotonic() < deadline, client.get("/servers/plain").json()
                time.sleep(0.05)
            pid = client.get("/servers/plain").json()["pid"]
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            assert not [item for item in environ if item.startswith(b"CROSSOVER_AGENT_TOKEN=")]
            client.post("/servers/plain/stop")
            deadline = time.monotonic() + 60
            while client.get("/servers/plain").json()["state"] != "stopped":
                assert time.monotonic() < deadline
                time.sleep(0.05)
    finally:
        stop([proc])


# The releases without the Host-header bypass, and the lowest fastapi that allows them.
FIXED_STARLETTE, FLOOR_FASTAPI = (1, 0, 1), (0, 133)


def floors() -> dict[str, tuple[int, ...]]:
    import re
    import tomllib

    project = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())["project"]
    found = {}
    for requirement in project["dependencies"]:
        match = re.fullmatch(r"(fastapi|starlette)>=([\d.]+)", requirement)
        if match:
            found[match[1]] = tuple(int(part) for part in match[2].split("."))
    return found


def test_no_install_that_pyproject_allows_has_the_host_header_bypass():
    found = floors()
    assert found.get("starlette", ()) >= FIXED_STARLETTE, found
    assert found.get("fastapi", ()) >= FLOOR_FASTAPI, found


@pytest.mark.slow  # builds a venv from the package index (set CROSSOVER_FLOOR_VENV to reuse one)
def test_the_agent_at_the_lowest_fastapi_and_starlette_pyproject_allows(standin_profile, state_dir, tmp_path):
    import httpx

    from crossover.servers.process import spawn, stop, wait_ready

    found = floors()
    venv = Path(os.environ.get("CROSSOVER_FLOOR_VENV") or tmp_path / "floor")
    python = venv / "bin" / "python"
    pins = [f"{name}=={'.'.join(map(str, found[name]))}" for name in ("fastapi", "starlette")]
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    subprocess.run(
        [
            str(python),
            "-m",
            "pip",
            "install",
            "-q",
            *pins,
            "uvicorn[standard]",
            "httpx",
            "prometheus-client",
            "pydantic-settings",
        ],
        check=True,
        timeout=900,
    )
    subprocess.run(
        [str(python), "-m", "pip", "install", "-q", "--no-deps", "-e", str(Path(__file__).parents[2])],
        check=True,
        timeout=300,
    )
    versions = subprocess.run(
        [str(python), "-c", "import fastapi, starlette; print(fastapi.__version__, starlette.__version__)"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split()
    installed = [tuple(int(part) for part in version.split(".")) for version in versions]
    assert [v[: len(found[name])] for v, name in zip(installed, ("fastapi", "starlette"), strict=True)] == [
        found["fastapi"],
        found["starlette"],
    ], versions
    port = free_port()
    argv = [str(python), "-m", "crossover.gateway.cli", "servers", "agent", str(standin_profile("standin-time-shared"))]
    proc = spawn(
        [*argv, "--port", str(port), "--state-dir", str(state_dir)],
        die_with_parent=False,
        env={**os.environ, "CROSSOVER_AGENT_TOKEN": TOKEN},
    )
    try:
        wait_ready(f"http://127.0.0.1:{port}/health", proc, 60)
        statuses = {name: raw(port, request) for name, request in VARIANTS.items()}
        assert all(400 <= status < 500 for status in statuses.values()), (versions, statuses)
        headers = {"authorization": f"Bearer {TOKEN}"}
        listed = httpx.get(f"http://127.0.0.1:{port}/servers", headers=headers, timeout=10, trust_env=False).json()
        assert all(server["pid"] is None for server in listed["servers"]), "a refused request started something"
    finally:
        stop([proc])
    print("agent at the floor:", versions, statuses)
