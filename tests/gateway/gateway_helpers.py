"""Helpers for the gateway's tests.

- `hold(client, url, n)`: n streams opened one after another and kept open (so routing is deterministic)
- `chat(...)`, `sse_events(raw)`, `stream_text(events)`, `wait_until(condition)`, `sim_running(url)`
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import httpx
from prometheus_client import CollectorRegistry

from crossover.gateway.app import GatewayApp, create_app
from crossover.gateway.config import Settings
from crossover.servers.process import free_port
from tests.waiting import WAIT_S, wait_until  # noqa: F401  (re-exported for the gateway's tests)

MODEL = "moonshotai/Kimi-K2.5"
# Fast enough for tests, slow enough that a stream of a few thousand tokens stays open for seconds.
SIM_SCALE = ("--time-scale", "10")
LONG = 10_000  # max_tokens of a stream meant to stay open until the test closes it (the KV pool holds ~9)


def chat(stream: bool = False, max_tokens: int = 8, **extra) -> dict:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": max_tokens, "stream": stream}
    return {**body, **extra}


def sse_events(raw: bytes) -> list:
    """Parsed `data:` payloads of an SSE body ("[DONE]" stays a string)."""
    events = []
    for block in raw.replace(b"\r\n", b"\n").split(b"\n\n"):
        block = block.strip()
        if block.startswith(b"data:"):
            data = block[5:].strip()
            events.append("[DONE]" if data == b"[DONE]" else json.loads(data))
    return events


def stream_text(events: list) -> str:
    return "".join(
        choice.get("delta", {}).get("content") or choice.get("text") or ""
        for event in events
        if isinstance(event, dict)
        for choice in event.get("choices", [])
    )


def unused_url() -> str:
    """A loopback URL where nothing listens (connections are refused)."""
    return f"http://127.0.0.1:{free_port()}"


def sim_running(url: str) -> int:
    loads = httpx.get(url + "/v1/loads", timeout=5, trust_env=False).json()["loads"]
    return sum(rank["num_running_reqs"] + rank["num_waiting_reqs"] for rank in loads)


@dataclass
class RunningGateway:
    url: str
    app: GatewayApp
    registry: CollectorRegistry
    settings: Settings = field(repr=False)
    server: object = field(default=None, repr=False)  # the uvicorn.Server it runs on

    @property
    def state(self):
        return self.app.state

    def metric(self, name: str, **labels: str) -> float:
        return self.registry.get_sample_value(name, labels) or 0.0

    def samples(self) -> dict[tuple[str, tuple], float]:
        return {
            (sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in self.registry.collect()
            for sample in family.samples
        }

    def inflight(self) -> int:
        return sum(backend.inflight for backend in self.state.pools.all())

    def settled(self) -> None:
        """Wait until no request is in flight: then every finished request's metrics are recorded."""
        wait_until(lambda: self.inflight() == 0, what="no request in flight")


@contextlib.asynccontextmanager
async def hold(client: httpx.AsyncClient, url: str, n: int, **body) -> AsyncIterator[list[str]]:
    """Open n long streams one at a time; yield the pool each landed on; close them all on exit."""
    responses: list[httpx.Response] = []
    try:
        for _ in range(n):
            request = client.build_request("POST", url + "/v1/chat/completions", json=chat(True, LONG, **body))
            response = await client.send(request, stream=True)
            assert response.status_code == 200, response.status_code
            responses.append(response)
        yield [response.headers["x-crossover-pool"] for response in responses]
    finally:
        await asyncio.gather(*(response.aclose() for response in responses))


async def read_all(receive) -> bytes:
    """A request's whole body, from an ASGI `receive`."""
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            return body


def raw_post(body: bytes, request_id: bytes = b"raw") -> bytes:
    """A chat completion request as a client writes it, head and body."""
    return (
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b"x-request-id: %s\r\ncontent-length: %d\r\n\r\n%s" % (request_id, len(body), body)
    )


def content_length(head: bytes, missing: int | None = None) -> int:
    """The Content-Length a message head declares; `missing` if it declares none (None: it must declare one)."""
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            return int(line[15:])
    assert missing is not None, f"no content-length in {head!r}"
    return missing


def read_response(sock) -> bytes:
    """One whole response with a content-length from `sock`, leaving the connection open."""

    def more() -> bytes:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError("the server closed the connection before a whole response")
        return chunk

    data = b""
    while b"\r\n\r\n" not in data:
        data += more()
    head, _, rest = data.partition(b"\r\n\r\n")
    length = content_length(head)
    while len(rest) < length:
        rest += more()
    return head + b"\r\n\r\n" + rest[:length]


class Scripted:
    """A tiny backend for what the stand-in cannot stage: it records each generation request it gets and
    answers with a fixed script. `/health` and `/v1/models` answer like SGLang.

        backend = Scripted(chunks=[b"data: {}\\n\\n", b"data: [DONE]\\n\\n"], gap_s=0.01)
        url = serve(backend).url
    """

    def __init__(
        self,
        chunks: list[bytes] = (),
        status: int = 200,
        headers: list[tuple[bytes, bytes]] = (),
        body: bytes = b"",
        delay_s: float = 0.0,
        gap_s: float = 0.0,
        stall_after: int | None = None,
        delays: list[float] = (),
    ) -> None:
        self.chunks, self.status, self.headers, self.body = list(chunks), status, list(headers), body
        self.delay_s, self.gap_s, self.stall_after = delay_s, gap_s, stall_after
        self.delays = list(delays)  # the first requests' delays, in turn; then delay_s
        self.requests: list[tuple[str, dict[bytes, bytes], bytes]] = []
        self.arrived: list[float] = []  # time.monotonic() as each generation request arrived: the backend's clock
        self.queries: list[bytes] = []
        self.probes: list[tuple[str, dict[bytes, bytes]]] = []  # the gateway's own calls: health, models
        self.hangups = 0  # requests whose client (the gateway) hung up while this waited to answer

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return
        if scope["path"] in ("/health", "/v1/models"):
            self.probes.append((scope["path"], dict(scope["headers"])))
            body = (
                b"" if scope["path"] == "/health" else json.dumps({"object": "list", "data": [{"id": MODEL}]}).encode()
            )
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": body})
            return
        self.arrived.append(time.monotonic())
        body = await read_all(receive)
        self.requests.append((scope["path"], dict(scope["headers"]), body))
        self.queries.append(scope["query_string"])
        delay = self.delays.pop(0) if self.delays else self.delay_s
        if delay and await self._disconnected(receive, delay):
            return
        await send({"type": "http.response.start", "status": self.status, "headers": self.headers})
        if not self.chunks:
            await send({"type": "http.response.body", "body": self.body})
            return
        for index, chunk in enumerate(self.chunks):
            if index == self.stall_after:
                await self._disconnected(receive, None)  # silent until the gateway gives up
                return
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await asyncio.sleep(self.gap_s)
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _disconnected(self, receive, timeout: float | None) -> bool:
        """Wait up to `timeout` for the client to hang up; True if it did (counted in `hangups`)."""

        async def hang_up() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass

        try:
            await asyncio.wait_for(hang_up(), timeout)
        except TimeoutError:
            return False
        self.hangups += 1
        return True


class Picky(Scripted):
    """Answers 500, like SGLang when a request makes it raise (a chat template, say), to requests whose body
    contains `poison`, and a one-token completion to everything else."""

    def __init__(self, poison: str) -> None:
        super().__init__(status=200, body=json.dumps({"choices": [], "usage": {"completion_tokens": 1}}).encode())
        self.poison = poison.encode()
        self.poisoned = 0

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"] in ("/health", "/v1/models"):
            await super().__call__(scope, receive, send)
            return
        body = await read_all(receive)
        if self.poison in body:
            self.poisoned += 1
            payload = json.dumps({"object": "error", "message": "template error", "type": "InternalError", "code": 500})
            await send(
                {"type": "http.response.start", "status": 500, "headers": [(b"content-type", b"application/json")]}
            )
            await send({"type": "http.response.body", "body": payload.encode()})
            return
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": self.body})


class _RawBackend:
    """A raw HTTP/1.1 backend on its own event loop in a thread, for what no well-behaved server does.
    `received` holds the X-Request-Id of every POST that arrived whole, answered or not."""

    def __init__(self) -> None:
        self.posts = 0
        self.received: list[bytes] = []
        self.loop = asyncio.new_event_loop()
        self.server = self.loop.run_until_complete(asyncio.start_server(self._handle, "127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        async def shutdown() -> None:
            self.server.close()
            handlers = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
            for task in handlers:
                task.cancel()
            await asyncio.gather(*handlers, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(shutdown(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()

    @staticmethod
    async def read_request(reader: asyncio.StreamReader) -> bytes:
        """One request's head (the body is read and dropped)."""
        head = await reader.readuntil(b"\r\n\r\n")
        await reader.readexactly(content_length(head, missing=0))
        return head

    def record(self, head: bytes) -> None:
        """A POST arrived whole: from here on the backend may be generating it."""
        for line in head.split(b"\r\n"):
            name, _, value = line.partition(b":")
            if name.lower() == b"x-request-id":
                self.received.append(value.strip())

    @staticmethod
    async def answer(writer: asyncio.StreamWriter, payload: dict) -> None:
        body = json.dumps(payload).encode()
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)
        )
        await writer.drain()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await self.serve(reader, writer)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        raise NotImplementedError


MODELS = {"object": "list", "data": [{"id": MODEL}]}


def sglang_error(message: str, status: int, type: str) -> dict:
    """SGLang's error body (ErrorResponse): top-level before a stream starts, under "error" in an event."""
    return {"object": "error", "message": message, "type": type, "param": None, "code": status}


QUEUE_FULL_EVENT = (
    b"data: %s\n\n"
    % json.dumps({"error": sglang_error("The request queue is full.", 503, "SERVICE_UNAVAILABLE")}).encode()
)


class DroppingBackend(_RawBackend):
    """Reads each generation request, counts it, and closes the connection without a word; GETs are answered."""

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            head = await self.read_request(reader)
            if head.startswith(b"POST"):
                self.posts += 1
                self.record(head)
                return
            await self.answer(writer, MODELS)


class ClosingBackend(_RawBackend):
    """Each connection answers one POST, then reads the next request on it whole and closes without a word:
    from the gateway's side just what an idle close crossing a reused connection looks like - but this backend
    got the request (and may be generating it). GETs are always answered."""

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        served_post = False
        while True:
            head = await self.read_request(reader)
            if head.startswith(b"POST"):
                self.record(head)
                if served_post:
                    return  # close instead of answering
                served_post = True
                self.posts += 1
                await self.answer(writer, {"choices": [], "usage": {"completion_tokens": 1}})
            else:
                await self.answer(writer, MODELS)


def start_in_engine(backends: list[str], admin_api_key: str = "") -> None:
    """Run the start-up (and shutdown) of an in-engine gateway in front of `backends`: what it refuses, it raises."""
    pool = {"backends": backends, "admin_api_key": admin_api_key}
    settings = Settings(topology="in-engine", admin_token="t", pools={"speculative": pool})
    app = create_app(settings, registry=CollectorRegistry())

    async def start() -> None:
        async with app.rest.app.router.lifespan_context(app.rest.app):
            pass

    asyncio.run(start())
