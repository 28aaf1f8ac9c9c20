"""The zero-delay backend answers like an SGLang server would, on every port it was given."""

from __future__ import annotations

import json
import os
import sys

import httpx
import pytest

from crossover.loadtest.proxybench.cpu import tree_pids
from crossover.servers.process import free_port, spawn, stop, wait_ready
from tests.loadtest.zero_server import running_zero
from tests.waiting import wait_until


@pytest.fixture
def zero():
    """A zero backend on two ports: -> [first URL, second URL]."""
    with running_zero(ports=2) as urls:
        yield urls


def chat(url: str, **body) -> httpx.Response:
    payload = {"model": "zero", "messages": [{"role": "user", "content": "hi"}], **body}
    return httpx.post(f"{url}/v1/chat/completions", json=payload, timeout=10)


def test_stream_has_one_chunk_per_token_then_done(zero):
    response = chat(zero[0], stream=True, max_tokens=5)
    assert response.status_code == 200
    assert response.headers["content-type"] == "text/event-stream"
    events = [line[len("data: ") :] for line in response.text.split("\n\n") if line]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(event) for event in events[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == "tok " * 5
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_whole_completion_and_the_second_port(zero):
    for url in zero:
        body = chat(url, max_tokens=3).json()
        assert body["object"] == "chat.completion"
        assert body["usage"]["completion_tokens"] == 3


def test_what_sglang_router_reads_at_registration(zero):
    for path in ("/server_info", "/get_server_info", "/model_info", "/get_model_info", "/v1/models"):
        assert httpx.get(zero[0] + path, timeout=10).status_code == 200, path
    assert httpx.get(zero[0] + "/model_info", timeout=10).json()["is_generation"] is True


@pytest.mark.parametrize(
    ("content", "status"),
    [(b"not json", 400), (b'{"max_tokens": 0}', 400), (b'{"max_tokens": "many"}', 400), (b"[1]", 400)],
)
def test_bad_requests_get_openai_style_errors(zero, content, status):
    response = httpx.post(f"{zero[0]}/v1/chat/completions", content=content, timeout=10)
    assert response.status_code == status
    body = response.json()
    assert body["object"] == "error" and body["code"] == status and body["message"]


def test_unknown_route_and_method(zero):
    assert httpx.get(zero[0] + "/nope", timeout=10).json()["code"] == 404
    assert httpx.delete(zero[0] + "/health", timeout=10).json()["code"] == 405


def test_workers_serve_the_ports_from_several_processes_of_one_tree():
    ports = [free_port(), free_port()]
    argv = [sys.executable, "-m", "crossover.loadtest.proxybench.zerobackend", "--workers", "3"]
    proc = spawn([*argv, *(f"--port={port}" for port in ports)], die_with_parent=False)
    urls = [f"http://127.0.0.1:{port}" for port in ports]
    try:
        wait_ready(urls[0] + "/health", proc, 30.0)
        # The backend and its two workers: one process tree, as the benchmark measures it.
        wait_until(lambda: len(tree_pids(proc.pid)) == 3, what="the two workers to start")
        for url in urls:
            assert all(chat(url, max_tokens=2).status_code == 200 for _ in range(20))
        workers = tree_pids(proc.pid)[1:]
    finally:
        stop([proc])
    # The workers die with the backend (they are in sessions of their own, not its process group).
    wait_until(lambda: not any(os.path.exists(f"/proc/{pid}") for pid in workers), what="the workers to exit")
