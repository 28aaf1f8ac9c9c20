"""The client protocol on the uvicorn it is installed with: every internal of uvicorn's it builds on is there
(`UVICORN_INTERNALS`), the direct lane really takes a request without an ASGI task, and all of it holds at the
oldest uvicorn pyproject.toml allows (`.venv-uvicorn-floor`, built by tests/uvicorn_floor.py)."""

from __future__ import annotations

import json
import os
import socket
import subprocess

import uvicorn
import uvicorn.config
from packaging.version import Version
from uvicorn.protocols.http import httptools_impl
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from crossover.gateway.wire.client_http import UVICORN_INTERNALS
from tests import uvicorn_floor
from tests.conftest import missing_environment
from tests.gateway.gateway_helpers import Scripted, chat, raw_post, read_response

ANSWER = json.dumps({"id": "x", "object": "chat.completion", "choices": [], "usage": {"completion_tokens": 1}}).encode()
FLOOR_VENV = uvicorn_floor.REPO_ROOT / ".venv-uvicorn-floor"
# What runs on the floor's uvicorn: this file (but this test) and the client protocol's own tests.
FLOOR_TESTS = ("tests/gateway/wire/test_client_http_uvicorn.py", "tests/gateway/wire/test_client_http.py")
FLOOR_RUN_S = 900


async def hello(scope, receive, send) -> None:
    if scope["type"] != "http":
        return
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


def test_every_uvicorn_internal_the_gateway_uses_is_there(serve):
    """Looked for where uvicorn itself makes them: on a live server, its connection's protocol and that
    connection's request-response cycle after a request (uvicorn's own protocol class, not ours, which defines
    some of the same names itself)."""
    running = serve(hello, http="httptools")
    with socket.create_connection(("127.0.0.1", running.port), timeout=10) as sock:
        sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        assert read_response(sock).startswith(b"HTTP/1.1 200 ")
        (protocol,) = running.server.server_state.connections
        assert type(protocol) is HttpToolsProtocol
        owners = {
            "httptools_impl": httptools_impl,
            "HttpToolsProtocol": protocol,
            "RequestResponseCycle": protocol.cycle,
            "FlowControl": protocol.flow,
            "ServerState": running.server.server_state,
            "Server": running.server,
            "config": uvicorn.config,
        }
        missing = [f"{owner}.{name}" for owner, names in UVICORN_INTERNALS.items() for name in names]
        missing = [each for each in missing if not hasattr(owners[each.split(".")[0]], each.split(".")[1])]
    assert missing == [], f"uvicorn {uvicorn.__version__} lacks {missing}"


def test_the_direct_lane_takes_a_request_without_an_asgi_task(serve, gateway, monkeypatch):
    """A non-streamed request is answered from callbacks alone (and a client's Connection: close is heard
    there); a stream gets its task, which shows the count sees tasks."""
    started = []  # the protocol class of each connection that started a task (the backend's too: it runs here)
    start_task = HttpToolsProtocol._start_asgi_task
    monkeypatch.setattr(
        HttpToolsProtocol, "_start_asgi_task", lambda self, *args: started.append(type(self)) or start_task(self, *args)
    )
    # The lane sends only on a pooled connection: kept long enough for a busy machine to get to the request.
    url = serve(Scripted(body=ANSWER), timeout_keep_alive=60).url
    gw = gateway([url], [url], timeouts={"backend_keepalive": 60})
    port = int(gw.url.rsplit(":", 1)[1])

    def tasks() -> int:
        return started.count(gw.server.config.http)

    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(raw_post(json.dumps(chat()).encode()))
        assert read_response(sock).startswith(b"HTTP/1.1 200 ")
        assert tasks() == 0
        close = raw_post(json.dumps(chat()).encode()).replace(b"\r\n\r\n", b"\r\nconnection: close\r\n\r\n", 1)
        sock.sendall(close)
        answer = read_response(sock)
        assert answer.startswith(b"HTTP/1.1 200 ") and b"\r\nconnection: close\r\n" in answer.lower()
        assert sock.recv(1) == b""  # closed by the gateway, as the client asked
    assert tasks() == 0
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(raw_post(json.dumps(chat(stream=True)).encode()))
        assert sock.recv(65536).startswith(b"HTTP/1.1 ")
    assert tasks() == 1


def test_the_client_protocol_passes_its_tests_at_the_uvicorn_floor():
    if not uvicorn_floor.is_built(FLOOR_VENV):
        missing_environment(
            f"no venv at uvicorn's floor ({uvicorn_floor.floor()}) at {FLOOR_VENV}: "
            "python -m tests.uvicorn_floor build .venv-uvicorn-floor"
        )
    python = str(uvicorn_floor.venv_python(FLOOR_VENV))
    version = subprocess.run(
        [python, "-c", "import uvicorn; print(uvicorn.__version__)"], capture_output=True, text=True, check=True
    ).stdout.strip()
    assert Version(version) == Version(uvicorn_floor.floor())
    this = f"{FLOOR_TESTS[0]}::test_the_client_protocol_passes_its_tests_at_the_uvicorn_floor"
    argv = [python, "-m", "pytest", "-p", "no:xdist", "-p", "no:cacheprovider", "-q", *FLOOR_TESTS, "--deselect", this]
    done = subprocess.run(
        argv,
        cwd=uvicorn_floor.REPO_ROOT,
        env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"},
        capture_output=True,
        text=True,
        timeout=FLOOR_RUN_S,
        check=False,
    )
    assert done.returncode == 0, f"on uvicorn {version}:\n{done.stdout[-6000:]}\n{done.stderr[-2000:]}"
    assert " passed" in done.stdout, done.stdout[-2000:]
