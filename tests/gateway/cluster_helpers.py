"""What the cluster's tests share: a real redis-server on a free loopback port, and a TCP proxy to cut one replica off.

redis = RedisServer.start()       # ready (PING answered); redis.url; redis.stop(); redis.restart() (same port)
proxy = TcpProxy(redis.port)      # proxy.url: Redis through it; proxy.cut() closes it and every connection;
                                  # proxy.heal() opens it again; proxy.delay_s = 0.5 delays each way
"""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import threading
import time

import pytest

from crossover.servers.process import free_port, spawn, stop

REDIS_SERVER = shutil.which("redis-server")
READY_S = 30.0
needs_redis = pytest.mark.skipif(REDIS_SERVER is None, reason="redis-server is not installed (tests/setup.sh)")


class RedisServer:
    def __init__(self, port: int) -> None:
        self.port = port
        self.proc: subprocess.Popen | None = None

    @classmethod
    def start(cls) -> RedisServer:
        server = cls(free_port())
        server.restart()
        return server

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def restart(self) -> None:
        """(Re)start on the same port, empty (nothing saved), and wait for PING."""
        argv = [REDIS_SERVER, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        self.proc = spawn(argv, stdout=subprocess.DEVNULL, die_with_parent=False)
        deadline = time.monotonic() + READY_S
        while not self.ping():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"redis-server on port {self.port} did not answer PING")
            time.sleep(0.02)

    def ping(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1) as sock:
                sock.sendall(b"PING\r\n")
                return sock.recv(64).startswith(b"+PONG")
        except OSError:
            return False

    def stop(self) -> None:
        if self.proc is not None:
            stop([self.proc])
            self.proc = None


class TcpProxy:
    """Forwards a loopback port to `target_port` until `cut()`, which closes the listener and every connection:
    whoever talks through it is cut off, as by a network partition; `heal()` listens on the same port again."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = free_port()
        self.sockets: list[socket.socket] = []
        self.lock = threading.Lock()
        self.delay_s = 0.0
        self.heal()

    def heal(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", self.port))
        self.open = True
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def _accept(self) -> None:
        while self.open:
            try:
                client, _ = self.listener.accept()
                upstream = socket.create_connection(("127.0.0.1", self.target_port))
            except OSError:
                return
            with self.lock:
                if not self.open:
                    client.close()
                    upstream.close()
                    return
                self.sockets += [client, upstream]
            for source, sink in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(source, sink), daemon=True).start()

    def _pipe(self, source: socket.socket, sink: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := source.recv(65536):
                if self.delay_s:
                    time.sleep(self.delay_s)  # each way: a slow link, not a cut one
                sink.sendall(data)
        with contextlib.suppress(OSError):
            sink.shutdown(socket.SHUT_WR)

    def cut(self) -> None:
        with self.lock:
            self.open = False
            self.listener.close()
            for sock in self.sockets:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
                sock.close()
            self.sockets = []
