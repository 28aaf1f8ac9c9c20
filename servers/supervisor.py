"""Start, verify, release and stop the servers of one profile; every step recorded in the state dir.

    supervisor = Supervisor(profile, state_dir)
    await supervisor.up()          # returns once every server answered a 1-token generation
    await supervisor.status()      # [ServerStatus, ...]
    await supervisor.down()        # SIGTERM, deadline, SIGKILL of each whole group; verified

Each server leads its own process group (SGLang's scheduler and detokenizer workers are its children; when
they survive a stop they keep GPU memory), logs to `<state dir>/logs/<name>.log`, and is ready only after a
real generation - `/health` alone says the HTTP server is up, not that the model answers. Servers outlive
the supervisor on purpose (`up` returns); the state file is how a later `down`, `status` or an agent finds
them.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from crossover.gateway import engines
from crossover.gateway.engines import TOKEN_ENV, ServerState, ServerStatus, sglang
from crossover.servers import fit
from crossover.servers.launch import LaunchError, launch_command, read_admin_key
from crossover.servers.process import spawn
from crossover.servers.profile import Profile, Server
from crossover.servers.state import ServerRecord, StateStore, record_alive, record_members, start_ticks

POLL_S = 0.1
PROBE_TIMEOUT = httpx.Timeout(connect=2.0, read=30.0, write=5.0, pool=2.0)
STATUS_TIMEOUT = httpx.Timeout(3.0)
RELEASE_TIMEOUT_S = 300.0
IDLE_WAIT_S = 10.0  # after a pause: how long the requests it aborted may take to leave before a release
KILL_GRACE_S = 10.0  # after SIGKILL: how long the kernel gets to take the group down


class SupervisorError(RuntimeError):
    """A server did not start, release, resume or stop as asked; the message says which and why."""


@dataclass
class StopReport:
    name: str
    was_running: bool
    killed: bool  # needed SIGKILL: something in the group ignored SIGTERM past the deadline
    survivors: list[int]


class Supervisor:
    def __init__(self, profile: Profile, state_dir: Path, *, log=None):
        self.profile = profile
        self.store = StateStore(state_dir, profile.name)
        self._log = log or (lambda message: None)
        self._children: dict[str, subprocess.Popen] = {}  # servers this process started: reaped on stop

    # --- one server -------------------------------------------------------------------------------------

    def record(self, name: str) -> ServerRecord | None:
        with self.store.locked():
            return self.store.load().get(name)

    def running(self, name: str) -> bool:
        record = self.record(name)
        return record is not None and record_alive(record)

    async def start(self, name: str) -> float:
        """Start `name` (unless it runs already) and wait for a generation; returns the seconds it took."""
        server = self.profile.server(name)
        existing = self.record(name)
        if existing is not None and record_alive(existing):
            if existing.released:
                return await self.resume(name)
            self._log(f"{name}: already running (pid {existing.pid}), checking it generates")
            await self._wait_generation(server, existing, time.monotonic() + server.ready_timeout_s)
            return existing.ready_s or 0.0
        if existing is not None:
            self.store.remove(name)
        command = launch_command(self.profile, server)
        try:
            argv = command.run_argv()  # the admin key, read now on this host; the log and the record show its file
            env = command.run_env()
        except LaunchError as exc:
            raise SupervisorError(f"{name}: {exc}") from None
        self.store.logs.mkdir(parents=True, exist_ok=True)
        log_path = self.store.logs / f"{name}.log"
        began = time.monotonic()
        with open(log_path, "ab") as log_file:
            log_file.write(f"\n=== crossover servers: starting {name}: {' '.join(command.argv)}\n".encode())
            log_file.flush()
            try:
                proc = spawn(
                    argv,
                    die_with_parent=False,
                    # The agent's token stays with the agent: a model server has no use for it.
                    env={**{k: v for k, v in os.environ.items() if k != TOKEN_ENV}, **env},
                    stdout=log_file,
                    stderr=log_file,
                    stdin=subprocess.DEVNULL,
                )
            except OSError as exc:
                raise SupervisorError(f"{name}: cannot run {command.argv[0]!r}: {exc.strerror}") from None
        self._children[name] = proc
        record = ServerRecord(
            pid=proc.pid,
            pgid=proc.pid,
            start_ticks=start_ticks(proc.pid),
            started_at=time.time(),
            log=str(log_path),
            url=server.url,
            argv=command.argv,
        )
        self.store.put(name, record)
        self._log(f"{name}: started pid {proc.pid}, log {log_path}")
        try:
            await self._wait_generation(server, record, began + server.ready_timeout_s)
        except SupervisorError:
            await self.stop(name)
            raise
        took = time.monotonic() - began
        self.store.update(name, ready_s=took)
        self._log(f"{name}: ready at {server.url} after {took:.1f} s (answered a 1-token generation)")
        return took

    async def stop(self, name: str) -> StopReport:
        """SIGTERM the group, wait up to the server's stop_timeout_s, SIGKILL what is left, verify."""
        server = self.profile.server(name)
        record = self.record(name)
        if record is None:
            return StopReport(name, was_running=False, killed=False, survivors=[])
        if not record_members(record):  # exited (or crashed) on its own: nothing to signal
            self.store.remove(name)
            self._children.pop(name, None)
            return StopReport(name, was_running=False, killed=False, survivors=[])
        self.store.update(name, stopping=True)
        self._signal(record.pgid, signal.SIGTERM)
        killed = False
        if not await self._group_gone(record, name, server.stop_timeout_s):
            self._log(f"{name}: still running {server.stop_timeout_s:g} s after SIGTERM, sending SIGKILL")
            self._signal(record.pgid, signal.SIGKILL)
            killed = True
            await self._group_gone(record, name, KILL_GRACE_S)
        survivors = record_members(record)
        if not survivors:
            self.store.remove(name)
            self._children.pop(name, None)
        return StopReport(name, was_running=True, killed=killed, survivors=survivors)

    async def release(self, name: str) -> None:
        """Sleep: hand the GPU memory back, weights to host memory. SGLang asserts it is idle, so generation is
        paused first (ending what it still holds, as a switch's drain does) and the release waits until nothing
        runs; resume continues it. Released already: nothing to do."""
        record = self._require(name)
        adapter = engines.adapter(self.profile.server(name).plays)
        if record.released:
            return
        if adapter.pause is not None:
            await self._admin(name, record, adapter.pause)
        await self._wait_idle(name, record, adapter)
        await self._admin(name, record, adapter.release)
        self.store.update(name, released=True)
        self._log(f"{name}: released (weights in host memory)")

    async def resume(self, name: str) -> float:
        """Wake: take the memory back (only if released: SGLang 0.5.23 dies on a resume of memory it holds), undo a
        pause a switch's drain left, and wait for a generation; returns the seconds it took."""
        server, record = self.profile.server(name), self._require(name)
        began = time.monotonic()
        adapter = engines.adapter(server.plays)
        if record.released:
            await self._admin(name, record, adapter.resume)
            self.store.update(name, released=False)
        if adapter.resume_generation is not None:
            await self._admin(name, record, adapter.resume_generation)
        # torch_memory_saver has corrupted weights after repeated cycles: verify before trusting a resume.
        await self._wait_generation(server, record, began + server.ready_timeout_s)
        took = time.monotonic() - began
        self._log(f"{name}: resumed and generating after {took:.1f} s")
        return took

    async def server_status(self, name: str) -> ServerStatus:
        server = self.profile.server(name)
        record = self.record(name)

        def status(
            state: ServerState, pid: int | None, last_start_s: float | None, error: str | None = None
        ) -> ServerStatus:
            return ServerStatus(
                name=name,
                role=server.role,
                state=state,
                pid=pid,
                url=server.url,
                last_start_s=last_start_s,
                error=error,
            )

        if record is None:
            return status("stopped", None, None)
        if record.stopping:
            if record_alive(record):
                return status("stopping", record.pid, record.ready_s)
            return status("stopped", None, record.ready_s)
        if not record_alive(record):
            return status("failed", None, record.ready_s, f"exited; see {record.log}")
        if record.released:
            return status("released", record.pid, record.ready_s)
        healthy = False
        async with httpx.AsyncClient(timeout=STATUS_TIMEOUT, trust_env=False) as client:
            with contextlib.suppress(httpx.HTTPError):
                healthy = (await client.get(f"{server.url}/health")).status_code == 200
        if healthy:
            return status("ready", record.pid, record.ready_s)
        if record.ready_s is None:
            return status("starting", record.pid, None)
        return status("failed", record.pid, record.ready_s, "running but /health is not 200")

    # --- the whole profile ------------------------------------------------------------------------------

    async def up(self) -> None:
        """Partitioned/adaptive: all at once. Time-shared restart: the initial mode only. Time-shared sleep:
        the others first, one by one, each released before the next starts (each sizes its KV cache from
        the memory free when it starts), then the initial mode."""
        profile = self.profile
        self.check_launchable()
        if profile.time_shared is None:
            await asyncio.gather(*(self.start(s.name) for s in profile.servers))
            return
        initial = profile.time_shared.initial
        if profile.time_shared.mechanism == "sleep":
            for server in profile.servers:
                if server.name != initial:
                    record = self.record(server.name)
                    if record is not None and record.released and record_alive(record):
                        continue
                    await self.start(server.name)
                    await self.release(server.name)
        else:
            for server in profile.servers:
                if server.name != initial and self.running(server.name):
                    raise SupervisorError(
                        f"{server.name} is running on the GPU set; `down` first, or switch through the agent"
                    )
        await self.start(initial)

    def check_launchable(self) -> None:
        """Every server's admin key file reads, before any server starts (SupervisorError naming the first)."""
        for server in self.profile.servers:
            try:
                launch_command(self.profile, server).run_argv()
            except LaunchError as exc:
                raise SupervisorError(f"{server.name}: {exc}") from None

    async def stop_started(self) -> list[StopReport]:
        """Stop only what this supervisor started (a failed `up` must not take down what ran before it)."""
        return list(await asyncio.gather(*(self.stop(name) for name in list(self._children))))

    async def down(self) -> list[StopReport]:
        reports = await asyncio.gather(*(self.stop(s.name) for s in self.profile.servers))
        return list(reports)

    async def status(self) -> list[ServerStatus]:
        return list(await asyncio.gather(*(self.server_status(s.name) for s in self.profile.servers)))

    def gpu_holders(self) -> list[fit.GpuProcess] | None:
        """Processes still holding memory on the profile's real GPUs (None: no nvidia-smi, or stand-ins)."""
        gpus = sorted({g for s in self.profile.servers if s.engine != "sim" for g in s.gpus})
        return fit.gpu_processes(gpus) if gpus else None

    # --- internals --------------------------------------------------------------------------------------

    def _require(self, name: str) -> ServerRecord:
        record = self.record(name)
        if record is None or not record_alive(record):
            raise SupervisorError(f"{name} is not running")
        return record

    def _signal(self, pgid: int, sig: signal.Signals) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, sig)

    def _reap(self, name: str) -> None:
        proc = self._children.get(name)
        if proc is not None:
            proc.poll()  # collects our own exited child, so it does not linger as a zombie

    async def _group_gone(self, record: ServerRecord, name: str, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while True:
            self._reap(name)
            if not record_members(record):
                return True
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(POLL_S)

    async def _wait_generation(self, server: Server, record: ServerRecord, deadline: float) -> None:
        """Poll until the server answers a real 1-token completion; fail early if its process is gone."""
        last = "no answer yet"
        async with httpx.AsyncClient(timeout=PROBE_TIMEOUT, trust_env=False) as client:
            while time.monotonic() < deadline:
                self._reap(server.name)
                if not record_alive(record):
                    raise SupervisorError(f"{server.name}: exited before it was ready; see {record.log}")
                try:
                    error = await _generate_once(client, server)
                except httpx.HTTPError as exc:
                    error = f"{type(exc).__name__}: {exc}"
                if error is None:
                    return
                last = error
                await asyncio.sleep(POLL_S)
        raise SupervisorError(
            f"{server.name}: no 1-token generation within {server.ready_timeout_s:g} s (last: {last}); see {record.log}"
        )

    async def _wait_idle(self, name: str, record: ServerRecord, adapter: engines.EngineAdapter) -> None:
        deadline = time.monotonic() + IDLE_WAIT_S
        async with httpx.AsyncClient(timeout=STATUS_TIMEOUT, trust_env=False) as client:
            while True:
                try:
                    load = await adapter.server_load(client, record.url, headers=None, timeout=STATUS_TIMEOUT.read)
                except engines.EngineError as exc:
                    raise SupervisorError(f"{name}: {exc}: cannot check that it is idle") from None
                if not load:
                    return
                if time.monotonic() >= deadline:
                    raise SupervisorError(
                        f"{name}: still {load} requests running or waiting {IDLE_WAIT_S:g} s after a pause: "
                        "it is never released busy"
                    )
                await asyncio.sleep(POLL_S)

    async def _admin(self, name: str, record: ServerRecord, call: engines.ControlCall) -> None:
        # SGLang's release/resume are ADMIN_OPTIONAL: with --admin-api-key they take that key and nothing else. The
        # file is read now, as at start, so a key rotated with the file is the one sent.
        key_file = self.profile.server(name).admin_api_key_file
        try:
            headers = {"Authorization": f"Bearer {read_admin_key(key_file)}"} if key_file else None
        except LaunchError as exc:
            raise SupervisorError(f"{name}: {exc}") from None
        async with httpx.AsyncClient(timeout=httpx.Timeout(RELEASE_TIMEOUT_S, connect=5.0), trust_env=False) as c:
            try:
                await engines.control(c, record.url, call, headers=headers, timeout=RELEASE_TIMEOUT_S)
            except sglang.SGLangError as exc:
                raise SupervisorError(str(exc)) from None


async def _generate_once(client: httpx.AsyncClient, server: Server) -> str | None:
    """None when the server generated one token, else why not (the gateway's verify, shared)."""
    timeout = PROBE_TIMEOUT.read or 30.0
    return await engines.generate_once(client, server.url, timeout=timeout, model=server.served_model_name)
