"""The benchmark's own redis-server: started on a free loopback port, answering, counting its clients, stopped."""

from __future__ import annotations

import shutil
import socket

import pytest

from crossover.loadtest.proxybench import redisserver
from crossover.servers.process import stop

pytestmark = pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server is not installed")


def test_a_started_server_answers_counts_its_clients_and_stops():
    procs = []
    try:
        url = redisserver.start(procs, "127.0.0.1")
        assert url.startswith("redis://127.0.0.1:") and url.endswith("/0")
        assert redisserver.command(url, "PING") == b"+PONG\r\n"
        assert redisserver.clients(url) == 1  # the asking connection itself
        host, port = url.removeprefix("redis://").removesuffix("/0").split(":")
        with socket.create_connection((host, int(port))):
            assert redisserver.clients(url) == 2
        # Nothing is saved: a benchmark's Redis leaves no file behind.
        assert redisserver.command(url, "CONFIG", "GET", "save") == b"*2\r\n$4\r\nsave\r\n$0\r\n\r\n"
    finally:
        stop(procs)
    assert procs[0].poll() is not None


def test_no_redis_server_is_said_plainly(monkeypatch):
    monkeypatch.setattr(redisserver, "REDIS_SERVER", "no-such-redis-server")
    with pytest.raises(redisserver.RedisUnavailable, match="no-such-redis-server is not installed"):
        redisserver.start([], "127.0.0.1")
