"""The in-engine topology: one pool of patched EAGLE-3 servers whose zero-step gate *is* the live threshold.

A server patched with patches/sglang-0.5.23 answers `GET/POST /speculative/adaptive`; `zero_steps_above_bs = N`
runs batches of more than N requests with zero draft steps. The gateway's threshold T means "speculate while a
request would join fewer than T others", i.e. a batch of at most T: so the gate is T itself (T = 0: never).

    sync = GateSync(pools, routing, client, client_timeout_s, interval_s)
    await sync.start()              # refuses a backend without the endpoint; sets the gate on every backend
    await sync.threshold_changed()  # after PUT /admin/threshold moved it: set, then read back, on every backend
    await sync.force("plain", pin=True)   # PUT /admin/mode: every engine's gate 0 until {"pin": false}
    sync.view()                     # each backend's gate, for /admin/state

A forced mode (`PUT /admin/mode {"mode": ...}`) holds until the next threshold change; a pinned one until it is
unpinned (`{"pin": false}`, which hands the gate back to the threshold). A change of hysteresis alone moves no
gate and ends nothing.

A backend whose gate is not the gateway's (it restarted: the gate reverts to its start-up config, generation 0;
or it was unreachable) is held out of rotation (`Backend.gate_pending`) until the gate is re-applied and read
back. The gateway's own health checks mark a restarting backend unhealthy first; a backend seen unhealthy is held
too, so it cannot take traffic between coming back and the next sync round.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import httpx

from crossover.gateway.config import PLAIN
from crossover.gateway.headers import bearer
from crossover.gateway.pools import Backend, Pools
from crossover.gateway.routing import Routing
from crossover.gateway.sglang import Gate, GateRejected, NotPatched, read_gate, write_gate

logger = logging.getLogger("crossover.in_engine")


class GateSync:
    """Keeps every backend's gate at the live threshold (see the module docstring)."""

    def __init__(
        self, pools: Pools, routing: Routing, client: httpx.AsyncClient, timeout_s: float, interval_s: float
    ) -> None:
        self.pools = pools
        self.routing = routing
        self.timeout_s = timeout_s
        self.interval_s = interval_s
        self.gates: dict[str, Gate] = {}
        self.errors: dict[str, str] = {}
        self._client = client
        self._task: asyncio.Task | None = None
        self._lock = asyncio.Lock()
        # PUT /admin/mode: a mode forced on every engine (plain: gate 0; speculative: no gate) until the next
        # threshold change, or while pinned until unpinned; None: the gate follows the threshold.
        self.forced: str | None = None
        self.pinned = False

    @property
    def wanted(self) -> int | None:
        if self.forced is not None:
            return 0 if self.forced == PLAIN else None
        return self.routing.threshold

    async def force(self, mode: str | None, *, pin: bool | None = None) -> list[str]:
        """PUT /admin/mode: force `mode` on every engine and/or pin (True) or unpin (False) the forced mode; unpinning
        with no mode hands the gate back to the threshold. The backends that failed, why."""
        if pin is False:
            self.pinned = False
            if mode is None:
                self.forced = None
        if mode is not None:
            self.forced = mode
        if pin:
            self.pinned = True
        return await self.apply_threshold()

    async def threshold_changed(self) -> list[str]:
        """After PUT /admin/threshold moved the threshold: an unpinned forced mode ends; the gates follow."""
        if not self.pinned:
            self.forced = None
        return await self.apply_threshold()

    async def start(self) -> None:
        """Refuse to serve without the patch on every backend; then set the gate everywhere and keep it."""
        client = self._client
        for backend in self.pools.speculative:
            backend.gate_pending = True
        results = await asyncio.gather(
            *(
                read_gate(client, b.url, headers=bearer(b.api_key), timeout=self.timeout_s)
                for b in self.pools.speculative
            ),
            return_exceptions=True,
        )
        # 400 to a read: patched, but no gate to move (not started with --speculative-adaptive, PP, ...).
        missing = [
            str(r) for r in results if isinstance(r, NotPatched) or (isinstance(r, GateRejected) and r.status == 400)
        ]
        if missing:
            raise NotPatched("topology 'in-engine' needs every backend patched: " + "; ".join(missing))
        await self.apply_threshold()
        self._task = asyncio.create_task(self._keep())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def apply_threshold(self) -> list[str]:
        """Set the live threshold as every backend's gate and read it back: the backends that failed, why."""
        async with self._lock:
            await asyncio.gather(*(self._sync(b, force=True) for b in self.pools.speculative))
        return [f"{url}: {error}" for url, error in self.errors.items()]

    async def _keep(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            async with self._lock:
                await asyncio.gather(*(self._sync(b, force=False) for b in self.pools.speculative))

    async def _sync(self, backend: Backend, *, force: bool) -> None:
        wanted = self.wanted
        if backend.healthy is False:
            backend.gate_pending = True  # it may come back restarted, with its start-up gate: write it again
        try:
            gate = await read_gate(self._client, backend.url, headers=bearer(backend.api_key), timeout=self.timeout_s)
            if force or backend.gate_pending or backend.healthy is False or gate.zero_steps_above_bs != wanted:
                if gate.zero_steps_above_bs != wanted:
                    logger.info("gate of %s: %s -> %s", backend.url, gate.zero_steps_above_bs, wanted)
                await write_gate(
                    self._client, backend.url, wanted, headers=bearer(backend.api_key), timeout=self.timeout_s
                )
                gate = await read_gate(
                    self._client, backend.url, headers=bearer(backend.api_key), timeout=self.timeout_s
                )
            if gate.zero_steps_above_bs != wanted:
                raise GateRejected(f"{backend.url} read back zero_steps_above_bs={gate.zero_steps_above_bs}")
        except (httpx.HTTPError, NotPatched, GateRejected, ValueError) as exc:
            backend.gate_pending = True
            self.errors[backend.url] = str(exc) or type(exc).__name__
            return
        self.gates[backend.url] = gate
        self.errors.pop(backend.url, None)
        if backend.healthy is not False:  # else again next round: it may still be on its way down
            backend.gate_pending = False

    def view(self) -> dict:
        return {
            "gate": {"zero_steps_above_bs": self.wanted, "forced_mode": self.forced, "pinned": self.pinned},
            "backend_gates": {
                backend.url: {
                    "zero_steps_above_bs": gate.zero_steps_above_bs if (gate := self.gates.get(backend.url)) else None,
                    "generation": gate.generation if gate else None,
                    "active_steps": gate.active_steps if gate else None,
                    "in_sync": not backend.gate_pending,
                    "error": self.errors.get(backend.url),
                }
                for backend in self.pools.speculative
            },
        }
