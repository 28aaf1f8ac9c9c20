"""How a time-shared GPU set changes mode: the server-side half of a switch (the controller drives it).

    mechanism = make_mechanism(settings.switching, targets, client, inflight)   # targets: per mode, url + headers
    await mechanism.preflight("speculative", "plain")  # can it succeed? before anything is drained
    await mechanism.hand_over("speculative", "plain")  # take the GPU set from one mode, give it to the other
    await mechanism.verify("plain")                    # a 1-token generation: it really serves
    await mechanism.restore("speculative", failed="plain")   # after a failure: bring the old mode back
    await mechanism.mode_state("plain")                # what the mechanism can tell of a mode now
    await mechanism.finish_start("plain")              # a start under way (mode_state STARTING) comes up

The interface (`Mechanism`), which another way of switching (the in-engine speculation gate) implements too:
- `preflight(old, new)`: raise `SwitchFailed("preflight", ...)` if the switch cannot succeed now (whatever
  drives the switch does not answer, the target is missing or not in the state the mechanism expects). It
  changes nothing: a switch that fails here has cut and held nothing.
- `hand_over(old, new)`: `old` None means nothing serves (dead or unknown): nothing is released from it.
- `verify(mode)`: the mode serves, proved by a generation; per-mode URLs and credentials live here only.
- `wake(mode)`, `restore(mode, failed)`: undo a drain's pause; make `mode` serve again after a failure.
- `adopted(mode)`: the controller found `mode` serving; the mechanism's own bookkeeping follows.
- `mode_state(mode)`: a `ModeState` - serving, asleep (can be woken), starting (a start of it is under way),
  stopped (can be started), dead (its process is gone), unknown (the mechanism cannot tell). Recovery starts with
  what can serve soonest.
- `finish_start(mode)`: a start of `mode` under way (begun by a leader that was lost mid-switch) ends: returns once
  it is up, `SwitchFailed("start", ...)` if it fails or outlasts the start-up time; nothing is started or stopped.
- `recovery_order(dead)`: the modes to try when `dead` stopped serving, soonest first.

Kinds:
- `restart`: the GPU-host agent (`crossover servers agent`) stops the old server and starts the other; its
  start waits for a 1-token generation before it says `ready`.
- `sleep`: the engine's own endpoints, as its adapter (gateway/engines/adapters.py) names them - SGLang's memory saver
  (both servers started with `--enable-memory-saver --enable-weights-cpu-backup`: release the old server's
  memory, resume the new one's, continue it), vLLM's `/sleep` and `/wake_up` (`--enable-sleep-mode`). Never
  release a busy server (SGLang asserts idle): the gateway's own count and the server's own load must both
  say zero first. With `agent_url` set, every call that moves a server goes through the agent (which refuses a
  stale fencing token): its release pauses the server, waits for it to be idle and releases it, its resume
  resumes, continues and waits for a generation. Without it, straight to the engine (which knows no fence).
- `manual`: the operator moves the servers; the gateway only drains, holds and verifies.

The fence: `fence()` is the token of the lease this gateway holds on the GPU set now (None: no cluster), read
afresh for every call and carried by each one that moves the GPU set (gateway/engines/fence.py). The agent refuses a
token lower than one it accepted: that refusal raises `Fenced`, and whoever drives the switch steps down. A
replica whose lease ran out (`fence()` raises LeaseLost) sends nothing: `Fenced` too, the call never made.

Every call is bounded by a named timeout; every failure raises `SwitchFailed` naming the step.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum

import httpx
from pydantic import ValidationError

from crossover.gateway import engines
from crossover.gateway.config import SwitchingSettings
from crossover.gateway.engines import Fenced as FenceRefusal
from crossover.gateway.engines import ServerStatus, fence_headers, is_fenced
from crossover.gateway.modes import Mode, other

# Between polls of the agent's view of a server while it starts or stops.
AGENT_POLL_S = 0.1
# Between polls of a server's /v1/loads while waiting for it to become idle.
IDLE_POLL_S = 0.05
# How long an old server may take to finish the requests /pause_generation aborted.
IDLE_WAIT_S = 10.0
# A preflight's question to a server or the agent: a live one answers at once.
PREFLIGHT_TIMEOUT_S = 5.0


class SwitchFailed(Exception):
    """One step of a switch failed; `step` names it (preflight, drain, stop, start, release, resume, continue,
    verify). The message is for the log and /admin/state: it may name URLs, never shown to clients."""

    def __init__(self, step: str, message: str) -> None:
        super().__init__(f"{step}: {message}")
        self.step = step
        self.message = message


class AgentBusy(SwitchFailed):
    """The agent answered 409: another operation on the same GPU set is under way."""


class Fenced(SwitchFailed, FenceRefusal):
    """The agent answered 409 `fenced`: it accepted a newer lease's token, so this gateway no longer leads the GPU
    set. Not a switch to retry: the caller steps down."""


def no_fence() -> int | None:
    """A gateway without a cluster: its calls carry no token."""
    return None


def carried(fence: Callable[[], int | None], step: str) -> dict[str, str]:
    """The fence header of a call that moves the GPU set; Fenced (the call is not sent) if `fence` says this replica
    no longer holds the lease."""
    try:
        return fence_headers(fence())
    except FenceRefusal as exc:
        raise Fenced(step, str(exc)) from None


class ModeState(StrEnum):
    SERVING = "serving"
    ASLEEP = "asleep"
    STARTING = "starting"  # a start of it is under way: it serves once that ends
    STOPPED = "stopped"
    DEAD = "dead"
    UNKNOWN = "unknown"


@dataclass(frozen=True, slots=True)
class Target:
    """One mode's server as the gateway calls it: its URL, what every call carries (its SGLang --api-key), and
    what a control call (release, resume) carries instead (its --admin-api-key; the API key if it has none)."""

    url: str
    headers: dict[str, str] = field(default_factory=dict)
    control: dict[str, str] = field(default_factory=dict)
    # What it runs: which control calls put it to sleep and wake it, where its own load is read.
    engine: engines.EngineName = engines.DEFAULT_ENGINE


class Mechanism:
    """The manual mechanism, and the interface of the others (see the module docstring)."""

    name = "manual"

    def __init__(
        self,
        settings: SwitchingSettings,
        targets: dict[Mode, Target],
        client: httpx.AsyncClient,
        fence: Callable[[], int | None] = no_fence,
    ) -> None:
        self.settings = settings
        self.targets = targets
        self.client = client
        self.fence = fence
        # The GPU-host agent, if one is configured (restart always has one; sleep then pauses, releases, resumes and
        # continues through it, fenced there, and reads only the loads from SGLang itself).
        self.agent = AgentClient(settings, client, fence) if settings.agent_url else None

    async def preflight(self, old: Mode | None, new: Mode) -> None:
        """The operator moves the servers: nothing to check before the drain."""

    async def hand_over(self, old: Mode | None, new: Mode) -> None:
        """Take the GPU set from `old` (None: nothing serves) and give it to `new`."""

    async def verify(self, mode: Mode) -> None:
        target = self.targets[mode]
        problem = await engines.generate_once(
            self.client, target.url, headers=target.headers, timeout=self.settings.verify_timeout
        )
        if problem is not None:
            raise SwitchFailed("verify", problem)

    async def wake(self, mode: Mode) -> None:
        """After a failed switch: undo what the drain did to `mode` (a pause), if anything."""

    async def restore(self, mode: Mode, failed: Mode | None) -> None:
        """After a failed switch: make `mode` serve again; `failed` is the mode that did not come up."""

    async def mode_state(self, mode: Mode) -> ModeState:
        return ModeState.UNKNOWN

    async def finish_start(self, mode: Mode) -> None:
        """A start of `mode` under way ends (only a mechanism whose `mode_state` says STARTING has one to wait for)."""

    def adopted(self, mode: Mode) -> None:
        """The controller found `mode` serving (it generated): whatever was believed, it holds the GPU set."""

    def recovery_order(self, dead: Mode) -> tuple[Mode, ...]:
        return (other(dead), dead)

    async def _answers(self, mode: Mode) -> bool:
        """The server's HTTP side answers at all (a dead process refuses the connection)."""
        target = self.targets[mode]
        try:
            await self.client.get(target.url + "/health", timeout=PREFLIGHT_TIMEOUT_S, headers=target.headers)
        except httpx.HTTPError:
            return False
        return True


class AgentClient:
    """The GPU-host agent as a mechanism calls it: a server's status, and operations that carry the fence."""

    def __init__(self, settings: SwitchingSettings, client: httpx.AsyncClient, fence: Callable[[], int | None]) -> None:
        self.settings = settings
        self.client = client
        self.fence = fence
        self.headers = {"authorization": f"Bearer {settings.agent_token}"}

    async def call(self, method: str, path: str, step: str, timeout: float | None = None) -> ServerStatus:
        url = self.settings.agent_url + path
        timeout = timeout or self.settings.control_timeout
        # Status reads carry the token too: the agent raises its fence on them, so a new leader that only adopts
        # what serves shuts an old leader's late call out (servers/agent.py).
        headers = {**self.headers, **carried(self.fence, step)}
        try:
            async with asyncio.timeout(timeout):
                response = await self.client.request(method, url, headers=headers, timeout=timeout)
        except TimeoutError:
            raise SwitchFailed(step, f"the agent did not answer {method} {path} within {timeout:g} s") from None
        except httpx.HTTPError as exc:
            raise SwitchFailed(step, f"the agent at {self.settings.agent_url} failed: {exc!r}") from None
        if response.status_code == 409:
            message = f"the agent refused {method} {path}: {engines.error_message(response)}"
            raise (Fenced if is_fenced(409, _json(response)) else AgentBusy)(step, message)
        if response.status_code not in (200, 202):
            raise SwitchFailed(
                step,
                f"the agent answered {method} {path} with HTTP {response.status_code}: "
                f"{engines.error_message(response)}",
            )
        try:
            return ServerStatus.model_validate_json(response.content)
        except ValidationError as exc:
            raise SwitchFailed(step, f"the agent's answer to {method} {path} is not a server status: {exc}") from None

    def path(self, mode: Mode) -> str:
        return f"/servers/{self.settings.agent_servers[mode]}"

    async def status(self, mode: Mode, step: str = "status", timeout: float | None = None) -> ServerStatus:
        return await self.call("GET", self.path(mode), step, timeout)

    async def operate(self, mode: Mode, operation: str, timeout: float | None = None) -> ServerStatus:
        """POST an operation (start, stop, release, resume) on `mode`'s server; the step is named after it."""
        return await self.call("POST", f"{self.path(mode)}/{operation}", operation, timeout)


def _json(response: httpx.Response) -> object:
    try:
        return response.json()
    except ValueError:
        return None


class SleepMechanism(Mechanism):
    """Sleep/wake through the engine (or the agent, if any): pause/drain -> release old -> resume new -> continue
    new (the calls are the adapter's: SGLang release/resume/pause/continue; vLLM sleep, wake up, and no pause or
    continue)."""

    name = "sleep"

    def __init__(
        self,
        settings: SwitchingSettings,
        targets: dict[Mode, Target],
        client: httpx.AsyncClient,
        gateway_inflight: Callable[[Mode], int],
        fence: Callable[[], int | None] = no_fence,
    ) -> None:
        super().__init__(settings, targets, client, fence)
        self.gateway_inflight = gateway_inflight
        # Which servers hold no weights now. SGLang 0.5.23 dies (not errs) on a resume of memory it holds, so
        # only what this gateway released - or `crossover servers up` left released: the mode not started
        # with - is ever resumed, and nothing is released twice. A server found dead leaves the set: the
        # process that replaces it starts holding its memory.
        self.released = {other(settings.initial_mode)}

    def _engine(self, mode: Mode) -> engines.EngineAdapter:
        return engines.adapter(self.targets[mode].engine)

    async def _control(self, mode: Mode, call: engines.ControlCall | None) -> None:
        if call is None:
            return  # this engine has no such call: the one before it did its work
        target = self.targets[mode]
        # SGLang knows no fence; the header costs nothing and says who sent the call in its access log.
        headers = {**target.control, **carried(self.fence, call.name)}
        try:
            await engines.control(self.client, target.url, call, headers=headers, timeout=self.settings.control_timeout)
        except engines.EngineError as exc:
            raise SwitchFailed(call.name, str(exc)) from None

    async def _release(self, mode: Mode) -> None:
        if self.agent is not None:
            await self.agent.operate(mode, "release")
        else:
            await self._control(mode, self._engine(mode).release)
        self.released.add(mode)

    async def _serve(self, mode: Mode) -> None:
        """Resume `mode` if it is released, then continue it. The agent's resume does both (and checks what it
        holds itself, so it may be asked either way), and waits for a generation: the switch's timeout bounds it."""
        if self.agent is not None:
            await self.agent.operate(mode, "resume", self.settings.switch_timeout)
            self.released.discard(mode)
            return
        if mode in self.released:
            await self._control(mode, self._engine(mode).resume)
            self.released.discard(mode)
        await self._control(mode, self._engine(mode).resume_generation)

    async def server_load(self, mode: Mode) -> int:
        """Running + waiting requests the server itself reports (other clients' included)."""
        target = self.targets[mode]
        try:
            return await self._engine(mode).server_load(
                self.client, target.url, headers=target.headers, timeout=self.settings.control_timeout
            )
        except engines.EngineError as exc:
            raise SwitchFailed("release", f"{exc}: cannot check that the server is idle") from None

    async def preflight(self, old: Mode | None, new: Mode) -> None:
        if self.agent is not None:
            await self.agent.status(new, "preflight", PREFLIGHT_TIMEOUT_S)  # the agent answers and knows it
        if not await self._answers(new):
            self.released.discard(new)
            raise SwitchFailed("preflight", f"the {new} server at {self.targets[new].url} does not answer")

    async def _sleeping(self, mode: Mode) -> bool | None:
        """What the server says of its sleep (vLLM's /is_sleeping), which beats what this gateway believes."""
        target = self.targets[mode]
        asleep = await self._engine(mode).sleeping(
            self.client, target.url, headers=target.headers, timeout=PREFLIGHT_TIMEOUT_S
        )
        if asleep is not None:
            (self.released.add if asleep else self.released.discard)(mode)
        return asleep

    async def mode_state(self, mode: Mode) -> ModeState:
        if not await self._answers(mode):
            self.released.discard(mode)
            return ModeState.DEAD
        await self._sleeping(mode)
        return ModeState.ASLEEP if mode in self.released else ModeState.SERVING

    async def verify(self, mode: Mode) -> None:
        # A sleeping vLLM would hold the verify generation until it wakes (the whole verify timeout).
        if await self._sleeping(mode):
            raise SwitchFailed("verify", f"the {mode} server at {self.targets[mode].url} says it is asleep")
        await super().verify(mode)

    async def wake(self, mode: Mode) -> None:
        if self.agent is not None:
            await self._serve(mode)  # the agent's resume continues it (and resumes it, if it was released)
        else:
            await self._control(mode, self._engine(mode).resume_generation)

    def adopted(self, mode: Mode) -> None:
        # One GPU set: the mode that serves holds it, so the other's memory is released (or it is dead, and the
        # process that replaces it starts holding its own - then a resume is refused, not sent twice).
        self.released = {other(mode)}

    async def _wait_idle(self, mode: Mode) -> None:
        """Both counts at zero (the gateway's and the server's), or SwitchFailed: never release a busy server."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + IDLE_WAIT_S
        paused = False
        while True:
            # Through the agent, its release pauses the server and waits for it to be idle - behind the fence, so a
            # stale leader cannot abort the requests of the server the new leader serves from: only the gateway's
            # own count is waited for here.
            gateway = self.gateway_inflight(mode)
            server = await self.server_load(mode) if self.agent is None else 0
            if not gateway and not server:
                return
            if gateway == 0 and not paused:
                # Requests the gateway did not send (other clients): SGLang's pause aborts them.
                if self._engine(mode).pause is None:
                    return  # vLLM's sleep (mode "abort") ends them itself
                await self._control(mode, self._engine(mode).pause)
                paused = True
            if loop.time() >= deadline:
                raise SwitchFailed(
                    "release",
                    f"the {mode} server is not idle ({gateway} requests in flight through the gateway, "
                    f"{server} running or waiting on the server): it is never released busy",
                )
            await asyncio.sleep(IDLE_POLL_S)

    async def hand_over(self, old: Mode | None, new: Mode) -> None:
        if old is not None and old not in self.released and not await self._answers(old):
            self.released.discard(old)
            old = None  # it died (during the drain, say): a dead server holds no memory to release
        if old is not None and old not in self.released:
            await self._wait_idle(old)
            await self._release(old)
        elif old is None:
            await self._release_if_idle(other(new))  # from no serving mode: whatever the other holds
        await self._serve(new)

    async def restore(self, mode: Mode, failed: Mode | None) -> None:
        if failed is not None and failed != mode:
            # Whatever the failed mode holds must leave the GPUs first; it has served nothing yet.
            await self._release_if_idle(failed)
        await self._serve(mode)

    async def _release_if_idle(self, mode: Mode) -> None:
        if mode in self.released:
            return
        try:
            if not self.gateway_inflight(mode) and not await self.server_load(mode):
                await self._release(mode)
        except Fenced:
            raise  # not this gateway's GPU set any more: nothing after this may run
        except SwitchFailed:
            pass  # a dead server holds no memory; a live busy one is reported by the resume that follows


class RestartMechanism(Mechanism):
    """A restart through the GPU-host agent: stop the old server, start the other, wait until it is ready."""

    name = "restart"

    async def status(self, mode: Mode, step: str = "status", timeout: float | None = None) -> ServerStatus:
        return await self.agent.status(mode, step, timeout)

    async def preflight(self, old: Mode | None, new: Mode) -> None:
        # The agent answers and knows both servers; the target is not in the middle of another operation.
        for mode in {new} | ({old} if old is not None else set()):
            status = await self.status(mode, "preflight", PREFLIGHT_TIMEOUT_S)
            if mode == new and status.state == "stopping":
                raise SwitchFailed("preflight", f"server {status.name!r} is stopping: another operation is under way")

    async def mode_state(self, mode: Mode) -> ModeState:
        try:
            status = await self.status(mode, "status", PREFLIGHT_TIMEOUT_S)
        except SwitchFailed:
            return ModeState.UNKNOWN
        return {
            "ready": ModeState.SERVING,
            "released": ModeState.ASLEEP,
            "starting": ModeState.STARTING,
            "failed": ModeState.DEAD,
        }.get(status.state, ModeState.STOPPED)

    def recovery_order(self, dead: Mode) -> tuple[Mode, ...]:
        # Either way it is one start; restarting the dead mode keeps the mode the load called for.
        return (dead, other(dead))

    async def _until(
        self, mode: Mode, wanted: set[str], step: str, timeout: float, *, during: set[str] | None = None
    ) -> None:
        """Poll the agent until `mode`'s server is in a `wanted` state; SwitchFailed once it failed, left the states
        `during` (None: any) or `timeout` passed."""
        name = self.settings.agent_servers[mode]
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            status = await self.status(mode)
            if status.state in wanted:
                return
            if status.state == "failed":
                raise SwitchFailed(step, f"the agent reports server {name!r} failed: {status.error or 'no reason'}")
            if during is not None and status.state not in during:
                raise SwitchFailed(step, f"server {name!r} is {status.state}: it left {', '.join(sorted(during))}")
            if loop.time() >= deadline:
                raise SwitchFailed(step, f"server {name!r} is still {status.state} after {timeout:g} s")
            await asyncio.sleep(AGENT_POLL_S)

    async def stop(self, mode: Mode) -> None:
        status = await self.status(mode)
        if status.state == "stopped":
            return
        if status.state != "stopping":
            try:
                await self.agent.operate(mode, "stop")
            except AgentBusy:
                # A start of it is under way (the agent takes one operation at a time): let it end, then stop.
                await self._until(mode, {"ready", "stopped", "failed"}, "stop", self.settings.switch_timeout)
                if (await self.status(mode)).state == "stopped":
                    return
                await self.agent.operate(mode, "stop")
        await self._until(mode, {"stopped"}, "stop", self.settings.control_timeout)

    async def start(self, mode: Mode) -> None:
        status = await self.status(mode)
        if status.state == "ready":
            return
        if status.state != "starting":
            await self.agent.operate(mode, "start")
        await self._until(mode, {"ready"}, "start", self.settings.switch_timeout)

    async def finish_start(self, mode: Mode) -> None:
        # Given the time any start is given (the start-up time), from now: when it began is not known here.
        await self._until(mode, {"ready"}, "start", self.settings.switch_timeout, during={"starting"})

    async def hand_over(self, old: Mode | None, new: Mode) -> None:
        # From no serving mode (old None) the other server may still hold the GPUs: stop it all the same.
        await self.stop(old if old is not None else other(new))
        await self.start(new)

    async def restore(self, mode: Mode, failed: Mode | None) -> None:
        if failed is not None and failed != mode:
            await self.stop(failed)  # one GPU set: the agent refuses (409) to start while the other runs
        await self.start(mode)


def make_mechanism(
    settings: SwitchingSettings,
    targets: dict[Mode, Target],
    client: httpx.AsyncClient,
    gateway_inflight: Callable[[Mode], int],
    fence: Callable[[], int | None] = no_fence,
) -> Mechanism:
    """`targets` per mode (URL and API key); `gateway_inflight(mode)`: the gateway's own count on that mode;
    `fence()`: the token of the lease this gateway holds on the GPU set (None: no cluster)."""
    if settings.mechanism == "restart":
        return RestartMechanism(settings, targets, client, fence)
    if settings.mechanism == "sleep":
        return SleepMechanism(settings, targets, client, gateway_inflight, fence)
    return Mechanism(settings, targets, client, fence)
