"""A scripted OpenAI-style backend for the load tester's edge cases (the SGLang stand-in covers the rest).

The requested `model` picks the behaviour, so one server answers every case:

    ok            CHUNKS chunks of TOKENS_PER_CHUNK tokens, per-chunk usage, final usage chunk, [DONE]
    ok-final-usage  the same, but usage only in the final chunk (servers without continuous_usage_stats)
    http-503      503 with an OpenAI-style error body
    error-first   200, then an SSE error event before any token (SGLang's "queue is full"), then [DONE]
    error-mid     200, a few tokens, then an SSE error event, then [DONE]
    cut           200, a few tokens, then the stream ends without [DONE]
    no-usage      200, tokens and [DONE], but never a usage object
    stall         200, one token, then nothing until the client goes away
    paced         as ok, PACE_S between chunks (requests overlap, so the closed loop can be checked)
    flaky         the n-th request (from 0) asking for more than 8 tokens behaves as ok, http-503, error-mid
                  for n % 3 = 0, 1, 2; shorter ones (the load tester's probe) as ok

`/server_info` answers `server_info(n)` on its n-th read (from 0) when a `server_info` function is given
(so a test can play a stand-in that starts lagging mid-sweep), else 404 like a server without one.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable

PACE_S = 0.005
CHUNKS = 8
TOKENS_PER_CHUNK = 3
PROMPT_TOKENS = 17


def _chunk(text: str, usage: dict | None = None, choices: bool = True) -> bytes:
    event: dict = {
        "id": "x",
        "object": "chat.completion.chunk",
        "model": "m",
        "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}] if choices else [],
    }
    if usage is not None:
        event["usage"] = usage
    return b"data: " + json.dumps(event).encode() + b"\n\n"


def _usage(completion: int) -> dict:
    return {"prompt_tokens": PROMPT_TOKENS, "completion_tokens": completion, "total_tokens": PROMPT_TOKENS + completion}


ERROR_EVENT = (
    b'data: {"error": {"object": "error", "message": "The request queue is full.", '
    b'"type": "SERVICE_UNAVAILABLE", "param": null, "code": 503}}\n\n'
)


def _script(model: str) -> tuple[int, list[bytes]]:
    tokens = [_chunk("w " * TOKENS_PER_CHUNK, _usage((i + 1) * TOKENS_PER_CHUNK)) for i in range(CHUNKS)]
    final = _chunk("", _usage(CHUNKS * TOKENS_PER_CHUNK), choices=False)
    done = b"data: [DONE]\n\n"
    if model == "ok":
        return 200, [*tokens, final, done]
    if model == "ok-final-usage":
        bare = [_chunk("w " * TOKENS_PER_CHUNK) for _ in range(CHUNKS)]
        return 200, [*bare, final, done]
    if model == "http-503":
        body = {"error": {"message": "no healthy backend", "type": "service_unavailable", "param": None, "code": 503}}
        return 503, [json.dumps(body).encode()]
    if model == "error-first":
        return 200, [ERROR_EVENT, done]
    if model == "error-mid":
        return 200, [*tokens[:3], ERROR_EVENT, done]
    if model == "cut":
        return 200, tokens[:3]
    if model == "no-usage":
        return 200, [_chunk("w"), _chunk("w"), done]
    return 404, [json.dumps({"error": {"message": f"unknown model {model}", "code": 404}}).encode()]


class ScriptedBackend:
    """The ASGI app; counts chat requests in flight (and the peak) so tests can check the closed loop."""

    def __init__(self, server_info: Callable[[int], dict] | None = None) -> None:
        self.inflight = 0
        self.peak = 0
        self.requests = 0
        self.flaky = 0
        self.server_info = server_info
        self.server_info_reads = 0

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            while (message := await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        body = b""
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # the load tester cancelled the request before its body arrived
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        if scope["path"] == "/v1/models":
            models = {"object": "list", "data": [{"id": "ok", "object": "model"}]}
            await self._send(send, 200, b"application/json", [json.dumps(models).encode()])
        elif scope["path"] == "/server_info" and self.server_info is not None:
            info = self.server_info(self.server_info_reads)
            self.server_info_reads += 1
            await self._send(send, 200, b"application/json", [json.dumps(info).encode()])
        elif scope["path"] != "/v1/chat/completions":
            await self._send(send, 404, b"application/json", [b'{"detail": "Not Found"}'])
        else:
            self.requests += 1
            self.inflight += 1
            self.peak = max(self.peak, self.inflight)
            request = json.loads(body)
            model = request.get("model", "")
            if model == "flaky":
                model = "ok"
                if request.get("max_tokens", 0) > 8:
                    model = ("ok", "http-503", "error-mid")[self.flaky % 3]
                    self.flaky += 1
            try:
                await self._chat(model, receive, send)
            finally:
                self.inflight -= 1

    async def _chat(self, model: str, receive, send) -> None:
        status, parts = _script("ok" if model in ("stall", "paced") else model)
        content_type = b"text/event-stream" if status == 200 else b"application/json"
        if model == "stall":
            await self._send(send, status, content_type, parts[:1], end=False)
            await receive()  # returns http.disconnect once the client gives up
            return
        await self._send(send, status, content_type, parts, pace=PACE_S if model == "paced" else 0.0)

    @staticmethod
    async def _send(send, status: int, content_type: bytes, parts: list[bytes], end: bool = True, pace: float = 0.0):
        await send({"type": "http.response.start", "status": status, "headers": [(b"content-type", content_type)]})
        for part in parts:
            if pace:
                await asyncio.sleep(pace)
            await send({"type": "http.response.body", "body": part, "more_body": True})
        if end:
            await send({"type": "http.response.body", "body": b"", "more_body": False})
