"""The in-engine topology: one pool of patched EAGLE-3 servers whose zero-step gate *is* the live threshold.

A server patched with patches/sglang-0.5.23 answers `GET/POST /speculative/adaptive`; `zero_steps_above_bs = N`
runs batches of more than N requests with zero draft steps. A vLLM server patched with patches/vllm-0.32.0 answers
`GET/POST /speculation_gate`, `zero_spec_tokens_above_batch_size = N` alike; each pool's engine adapter speaks its
route (gateway/engines/adapters.py). The gateway's threshold T means "speculate while a
request would join fewer than T others", i.e. a batch of at most T: so the gate is T itself (T = 0: never).

    sync = GateSync(pools, routing, client, timeout_s, interval_s, admin_key)
    await sync.start()              # refuses a backend without the gate or the admin key; gates every backend
    await sync.threshold_changed()  # after PUT /admin/threshold: dry run everywhere, then set and read back
    await sync.force("plain", pin=True)   # PUT /admin/mode: every engine's gate 0 until {"pin": false}
    sync.view()                     # each backend's gate, for /admin/state
    await sync.follow("plain", True)  # another replica changed the threshold or the mode (cluster/)

With replicas, only the one holding the lease writes the gates, under its fencing token; the others dry-run a
change they take (so a gate the engines refuse is still refused where it was asked for), then read the gates back:
two replicas never overwrite each other's gate. A change the dry run accepted is shared with the cluster before any
gate is written, so the last change to come is the one every gate ends on, even past a leader paused mid-write.
A gate counts as moved by someone else (`crossover_backend_gate_moved_total`, a warning) only when it moved to
another than the cluster's wanted gate: a follower that reads the leader's write of a change its own sync has not
brought yet takes the cluster's state first.

A forced mode (`PUT /admin/mode {"mode": ...}`) holds until the next threshold change; a pinned one until it is
unpinned (`{"pin": false}`, which hands the gate back to the threshold). A change of hysteresis alone moves no
gate and ends nothing.

Nothing an engine refuses takes the service down. A new gate is first sent as the patch's `dry_run` to every
backend that answers; if one refuses it (400 `rejected` / `invalid_body`), nothing is written, the previous gate
stays live everywhere and the change is refused with the engine's reason (`GateRefused`). A backend whose gate is
not the live one (a write failed, it was unreachable, a reply was malformed) stays in rotation on the gate it has
- except when it has no gate while one is wanted, or the gateway cannot know which it has: an engine that may
have restarted (seen unhealthy or ejected, its generation went back) reverts to its start-up gate, so it is held
out (`Backend.gate_pending`) until its gate is read back. Every call has its own timeout and the backends are
called concurrently; a backend that timed out is left to the background rounds, so it delays one change at most.
The background rounds write with the patch's compare-and-set (`expected_generation`), so a round that read
before an operator's change cannot undo it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter
from collections.abc import Awaitable
from typing import TypeVar

import httpx

from crossover.gateway.backends import Backend, Pools
from crossover.gateway.cluster import Coordination, Solo, StoreUnavailable
from crossover.gateway.config import PLAIN
from crossover.gateway.engines import (
    EngineError,
    Fenced,
    Gate,
    GateRejected,
    MalformedGate,
    NotPatched,
    adapter,
)
from crossover.gateway.topology.routing import Routing
from crossover.gateway.tracing import Tracing
from crossover.gateway.wire import bearer

logger = logging.getLogger("crossover.in_engine")
T = TypeVar("T")
# How often a background round looks whether its backend came back held out for its gate.
HELD_RECHECK_S = 0.05

# Why a gate call failed: the `kind` label of crossover_gate_sync_errors_total.
UNREACHABLE, MALFORMED, REFUSED, UNAUTHORIZED, FAILED = "unreachable", "malformed", "refused", "unauthorized", "failed"
FENCED = "fenced"  # another replica's newer token was accepted: this one stepped down


class GateRefused(Exception):
    """The engines refused a gate (the patch's dry run said no): the previous gate stays live; the message says
    which engines and why."""


class ControlUnauthorized(EngineError):
    """A control call got 401/403: the pool's admin credential is missing or wrong (refuses start-up)."""


class GateSync:
    """Keeps every backend's gate at the live threshold (see the module docstring)."""

    def __init__(
        self,
        pools: Pools,
        routing: Routing,
        client: httpx.AsyncClient,
        timeout_s: float,
        interval_s: float,
        admin_key: str | None = None,
        *,
        coordination: Coordination | None = None,
        tracing: Tracing | None = None,
    ) -> None:
        self.pools = pools
        self.tracing = tracing  # a span per gate move (gateway/tracing.py); None: off
        self.coordination = coordination if coordination is not None else Solo()
        self.routing = routing
        self.timeout_s = timeout_s
        self.interval_s = interval_s
        # The pool's admin credential for every gate call (the patch's POST demands SGLang's --admin-api-key).
        self.headers = bearer(admin_key)
        # Each backend's gate as last read back from the engine that runs now; absent: unknown (never read, or
        # it may have restarted since).
        self.gates: dict[str, Gate] = {}
        # Each backend's gate as last read, kept through outages: what a move or a restart is judged against.
        self._seen: dict[str, Gate] = {}
        self.errors: dict[str, str] = {}
        self.error_counts: Counter[tuple[str, str]] = Counter()  # (backend, kind)
        self.moved: Counter[str] = Counter()  # gates moved by someone else, per backend
        # The live gate: the one every answering engine accepted in a dry run (the rounds keep it on every engine),
        # and the threshold it came from (what a refused change puts back).
        self.wanted: int | None = routing.threshold
        self.live_threshold = routing.threshold
        self._client = client
        self._tasks: list[asyncio.Task] = []
        self._lock = asyncio.Lock()
        self._rechecked: dict[str, int] = {}  # the outage each backend's early read was for
        self._slow: set[str] = set()  # timed out last time: a change does not wait on them again
        # PUT /admin/mode: a mode forced on every engine (plain: gate 0; speculative: no gate) until the next
        # threshold change, or while pinned until unpinned; None: the gate follows the threshold.
        self.forced: str | None = None
        self.pinned = False

    def _candidate(self) -> int | None:
        """The gate the threshold and the forced mode ask for (live once the engines accept it)."""
        if self.forced is not None:
            return 0 if self.forced == PLAIN else None
        return self.routing.threshold

    def in_sync(self, backend: Backend) -> bool:
        gate = self.gates.get(backend.url)
        return gate is not None and gate.zero_steps_above_bs == self.wanted and backend.url not in self.errors

    # -- changes -------------------------------------------------------------------------------

    async def force(self, mode: str | None, *, pin: bool | None = None) -> list[str]:
        """PUT /admin/mode: force `mode` on every engine and/or pin (True) or unpin (False) the forced mode; unpinning
        with no mode hands the gate back to the threshold. The backends that failed, why; GateRefused (nothing
        changed) if an engine refuses the gate."""
        before = (self.forced, self.pinned)
        if pin is False:
            self.pinned = False
            if mode is None:
                self.forced = None
        if mode is not None:
            self.forced = mode
        if pin:
            self.pinned = True
        try:
            return await self.apply_threshold(operator=True)
        except GateRefused:
            self.forced, self.pinned = before
            raise

    async def follow(self, forced: str | None, pinned: bool) -> None:
        """Another replica changed the threshold (already in `routing`) or the forced mode: the leader writes the
        gate in the background (the caller is the cluster's sync, which must not wait on engines)."""
        self.forced, self.pinned = forced, pinned
        if self.coordination.leader:
            self._tasks = [task for task in self._tasks if not task.done()]
            self._tasks.append(asyncio.create_task(self._call_all(self.apply_threshold())))
            return
        self.wanted, self.live_threshold = self._candidate(), self.routing.threshold
        for backend in self.pools.speculative:
            self._hold(backend)

    async def _call_all(self, call: Awaitable[list[str]]) -> None:
        try:
            failed = await call
        except GateRefused as exc:  # the replica that took the change dry-ran it: the engines changed since
            logger.error("another replica's gate is refused here: %s", exc)
            return
        if failed:
            logger.warning("the cluster's gate is not yet on: %s", "; ".join(failed))

    async def threshold_changed(self) -> list[str]:
        """After PUT /admin/threshold moved the threshold: an unpinned forced mode ends; the gates follow. On
        GateRefused the threshold and the forced mode are back where they were."""
        before = (self.forced, self.pinned)
        if not self.pinned:
            self.forced = None
        try:
            return await self.apply_threshold(operator=True)
        except GateRefused:
            self.forced, self.pinned = before
            self.routing.update(threshold=self.live_threshold)
            raise

    async def apply_threshold(self, *, operator: bool = False) -> list[str]:
        """Dry-run the wanted gate everywhere, then set it and read it back: the backends that failed, why. An
        operator's change (a PUT here, not one followed from the cluster) is the cluster's before any gate is
        written (`_publish`)."""
        async with self._lock:
            wanted = self._candidate()
            answering = [b for b in self.pools.speculative if b.url not in self._slow]
            checks = await asyncio.gather(*(self._call(b, self._dry_run(b, wanted)) for b in answering))
            refusals = [reason for reason in checks if reason]
            if refusals:
                message = f"the engines refused the gate zero_steps_above_bs={wanted}: " + "; ".join(refusals)
                logger.warning("%s; the previous gate stays live", message)
                raise GateRefused(message)
            self.wanted, self.live_threshold = wanted, self.routing.threshold
            if operator:
                await self._publish()
            await asyncio.gather(
                *(self._sync(b, force=True) for b in self.pools.speculative if b.url not in self._slow)
            )
        return [f"{url}: {error}" for url, error in self.errors.items()]

    async def _publish(self) -> None:
        """Share a change the engines accepted in the dry run before the leader writes it, so the cluster orders
        changes by when they came: a leader paused while its write was in flight, then resumed, has its write
        refused by the engines' fence and must not publish its change after a newer one made meanwhile (the
        cluster's sync would carry it over, and the new leader write it). A store that does not answer now is
        the PUT's to report, after the writes (`Topology.share`)."""
        with contextlib.suppress(StoreUnavailable):
            await self.coordination.share()

    async def _dry_run(self, backend: Backend, wanted: int | None) -> str | None:
        """The engine's reason if it refuses `wanted`; None if it takes it or cannot say now (the rounds retry)."""
        try:
            await adapter(backend.engine).write_gate(
                self._client, backend.url, wanted, headers=self.headers, timeout=self.timeout_s, dry_run=True
            )
        except GateRejected as exc:
            if exc.refused:
                return str(exc)
            self._failed(backend, exc)
        except (httpx.HTTPError, TimeoutError, NotPatched) as exc:
            self._failed(backend, exc)
        return None

    async def _call(self, backend: Backend, call: Awaitable[T]) -> T | None:
        """`call` with what any gate call needs: any bug in handling an answer is logged, never ends the sync."""
        try:
            return await call
        except Exception as exc:  # one backend's odd answer must not end the sync for all
            logger.exception("gate call to %s failed unexpectedly", backend.url)
            self._failed(backend, exc)
            return None

    # -- start-up and the background rounds ----------------------------------------------------------

    async def start(self) -> None:
        """Refuse to serve without the patch (or the admin credential) on every backend; then gate every backend
        and keep it so."""
        for backend in self.pools.speculative:
            backend.gate_pending = self._candidate() is not None  # until its gate is read back
        results = await asyncio.gather(
            *(self._read(b) for b in self.pools.speculative),
            return_exceptions=True,
        )
        missing = [str(r) for r in results if isinstance(r, NotPatched)]
        if missing:
            raise NotPatched("topology 'in-engine' needs every backend patched: " + "; ".join(missing))
        self._refuse_unauthorized([str(r) for r in results if isinstance(r, GateRejected) and r.unauthorized])
        for backend, result in zip(self.pools.speculative, results, strict=True):
            if isinstance(result, Gate):
                self._known(backend, result)
        try:
            await self.apply_threshold()
        except GateRefused as exc:
            raise GateRefused(f"start-up refused: {exc}") from None
        self._refuse_unauthorized(
            [f"{url}: {error}" for url, error in self.errors.items() if (url, UNAUTHORIZED) in self.error_counts]
        )
        # One loop per backend: a hanging one delays only its own rounds.
        self._tasks = [asyncio.create_task(self._keep(backend)) for backend in self.pools.speculative]

    @staticmethod
    def _refuse_unauthorized(refused: list[str]) -> None:
        if refused:
            raise ControlUnauthorized(
                "the engines refused the gateway's control credential (set the pool's admin_api_key or "
                "admin_api_key_file to the engines' --admin-api-key; vLLM: VLLM_SPECULATION_GATE_ADMIN_KEY): "
                + "; ".join(refused)
            )

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _keep(self, backend: Backend) -> None:
        while True:
            # A backend back from an outage (ejected, or it failed a request) is held until its gate is read: read it
            # at once.
            waited = 0.0
            while waited < self.interval_s and not self._returned(backend):
                await asyncio.sleep(min(HELD_RECHECK_S, self.interval_s - waited))
                waited += HELD_RECHECK_S
            await self._call(backend, self._sync(backend, force=False))

    def _returned(self, backend: Backend) -> bool:
        """Back from an outage, its gate not read since (once per outage: a failing read waits for the rounds)."""
        if backend.healthy is not True or backend.gate_read_outages in (None, backend.outages):
            return False
        if self._rechecked.get(backend.url) == backend.outages:
            return False
        self._rechecked[backend.url] = backend.outages
        return True

    async def _sync(self, backend: Backend, *, force: bool) -> None:
        url = backend.url
        if backend.healthy is False or backend.gate_read_outages != backend.outages:
            # It may come back restarted, on its start-up gate: unknown until read again.
            self.gates.pop(url, None)
            self._hold(backend)
        seen = backend.outages  # an outage during the read may be a restart after it
        try:
            gate = await self._read(backend)
            self._slow.discard(url)
            if not self.coordination.leader and self._moved(url, gate) and gate.zero_steps_above_bs != self.wanted:
                # Most often the leader's write of a change this replica's sync has not brought yet (the leader
                # shares a change before it writes it): take the cluster's state before judging the move.
                await self.coordination.refresh()
            # The gate wanted now, not before the read: a change written while the read was out must not be undone
            # by writing the one it replaced (the compare-and-set below guards only writes made after the read).
            wanted = self.wanted
            self._known(backend, gate)
            backend.gate_read_outages = seen  # its gate is known again (held by _known if it is none)
            if not self.coordination.leader:
                # The replica holding the lease writes gates; this one reads them back (in_sync says whether).
                self.errors.pop(url, None)
                self._hold(backend)
                return
            if force or gate.zero_steps_above_bs != wanted:
                # Background rounds compare-and-set: a round that read before an operator's change cannot undo it.
                expected = None if force else gate.generation
                try:
                    await self._write(backend, wanted, expected)
                except GateRejected as exc:
                    if force or not exc.stale:
                        raise
                    # Written since this round read it: an operator's change, whose own sync writes and reads it
                    # back, or a hand's, which the next round sees. Not this round's failure to report (a PUT
                    # that collected it answered 502 for a gate it had set).
                    return
                before, gate = gate, await self._read(backend)
                if gate.generation > before.generation and gate.zero_steps_above_bs not in (wanted, self.wanted):
                    # Written again between this write and its read-back, to neither gate this gateway wants.
                    self._moved_by_someone_else(url, wanted, gate)
                self._known(backend, gate, written=True)
            if wanted != self.wanted:
                return  # a change came in meanwhile: it syncs this backend itself
            if gate.zero_steps_above_bs != wanted:
                raise GateRejected(f"{url} read back zero_steps_above_bs={gate.zero_steps_above_bs}")
        except (httpx.HTTPError, TimeoutError, NotPatched, GateRejected, Fenced) as exc:
            self._failed(backend, exc)
            return
        if url in self.errors:
            logger.info("gate of %s in sync again: %s", url, gate.zero_steps_above_bs)
        self.errors.pop(url, None)
        self._hold(backend)

    async def _write(self, backend: Backend, wanted: int | None, expected: int | None) -> None:
        was = self.gates[backend.url].zero_steps_above_bs
        logger.info("gate of %s: %s -> %s", backend.url, was, wanted)
        if self.tracing is None:
            await self._write_gate(backend, wanted, expected)
            return
        attributes = {
            "crossover.backend": backend.url,
            # None (no gate: speculation at every batch size) said as -1: an attribute has no null.
            "crossover.gate.from": -1 if was is None else was,
            "crossover.gate.to": -1 if wanted is None else wanted,
            "crossover.threshold": self.live_threshold,
        }
        if self.forced is not None:
            attributes["crossover.mode"] = self.forced
        with self.tracing.span("crossover.gate", attributes):
            await self._write_gate(backend, wanted, expected)

    async def _read(self, backend: Backend) -> Gate:
        """The backend's gate, through its engine's adapter (each engine speaks its own route)."""
        return await adapter(backend.engine).read_gate(
            self._client, backend.url, headers=self.headers, timeout=self.timeout_s
        )

    async def _write_gate(self, backend: Backend, wanted: int | None, expected: int | None) -> None:
        await adapter(backend.engine).write_gate(
            self._client,
            backend.url,
            wanted,
            headers=self.headers,
            timeout=self.timeout_s,
            expected_generation=expected,
            fence=self.coordination.token(),
        )

    def _moved(self, url: str, gate: Gate) -> bool:
        """`gate`, just read from `url`, was written since the last read and holds another value."""
        last = self._seen.get(url)
        return (
            last is not None
            and gate.generation > last.generation
            and gate.zero_steps_above_bs != last.zero_steps_above_bs
        )

    def _known(self, backend: Backend, gate: Gate, *, written: bool = False) -> None:
        """`gate` was just read from `backend` (`written`: right after the gateway wrote it): a generation that
        went back is a restart; a gate that moved to another than the cluster's wanted gate, not by this gateway, is
        someone else's change (a move to the wanted gate is the leader's write, on a replica that does not lead)."""
        url = backend.url
        last = self._seen.get(url)
        if last is not None and self._moved(url, gate):
            # A replica that does not lead may read the leader's write of a change older than its own, while its
            # own is under way; the leader writes only the wanted gate, so it judges a move whenever it reads one.
            judged = self.coordination.leader or not self._lock.locked()
            if not written and judged and gate.zero_steps_above_bs != self.wanted:
                self._moved_by_someone_else(url, last.zero_steps_above_bs, gate)
        elif last is not None and gate.generation < last.generation:
            logger.warning(
                "%s restarted (gate generation %d -> %d): re-gating it", url, last.generation, gate.generation
            )
        self.gates[url] = self._seen[url] = gate
        self._hold(backend)

    def _moved_by_someone_else(self, url: str, was: int | None, gate: Gate) -> None:
        self.moved[url] += 1
        logger.warning(
            "gate of %s moved by someone else: %s -> %s (generation %d); %s %s",
            url,
            was,
            gate.zero_steps_above_bs,
            gate.generation,
            "restoring" if self.coordination.leader else "the replica that leads restores",
            self.wanted,
        )

    def _hold(self, backend: Backend) -> None:
        """In rotation on the gate it has, unless it has none while one is wanted, or its gate is unknown."""
        gate = self.gates.get(backend.url)
        held = self.wanted is not None and (gate is None or gate.zero_steps_above_bs is None)
        if held and not backend.gate_pending:
            logger.warning(
                "backend %s held out of rotation: %s", backend.url, "gate unknown" if gate is None else "no gate"
            )
        backend.gate_pending = held

    def _failed(self, backend: Backend, exc: BaseException) -> None:
        url = backend.url
        kind = (
            UNREACHABLE
            if isinstance(exc, (httpx.HTTPError, TimeoutError))
            else MALFORMED
            if isinstance(exc, MalformedGate)
            else UNAUTHORIZED
            if isinstance(exc, GateRejected) and exc.unauthorized
            else REFUSED
            if isinstance(exc, GateRejected) and exc.refused
            else FAILED
        )
        if isinstance(exc, Fenced):
            kind = FENCED
            self.coordination.step_down(f"the gate of {url} refused our token: {exc}", exc.highest)
        if isinstance(exc, TimeoutError | httpx.TimeoutException):
            self._slow.add(url)
        message = str(exc) or f"{type(exc).__name__} (no answer within {self.timeout_s:g} s)"
        self.error_counts[(url, kind)] += 1
        if self.errors.get(url) != message:
            logger.warning("gate of %s not in sync (%s): %s; retrying every %g s", url, kind, message, self.interval_s)
        self.errors[url] = message
        self._hold(backend)

    def view(self) -> dict:
        return {
            "gate": {"zero_steps_above_bs": self.wanted, "forced_mode": self.forced, "pinned": self.pinned},
            "backend_gates": {
                backend.url: {
                    "zero_steps_above_bs": gate.zero_steps_above_bs if (gate := self.gates.get(backend.url)) else None,
                    "generation": gate.generation if gate else None,
                    "active_steps": gate.active_steps if gate else None,
                    "dp_groups": gate.groups if gate else None,
                    "in_sync": self.in_sync(backend),
                    "in_rotation": backend.usable,
                    "error": self.errors.get(backend.url),
                }
                for backend in self.pools.speculative
            },
        }
