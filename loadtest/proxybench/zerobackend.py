"""A zero-work OpenAI-compatible backend: the yardstick a proxy benchmark measures proxies against.

It answers `/v1/chat/completions` (streaming and not) with canned tokens, one token per SSE chunk,
`max_tokens` chunks (default 16), optionally `--chunk-delay-ms` apart to look like a real decoder. It also
answers what SGLang's router reads when a worker registers (`/server_info`, `/model_info` and their old
`/get_*` names), `/health` and `/v1/models`. The HTTP layer is a bare asyncio protocol on httptools and
uvloop, because every microsecond spent here is taken from the proxy under test on a shared CPU.

    python -m crossover.loadtest.proxybench.zerobackend --port 31000 --chunk-delay-ms 20

Repeating `--port` serves the same backend on several ports, so a gateway that wants distinct backend
addresses per pool can still be pointed twice at one backend. `--workers N` serves them from N processes
(SO_REUSEPORT), for a host where one process would be the bottleneck of the direct line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import sys
import time

import httptools
import uvloop

from crossover.gateway.cli import non_negative_float, port, positive_int
from crossover.servers import process

MODEL = "zero"
DEFAULT_CHUNKS = 16
MAX_CHUNKS = 100_000
DEFAULT_PORT = 31000


def _sse(payload: dict) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


def _chunk(data: bytes) -> bytes:
    """One HTTP/1.1 chunked-encoding frame."""
    return b"%x\r\n%s\r\n" % (len(data), data)


def _head(status: str, content_type: bytes, length: int | None, keep_alive: bool) -> bytes:
    framing = b"transfer-encoding: chunked" if length is None else b"content-length: %d" % length
    conn = b"keep-alive" if keep_alive else b"close"
    return b"HTTP/1.1 %s\r\ncontent-type: %s\r\n%s\r\nconnection: %s\r\n\r\n" % (
        status.encode(),
        content_type,
        framing,
        conn,
    )


def _error(status: int, message: str, kind: str) -> tuple[int, dict]:
    return status, {"object": "error", "message": message, "type": kind, "param": None, "code": status}


class Canned:
    """Precomputed response pieces, so serving a request is mostly concatenation."""

    def __init__(self) -> None:
        created = int(time.time())
        base = {"id": "chatcmpl-zero", "object": "chat.completion.chunk", "created": created, "model": MODEL}
        self.token = _chunk(
            _sse({**base, "choices": [{"index": 0, "delta": {"content": "tok "}, "finish_reason": None}]})
        )
        self.first = _chunk(
            _sse(
                {
                    **base,
                    "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}],
                }
            )
        )
        self.last = _chunk(_sse({**base, "choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]}))
        self.done = _chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n"
        self.created = created
        self.server_info = {
            "model_path": MODEL,
            "served_model_name": MODEL,
            "tokenizer_path": MODEL,
            "tp_size": 1,
            "dp_size": 1,
            "max_running_requests": 4096,
            "internal_states": [{}],
            "version": "0.0.0-zerobackend",
        }
        self.model_info = {
            "model_path": MODEL,
            "tokenizer_path": MODEL,
            "served_model_name": MODEL,
            "is_generation": True,
            "weight_version": "default",
            "has_image_understanding": False,
            "has_audio_understanding": False,
        }
        self.models = {
            "object": "list",
            "data": [
                {
                    "id": MODEL,
                    "object": "model",
                    "created": created,
                    "owned_by": "sglang",
                    "root": MODEL,
                    "parent": None,
                    "max_model_len": 1 << 20,
                }
            ],
        }

    def completion(self, n: int) -> dict:
        return {
            "id": "chatcmpl-zero",
            "object": "chat.completion",
            "created": self.created,
            "model": MODEL,
            "choices": [
                {"index": 0, "message": {"role": "assistant", "content": "tok " * n}, "finish_reason": "length"}
            ],
            "usage": {"prompt_tokens": 1, "completion_tokens": n, "total_tokens": n + 1},
        }


class ZeroProtocol(asyncio.Protocol):
    """One client connection: parse requests with httptools, answer from `Canned`."""

    def __init__(self, canned: Canned, chunk_delay: float) -> None:
        self.canned = canned
        self.chunk_delay = chunk_delay
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.url = b""
        self.body: list[bytes] = []
        self.stream_task: asyncio.Task | None = None
        self.writable = asyncio.Event()
        self.writable.set()

    # asyncio callbacks
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self._respond_json(*_error(400, "malformed HTTP request", "BadRequest"), keep_alive=False)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.stream_task is not None:
            self.stream_task.cancel()
        self.writable.set()

    def pause_writing(self) -> None:
        self.writable.clear()

    def resume_writing(self) -> None:
        self.writable.set()

    # httptools callbacks
    def on_message_begin(self) -> None:
        self.url = b""
        self.body = []

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        keep_alive = self.parser.should_keep_alive()
        method = self.parser.get_method()
        path = self.url.split(b"?", 1)[0]
        if path == b"/v1/chat/completions" and method == b"POST":
            self._chat(b"".join(self.body), keep_alive)
        elif method != b"GET":
            self._respond_json(*_error(405, "method not allowed", "BadRequest"), keep_alive=keep_alive)
        elif path in (b"/health", b"/health_generate", b"/ready"):
            self._respond(b"200 OK", b"text/plain", b"", keep_alive)
        elif path == b"/v1/models":
            self._respond_json(200, self.canned.models, keep_alive)
        elif path in (b"/server_info", b"/get_server_info"):
            self._respond_json(200, self.canned.server_info, keep_alive)
        elif path in (b"/model_info", b"/get_model_info"):
            self._respond_json(200, self.canned.model_info, keep_alive)
        else:
            self._respond_json(
                *_error(404, f"no route {path.decode(errors='replace')}", "NotFound"), keep_alive=keep_alive
            )

    # responses
    def _respond(self, status: bytes, content_type: bytes, body: bytes, keep_alive: bool) -> None:
        assert self.transport is not None
        self.transport.write(_head(status.decode(), content_type, len(body), keep_alive) + body)
        if not keep_alive:
            self.transport.close()

    def _respond_json(self, status: int, payload: dict, keep_alive: bool) -> None:
        phrase = {200: b"200 OK", 400: b"400 Bad Request", 404: b"404 Not Found", 405: b"405 Method Not Allowed"}
        body = json.dumps(payload, separators=(",", ":")).encode()
        self._respond(phrase[status], b"application/json", body, keep_alive)

    def _chat(self, raw: bytes, keep_alive: bool) -> None:
        try:
            req = json.loads(raw)
            n = req.get("max_completion_tokens", req.get("max_tokens"))
            n = DEFAULT_CHUNKS if n is None else int(n)
            stream = bool(req.get("stream", False))
        except (ValueError, TypeError, AttributeError):
            self._respond_json(*_error(400, "body must be a JSON chat completion request", "BadRequest"), keep_alive)
            return
        if not 1 <= n <= MAX_CHUNKS:
            self._respond_json(*_error(400, f"max_tokens must be in 1..{MAX_CHUNKS}", "BadRequest"), keep_alive)
            return
        if not stream:
            self._respond_json(200, self.canned.completion(n), keep_alive)
            return
        assert self.transport is not None
        head = _head("200 OK", b"text/event-stream", None, keep_alive)
        if self.chunk_delay <= 0:
            # Each chunk is its own write, hence its own segment, as an engine emitting tokens would send them.
            write = self.transport.write
            write(head + self.canned.first)
            for _ in range(n):
                write(self.canned.token)
            write(self.canned.last + self.canned.done)
            if not keep_alive:
                self.transport.close()
            return
        # A paced stream outlives this callback: stop reading so a pipelined request cannot interleave.
        self.transport.pause_reading()
        self.stream_task = asyncio.get_running_loop().create_task(self._paced(head, n, keep_alive))

    async def _paced(self, head: bytes, n: int, keep_alive: bool) -> None:
        assert self.transport is not None
        write = self.transport.write
        write(head + self.canned.first)
        for _ in range(n):
            await asyncio.sleep(self.chunk_delay)
            await self.writable.wait()
            if self.transport.is_closing():
                return
            write(self.canned.token)
        write(self.canned.last + self.canned.done)
        self.stream_task = None
        if keep_alive:
            self.transport.resume_reading()
        else:
            self.transport.close()


async def serve(host: str, ports: list[int], chunk_delay_ms: float, reuse_port: bool = False) -> None:
    """Serve on every port in `ports` (one backend, several addresses) until cancelled; `reuse_port`: beside other
    processes serving the same ports (the kernel spreads connections over them)."""
    canned = Canned()
    loop = asyncio.get_running_loop()
    servers = [
        await loop.create_server(
            lambda: ZeroProtocol(canned, chunk_delay_ms / 1000.0), host, port, backlog=4096, reuse_port=reuse_port
        )
        for port in ports
    ]
    await asyncio.gather(*(server.serve_forever() for server in servers))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m crossover.loadtest.proxybench.zerobackend", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument(
        "--port",
        type=port,
        action="append",
        help=f"listen port (default {DEFAULT_PORT}); repeat it to serve on several ports",
    )
    parser.add_argument("--chunk-delay-ms", type=non_negative_float, default=0.0, help="gap between streamed chunks")
    parser.add_argument(
        "--workers",
        type=positive_int,
        default=1,
        help="processes serving the ports (this one and its children, which die with it): a backend that is not "
        "the bottleneck on a host with cores to spare",
    )
    parser.add_argument("--reuse-port", action="store_true", help=argparse.SUPPRESS)  # set for the workers
    args = parser.parse_args(argv)
    ports = args.port or [DEFAULT_PORT]
    shared = args.reuse_port or args.workers > 1
    if args.workers > 1:
        # Children of this process, so its process tree (what the benchmark measures) holds them all.
        worker = [sys.executable, "-m", __spec__.name, "--host", args.host, "--reuse-port"]
        worker += [*(f"--port={p}" for p in ports), "--chunk-delay-ms", str(args.chunk_delay_ms)]
        for _ in range(args.workers - 1):
            process.spawn(worker)
    uvloop.run(serve(args.host, ports, args.chunk_delay_ms, shared))


if __name__ == "__main__":
    main()
