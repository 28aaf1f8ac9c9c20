"""The GPU-host agent: an authenticated HTTP API over the supervisor, so a gateway on another machine can
perform restart switches (stop one configuration, start the other) on this box.

    crossover servers agent standin-time-shared --port 8100 --token "$TOKEN"

    GET  /health                   open: {"status": "ok"}
    GET  /metrics                  open: Prometheus text
    GET  /servers                  {"servers": [ServerStatus, ...]}
    GET  /servers/{name}           ServerStatus
    POST /servers/{name}/start     202 ServerStatus (starting); ready after a real 1-token generation
    POST /servers/{name}/stop      202 ServerStatus (stopping); stopped once no process of its group is left
    POST /servers/{name}/release   200 ServerStatus (released) once SGLang handed its GPU memory back (sleep)
    POST /servers/{name}/resume    200 ServerStatus (ready) once it took its memory back, continued and generated

ServerStatus is the agent contract's (crossover/gateway/agent_contract.py, with its JSON Schema). Everything
but /health and /metrics needs `Authorization: Bearer <token>` (401 otherwise): the check sits on the routes
themselves, so no URL a client can shape (its Host header, a `?` or `#` in it) decides whether it runs. The
request head is bounded in size and time as the gateway's is (gateway/wire/client_http.py). The token comes from a
file or the environment (argv shows in `ps`), is printable ASCII, never empty or blank, and is never passed on to the
servers the agent starts; a token file must be a regular file only its owner may read (servers/agent_token.py).
One operation at a time per GPU set: a second one on overlapping GPUs gets 409, and so does a start while another
server holds the GPUs (stop it first: that is what a restart switch is). Operations run
as tasks on the event loop; poll GET /servers/{name} for a start's or stop's outcome. A release or resume takes
seconds, not minutes, and is answered when it is done (200, or 502 `operation_failed` saying why); a client that
leaves does not cancel it. Both are idempotent: a release of a released server and a resume of one that holds its
memory change nothing (SGLang 0.5.23 dies on a resume of memory it holds). Servers outlive the agent: a new agent
reads the state dir and reports them, it never starts a duplicate.

Every POST (and a lease holder's GET of one server) may carry the lease's fencing token (`X-Crossover-Fence: N`,
gateway/engines/fence.py): the agent remembers the highest token each GPU set accepted (servers/agent_fence.py, in the
state dir, so a restart does not forget it) and refuses a lower one with 409 `fenced` before anything else is
looked at - counted in crossover_agent_fenced_total and logged. A token more than `--fence-max-jump` (default
MAX_FENCE_JUMP) above the highest is refused too, with 403 `fence_jump` (not `fenced`: no newer lease holder leads),
counted in crossover_agent_fence_jumps_refused_total and logged; the fence is unchanged. A call without the header is a
gateway without a cluster, accepted. Each raise is logged at INFO (`--log-level info`) with the old and new token. An
operator lowers a fence with `crossover servers fence` (servers/agent_fence.py: not over HTTP), which the running
agent takes at its next call.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from dataclasses import dataclass, field
from pathlib import Path

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, generate_latest
from pydantic import BaseModel, ConfigDict, Field, field_validator
from starlette.exceptions import HTTPException as StarletteHTTPException

from crossover.gateway.engines import (
    FENCE_HEADER,
    FENCED,
    MAX_FENCE_JUMP,
    OPERATIONS,
    SERVER_STATES,
    Operation,
    ServerList,
    ServerState,
    ServerStatus,
    parse_fence,
)
from crossover.gateway.wire import client_protocol
from crossover.servers.agent_fence import AgentFences, FenceRefusal
from crossover.servers.agent_token import token_problem
from crossover.servers.profile import Profile, Server
from crossover.servers.supervisor import Supervisor

# How often the state gauge is refreshed when nobody asks (a server that crashed shows up as failed).
STATE_REFRESH_S = 5.0
# The request head: a gateway's request is a few hundred bytes, sent at once.
MAX_HEAD_BYTES = 16 * 1024
HEAD_TIMEOUT_S = 10.0
BODY_TIMEOUT_S = 10.0
# What a server is while an operation on it is under way.
BUSY_STATES: dict[Operation, ServerState] = {
    "start": "starting",
    "stop": "stopping",
    "release": "releasing",
    "resume": "resuming",
}
# Answered when done (seconds), not polled for: see the module docstring.
ANSWERED_WHEN_DONE: tuple[Operation, ...] = ("release", "resume")

logger = logging.getLogger(__name__)


class AgentSettings(BaseModel):
    model_config = ConfigDict(arbitrary_types_allowed=True, frozen=True)

    profile: Profile
    state_dir: Path
    token: str
    host: str = "127.0.0.1"
    # How far above the highest token a GPU set accepted a call's token may lie (0: no limit).
    fence_max_jump: int = Field(MAX_FENCE_JUMP, ge=0)

    @field_validator("token")
    @classmethod
    def _token(cls, token: str) -> str:
        if (problem := token_problem(token)) is not None:
            raise ValueError(problem)
        return token


class AgentUnauthorized(Exception):
    """Missing or wrong bearer token (401)."""


def error_response(status: int, message: str, err_type: str, code: str, param: str | None = None) -> JSONResponse:
    headers = {"www-authenticate": "Bearer"} if status == 401 else None
    body = {"error": {"message": message, "type": err_type, "param": param, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)


class AgentMetrics:
    def __init__(self, registry: CollectorRegistry):
        self.registry = registry
        self.state = Gauge(
            "crossover_agent_server_state",
            "1 for the server's current state, 0 for the others",
            ["server", "role", "state"],
            registry=registry,
        )
        self.operations = Counter(
            "crossover_agent_operations_total",
            "Operations by outcome (ok, failed, conflict, fenced, fence_jump)",
            ["operation", "outcome"],
            registry=registry,
        )
        self.last_start = Gauge(
            "crossover_agent_last_start_duration_seconds",
            "How long the last start took until the server answered a 1-token generation",
            ["server"],
            registry=registry,
        )
        self.fenced = Counter(
            "crossover_agent_fenced_total",
            "Calls refused because they carried a fencing token lower than one their GPU set had accepted",
            ["operation"],
            registry=registry,
        )
        self.fence_jumps = Counter(
            "crossover_agent_fence_jumps_refused_total",
            "Calls refused because their fencing token lay more than the allowed jump above their GPU set's highest",
            ["operation"],
            registry=registry,
        )
        self.fence = Gauge(
            "crossover_agent_fence_token",
            "The highest fencing token the server's GPU set has accepted (absent: none yet)",
            ["server"],
            registry=registry,
        )
        for operation in OPERATIONS:
            self.fenced.labels(operation)
            self.fence_jumps.labels(operation)
            for outcome in ("ok", "failed", "conflict", "fenced", "fence_jump"):
                self.operations.labels(operation, outcome)

    def set_state(self, server: Server, state: str) -> None:
        for candidate in SERVER_STATES:
            self.state.labels(server.name, server.role, candidate).set(1 if candidate == state else 0)


@dataclass
class _Busy:
    operation: Operation


@dataclass
class Agent:
    supervisor: Supervisor
    metrics: AgentMetrics
    fences: AgentFences
    busy: dict[str, _Busy] = field(default_factory=dict)  # server name -> operation under way
    errors: dict[str, str] = field(default_factory=dict)  # the last failed operation's message per server
    tasks: set[asyncio.Task] = field(default_factory=set)

    @property
    def profile(self) -> Profile:
        return self.supervisor.profile

    async def status(self, name: str) -> ServerStatus:
        server = self.profile.server(name)
        busy = self.busy.get(name)
        if busy is not None:
            record = self.supervisor.record(name)
            status = ServerStatus(
                name=name,
                role=server.role,
                state=BUSY_STATES[busy.operation],
                pid=record.pid if record else None,
                url=server.url,
                last_start_s=record.ready_s if record else None,
            )
        else:
            status = await self.supervisor.server_status(name)
            # A failed start leaves the server stopped, a failed stop leaves it (partly) running: both failed.
            if name in self.errors and status.state in ("stopped", "failed", "stopping"):
                status.state, status.error = "failed", self.errors[name]
        self.metrics.set_state(server, status.state)
        return status

    def conflict(self, name: str, operation: Operation) -> str | None:
        """Why `operation` on `name` cannot begin now, or None."""
        server = self.profile.server(name)
        for other_name, busy in self.busy.items():
            other = self.profile.server(other_name)
            if other_name == name or _share_gpus(server, other):
                return (
                    f"a {busy.operation} of {other_name!r} is under way on GPUs {_gpus(other)}; "
                    "retry when it has finished"
                )
        if operation in ("start", "resume"):
            # One GPU set, one mode: whatever else holds its memory must leave first.
            for other in self.profile.servers:
                if other.name == name or not _share_gpus(server, other):
                    continue
                record = self.supervisor.record(other.name)
                if record is not None and not record.released and self.supervisor.running(other.name):
                    leave = "stop" if operation == "start" else "release"
                    return f"{other.name!r} holds GPUs {_gpus(other)}: {leave} it first"
        return None

    def fence(self, name: str, operation: str, token: int | None) -> FenceRefusal | None:
        """None if a call carrying `token` may act on `name`'s GPU set (the fence is raised to it), else why not.
        `operation`: an Operation, or "status" for a lease holder's read."""
        if token is None:
            return None  # a gateway without a cluster: nothing to check or raise
        refused = self.fences.admit(name, token)
        if refused is not None:
            counter = self.metrics.fenced if refused.code == FENCED else self.metrics.fence_jumps
            counter.labels(operation).inc()
            self.metrics.operations.labels(operation, refused.code).inc()
            logger.warning("refused %s of %r: %s", operation, name, refused.message)
        self.show_fence()
        return refused

    def show_fence(self, *, refresh: bool = False) -> None:
        if refresh:
            self.fences.refresh()
        self.metrics.fence.clear()  # a fence an operator cleared has no token to show
        for server in self.profile.servers:
            token = self.fences.current(server.name)
            if token is not None:
                self.metrics.fence.labels(server.name).set(token)

    def begin(self, name: str, operation: Operation) -> asyncio.Task[str | None]:
        self.busy[name] = _Busy(operation)
        if operation not in ANSWERED_WHEN_DONE:
            self.errors.pop(name, None)
        task = asyncio.create_task(self._run(name, operation))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task

    async def _run(self, name: str, operation: Operation) -> str | None:
        """Returns why the operation failed, or None."""
        outcome, failure = "ok", None
        try:
            if operation == "start":
                took = await self.supervisor.start(name)
                self.metrics.last_start.labels(name).set(took)
            elif operation == "stop":
                report = await self.supervisor.stop(name)
                if report.survivors:
                    raise RuntimeError(f"processes survived SIGKILL: {report.survivors}")
            elif operation == "release":
                await self.supervisor.release(name)
            else:
                await self.supervisor.resume(name)
        except Exception as exc:  # any failure is the operation's outcome, reported through the status
            outcome, failure = "failed", f"{operation} failed: {exc}"
            if operation not in ANSWERED_WHEN_DONE:
                # A failed start or stop shows in the status; a release or resume is answered with its failure.
                self.errors[name] = failure
        finally:
            self.busy.pop(name, None)
            self.metrics.operations.labels(operation, outcome).inc()
            with contextlib.suppress(Exception):
                await self.status(name)
        return failure


def _share_gpus(a: Server, b: Server) -> bool:
    return bool(set(a.gpus) & set(b.gpus))


def _gpus(server: Server) -> str:
    return ",".join(map(str, server.gpus)) or "(none)"


def create_app(settings: AgentSettings, *, registry: CollectorRegistry | None = None) -> FastAPI:
    token = settings.token.encode()
    metrics = AgentMetrics(registry or CollectorRegistry())
    fences = AgentFences(settings.profile, settings.state_dir, max_jump=settings.fence_max_jump)
    agent = Agent(Supervisor(settings.profile, settings.state_dir), metrics, fences)
    agent.show_fence()

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        # Adopt what a previous agent (or `crossover servers up`) started: report it, never start a duplicate.
        for server in settings.profile.servers:
            await agent.status(server.name)
        refresher = asyncio.create_task(refresh_states())
        yield
        for task in [refresher, *agent.tasks]:
            task.cancel()

    async def refresh_states() -> None:
        while True:
            await asyncio.sleep(STATE_REFRESH_S)
            for server in settings.profile.servers:
                with contextlib.suppress(Exception):  # a failed probe must not end the refresher
                    await agent.status(server.name)

    async def authenticated(request: Request) -> None:
        """On every protected route (a dependency), never on a path: what runs is what is checked."""
        values = request.headers.getlist("authorization")
        scheme, _, given = (values[0] if len(values) == 1 else "").partition(" ")
        if not (scheme.lower() == "bearer" and secrets.compare_digest(given.encode(), token)):
            raise AgentUnauthorized

    app = FastAPI(title="crossover GPU-host agent", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.agent = agent
    protected = APIRouter(dependencies=[Depends(authenticated)])

    @app.exception_handler(AgentUnauthorized)
    async def unauthorized(_: Request, exc: AgentUnauthorized) -> JSONResponse:
        return error_response(
            401,
            "missing or invalid agent token: send 'Authorization: Bearer <token>'",
            "authentication_error",
            "invalid_agent_token",
        )

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "invalid_request")
        return error_response(exc.status_code, str(exc.detail), "invalid_request_error", code)

    def unknown(name: str) -> JSONResponse:
        names = ", ".join(s.name for s in settings.profile.servers)
        return error_response(
            404,
            f"no server {name!r} in profile {settings.profile.name} ({names})",
            "invalid_request_error",
            "not_found",
            "name",
        )

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics_endpoint() -> Response:
        agent.show_fence(refresh=True)  # a fence lowered on disk shows before the next call
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @protected.get("/servers")
    async def list_servers() -> dict:
        statuses = await asyncio.gather(*(agent.status(s.name) for s in settings.profile.servers))
        return ServerList(servers=list(statuses)).model_dump()

    @protected.get("/servers/{name}")
    async def get_server(name: str, request: Request):
        if name not in {s.name for s in settings.profile.servers}:
            return unknown(name)
        # A lease holder's status read carries its token too: a new leader that only adopts what serves (it moves
        # nothing) still raises the fence at once, so an old leader's call sent before it and held in the network
        # is refused when it lands instead of stopping the server the new leader serves from.
        if (refused := fenced(name, "status", request)) is not None:
            return refused
        return (await agent.status(name)).model_dump()

    def fenced(name: str, operation: str, request: Request) -> JSONResponse | None:
        """The refusal of a call whose fencing token is malformed or stale; None: it may go on (fence raised)."""
        try:
            token = parse_fence(request.headers.get(FENCE_HEADER))
        except ValueError as exc:
            return error_response(400, str(exc), "invalid_request_error", "invalid_fence", FENCE_HEADER)
        refused = agent.fence(name, operation, token)
        if refused is None:
            return None
        err_type = "conflict_error" if refused.code == FENCED else "permission_error"
        return error_response(refused.status, f"cannot {operation} {name!r}: {refused.message}", err_type, refused.code)

    async def operate(name: str, operation: Operation, request: Request):
        if name not in {s.name for s in settings.profile.servers}:
            return unknown(name)
        # The fence first: a stale lease holder learns that it is one, whatever else is going on.
        if (refused := fenced(name, operation, request)) is not None:
            return refused
        reason = agent.conflict(name, operation)
        if reason is not None:
            metrics.operations.labels(operation, "conflict").inc()
            return error_response(409, f"cannot {operation} {name!r}: {reason}", "conflict_error", "gpu_set_busy")
        task = agent.begin(name, operation)
        if operation not in ANSWERED_WHEN_DONE:
            return JSONResponse((await agent.status(name)).model_dump(), status_code=202)
        failure = await asyncio.shield(task)  # a client that leaves does not cancel the operation
        if failure is not None:
            return error_response(502, f"{name!r}: {failure}", "server_error", "operation_failed")
        return JSONResponse((await agent.status(name)).model_dump())

    @protected.post("/servers/{name}/{operation}")
    async def operation(name: str, operation: str, request: Request):
        if operation not in OPERATIONS:
            return error_response(
                404, f"no operation {operation!r}: one of {', '.join(OPERATIONS)}", "invalid_request_error", "not_found"
            )
        return await operate(name, operation, request)

    app.include_router(protected)
    return app


def uvicorn_options() -> dict:
    """The bounded request head (size and time) of the agent's HTTP side, as the gateway's client side has it."""
    return {"http": client_protocol(MAX_HEAD_BYTES, HEAD_TIMEOUT_S, BODY_TIMEOUT_S), "timeout_keep_alive": 5}


def run(settings: AgentSettings, *, port: int, log_level: str = "warning") -> None:
    import uvicorn

    # The agent's own log (fence raises at INFO, refusals at WARNING) at the level uvicorn's is.
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    uvicorn.run(create_app(settings), host=settings.host, port=port, log_level=log_level, **uvicorn_options())
