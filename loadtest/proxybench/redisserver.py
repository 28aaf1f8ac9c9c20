"""A throwaway redis-server for the benchmark's `crossover-redis` target: crossover with `[cluster] redis_url`
set, to weigh what the cluster's coordination costs per request against the same gateway without it.

    url = start(procs, host)                    # redis-server on a free loopback port, nothing saved; PING answered
    clients(url)                                # connected clients, this probe's own included

Spoken to in RESP over a socket of its own, so the benchmark needs no Redis client library: only crossover does.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Collection
from urllib.parse import urlsplit

from crossover.servers import process

REDIS_SERVER = "redis-server"
READY_TIMEOUT_S = 30.0
POLL_S = 0.05
IO_TIMEOUT_S = 2.0


class RedisUnavailable(Exception):
    """redis-server is not installed, or did not answer PING in time."""


def command(url: str, *words: str) -> bytes:
    """One Redis command's reply, raw (RESP): enough for PING and INFO."""
    parts = urlsplit(url)
    request = b"*%d\r\n" % len(words) + b"".join(b"$%d\r\n%s\r\n" % (len(w), w.encode()) for w in words)
    with socket.create_connection((parts.hostname, parts.port), timeout=IO_TIMEOUT_S) as sock:
        sock.sendall(request)
        reply = sock.recv(65536)
        if reply.startswith(b"$"):  # a bulk string: read up to its announced length
            length = int(reply[1 : reply.index(b"\r\n")])
            while len(reply) < reply.index(b"\r\n") + 2 + length:
                more = sock.recv(65536)
                if not more:
                    break
                reply += more
        return reply


def clients(url: str) -> int:
    """Clients connected to the server at `url`, counting the connection that asks."""
    for line in command(url, "INFO", "clients").decode().splitlines():
        if line.startswith("connected_clients:"):
            return int(line.split(":")[1])
    raise RedisUnavailable(f"{url} did not report connected_clients")


def start(procs: list[subprocess.Popen], host: str, affinity: Collection[int] | None = None) -> str:
    """A redis-server on a free port of `host` (added to `procs` for the caller to stop), answering PING: its URL."""
    exe = shutil.which(REDIS_SERVER)
    if exe is None:
        raise RedisUnavailable(f"{REDIS_SERVER} is not installed (Debian: apt-get install redis-server)")
    port = process.free_port(host)
    argv = [exe, "--bind", host, "--port", str(port), "--save", "", "--appendonly", "no", "--loglevel", "warning"]
    procs.append(process.spawn(argv, affinity=affinity, stdout=sys.stderr))
    url = f"redis://{host}:{port}/0"
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if procs[-1].poll() is not None:
            raise RedisUnavailable(f"{REDIS_SERVER} exited with code {procs[-1].returncode} before answering")
        try:
            if command(url, "PING").startswith(b"+PONG"):
                return url
        except OSError:
            pass
        time.sleep(POLL_S)
    raise RedisUnavailable(f"{REDIS_SERVER} on {url} did not answer PING within {READY_TIMEOUT_S:g} s")
