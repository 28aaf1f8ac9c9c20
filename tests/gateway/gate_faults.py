"""A test-only backend in front of a gated stand-in: forwards every call, and on `/speculative/adaptive` can do
what real engines do that the stand-in does not - refuse a gate, hang, answer a malformed state. It records what
it saw: the credentials per path, the gate calls, and the requests its engine served while it had no gate.

    faults = GateFaults(stand_in.url); backend = serve(faults.app())
    faults.refuse.add(12)        # a gate of 12 (dry run or not) -> 400 `rejected`, as the patch refuses a gate
    faults.hang.set()            # every gate call waits until faults.release is set (the test's teardown sets it)
    faults.hang_writes.set()     # ... every gate write (not a dry run), already sent by its caller, alike
    faults.on_held = look        # look() runs as each held write arrives (what was true when it was sent)
    faults.after_write = act     # act() runs once a gate write has landed, before its answer goes back
    faults.malformed = 3         # the next 3 gate reads answer {"success": true, "state": "idle"}
    faults.queue_full = True     # chat completions answer SGLang's queue-full (HTTP 503), as a full server does
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections import Counter, defaultdict
from collections.abc import Callable

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from crossover.gateway.engines.fence import FENCE_HEADER

GATE = "/speculative/adaptive"


class GateFaults:
    def __init__(self, upstream: str) -> None:
        self.upstream = upstream
        self.refuse: set[int | None] = set()
        self.hang = threading.Event()
        self.hang_writes = threading.Event()
        self.held_writes = 0  # gate writes that waited for faults.release
        self.on_held: Callable[[], None] | None = None
        self.after_write: Callable[[], None] | None = None
        self.release = threading.Event()
        self.malformed = 0
        self.malformed_sent = 0
        self.queue_full = False
        self.credentials: defaultdict[str, set[str]] = defaultdict(set)  # path -> Authorization values
        self.gate_calls: Counter[str] = Counter()  # "GET" / "POST" / "dry_run"
        self.write_fences: list[str | None] = []  # the fencing token (X-Crossover-Fence) of each gate write
        # Whether the engine behind has had its gate set since it started (or last failed to answer: a restart
        # reverts it to its start-up gate, none).
        self.gated = False
        self.ungated_served = 0
        self.served = 0

    def app(self) -> Starlette:
        return Starlette(routes=[Route("/{path:path}", self._handle, methods=["GET", "POST"])])

    async def _handle(self, request: Request) -> Response:
        path = "/" + request.path_params["path"]
        self.credentials[path].add(request.headers.get("authorization", ""))
        raw = await request.body()
        if path == GATE:
            body = json.loads(raw) if request.method == "POST" and raw else {}
            self.gate_calls["dry_run" if body.get("dry_run") else request.method] += 1
            if request.method == "POST" and not body.get("dry_run"):
                self.write_fences.append(request.headers.get(FENCE_HEADER))
            held_write = self.hang_writes.is_set() and request.method == "POST" and not body.get("dry_run")
            if held_write and not self.release.is_set():
                if self.on_held is not None:
                    self.on_held()
                self.held_writes += 1
            while (self.hang.is_set() or held_write) and not self.release.is_set():
                await asyncio.sleep(0.05)
            if request.method == "GET" and self.malformed > 0:
                self.malformed -= 1
                self.malformed_sent += 1
                return JSONResponse({"success": True, "message": "", "state": "idle"})
            if request.method == "POST" and body.get("zero_steps_above_bs", "absent") in self.refuse:
                message = f"zero_steps_above_bs={body['zero_steps_above_bs']} needs a CUDA graph never captured"
                return JSONResponse({"success": False, "message": message, "reason": "rejected", "partial": False}, 400)
        if path == "/v1/chat/completions" and self.queue_full:
            error = {"message": "The request queue is full.", "type": "BadRequestError", "code": 503}
            return JSONResponse({"object": "error", **error}, 503)
        forwarded = ("authorization", "content-type", FENCE_HEADER.lower())
        headers = {k: v for k, v in request.headers.items() if k.lower() in forwarded}
        try:
            async with httpx.AsyncClient(timeout=60, trust_env=False) as client:
                answer = await client.request(request.method, self.upstream + path, content=raw, headers=headers)
        except httpx.HTTPError:
            self.gated = False  # it went away: it comes back on its start-up gate
            return JSONResponse({"error": {"message": "upstream down"}}, 502)
        if path == GATE and request.method == "POST" and answer.status_code == 200 and not body.get("dry_run"):
            self.gated = body.get("zero_steps_above_bs") is not None
            if self.after_write is not None:
                act, self.after_write = self.after_write, None
                await asyncio.to_thread(act)
        if path == "/v1/chat/completions" and answer.status_code == 200:
            self.served += 1
            self.ungated_served += 0 if self.gated else 1
        return Response(answer.content, answer.status_code, media_type=answer.headers.get("content-type"))
