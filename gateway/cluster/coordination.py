"""What the replicas of one gateway must share, whichever way they share it: the seam between a gateway and its
cluster.

    coordination = make_coordination(settings, pools)    # factory.py: Solo without [cluster] redis_url, else Cluster
    await coordination.start(local, apply)   # local() -> Control now; apply(control) takes what another wrote
    await coordination.share()               # after a local change (a PUT): written for every member now
    await coordination.refresh()             # before an admin read: what another wrote since the last sync
    coordination.leader                      # may this process act on the GPU set (it holds an unexpired lease)
    coordination.connected                   # is the shared state reachable (no switch starts while it is not)
    coordination.fence()                     # the lease's token if this process holds it now (None: no cluster)
    coordination.token()                     # what a mutating call carries: fence(), or LeaseLost in a cluster
    coordination.step_down(why, highest)     # a resource refused our token (409 `fenced`): stop acting now
    coordination.caught_up()                 # have all the others applied what this one wrote, and said so
    coordination.view()                      # for /admin/state and crossover_cluster_*
    await coordination.stop()

What is shared:
- the control state (`Control`): the threshold, hysteresis and policy; in-engine's forced mode and pin; time-shared's
  mode, pin, phase and target as the leader publishes them, and a follower's PUT /admin/mode for the leader to run
  (`ModeRequest`), and the leader's answer to it (`ModeAnswer`). One versioned value, written only over the version
  its writer read (`Store.put_control` compares): a member writes the fields it changed onto the stored state, and
  if another member wrote first it re-reads and writes them onto that, so a leader publishing its phase and a
  follower carrying a PUT never lose each other's change. A member that joins adopts it, and a member that changed
  it while the store was unreachable writes its change when the store is back, so every member converges. Its
  `generation` counts the changes it descends from: a store restored with an older state (by a member that missed
  the newest) is written over.
- the lease: one member at a time acts on the GPU set (the switch controller's decisions and mechanism calls, the
  in-engine gates); each new acquisition gets a larger fencing token (gateway/engines/fence.py) that its calls carry.
  The token never goes back, whatever the store forgets: a resource that refuses one names the highest it accepted,
  and the member it refused raises the store's counter past that and keeps the lease under a new token at its next
  sync - a Redis restarted empty, or the workers of a host restarted, cost one refused call, not one lease per token.
- the in-flight counts: each member publishes its per-backend counts (expiring, so a dead member's vanish) and
  writes the others' sum onto each `Backend.elsewhere`, which the pools' load adds to its own count. Nothing per
  request asks the coordination anything. Beside the counts (key `VERSION_KEY`) each member says which control
  version it has applied: a leader that drains waits until every live member has seen the drain (it holds its
  own new requests from then on) and published what it still has in flight.

Another way of sharing (the workers of one host) implements `Store` only; `Cluster` runs the loop over it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable

from crossover.gateway.backends import Backend, Pools
from crossover.gateway.cluster.store import Control, Store, StoreUnavailable
from crossover.gateway.engines import LeaseLost

log = logging.getLogger("crossover.coordination")

# Beside the backend URLs in a member's published counts: the control version it has applied.
VERSION_KEY = "#version"
# A sync round (which renews the lease) that takes longer than this part of the lease: the store is too slow to hold
# one - renewed that late, with the sync interval on top (at most a third: config.py), a lease lapses between renewals.
SLOW_ROUND = 1 / 3
# Writes of the control state refused in one round because other members wrote first (each one re-reads).
WRITE_ATTEMPTS = 5


LocalControl = Callable[[], Control]
ApplyControl = Callable[[Control], Awaitable[None]]


class Solo:
    """A gateway that is its whole cluster: always the leader, no token, nobody else's requests. Costs nothing."""

    leader = True
    connected = True
    fenced = 0
    member = ""

    async def start(self, local: LocalControl, apply: ApplyControl) -> None:
        pass

    async def stop(self) -> None:
        pass

    async def share(self) -> None:
        pass

    async def refresh(self) -> None:
        pass

    def fence(self) -> int | None:
        return None

    def token(self) -> int | None:
        return None

    def step_down(self, why: str, highest: int | None = None) -> None:
        pass

    def caught_up(self) -> bool:
        return True

    def view(self) -> dict:
        return {"cluster": None}


class Cluster:
    """Members sharing a `Store`: a background loop every `sync_interval` renews or takes the lease, exchanges the
    control state and publishes/reads the in-flight counts. A member whose store stops answering keeps serving on
    what it last saw; once its lease may have expired it no longer acts."""

    def __init__(
        self,
        store: Store,
        pools: Pools,
        *,
        lease_s: float,
        interval_s: float,
        member: str | None = None,
        counted_as: str | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.store = store
        self.pools = pools
        self.lease_s = lease_s
        self.interval_s = interval_s
        # A dead member's counts are gone within a few syncs (never before a busy member publishes again).
        self.inflight_ttl_s = max(1.0, 4 * interval_s)
        self.member = member or f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        # Whose in-flight counts this member publishes: its own, or (one of a host's workers, gateway/cluster/host.py)
        # its host's, which every worker of the host publishes alike and which the shared table already counts exactly.
        self.counted_as = counted_as or self.member
        self.clock = clock
        self.connected = False
        self.problem: str | None = "not yet synced"
        self.fenced = 0
        self.rounds = 0  # syncs completed, reached or not: the clock a change's spread is measured on
        self.took_lease_round: int | None = None  # the round this member last took the lease in
        self.seen: Control | None = None  # the control state as last read from or written to the store
        self.heard: dict[str, int] = {}  # the control version each other live member has applied
        self._token: int | None = None
        self._valid_until = -1.0
        # The highest token a resource said it accepted when it refused ours, and the token it refused while the
        # store may still hold our lease under it: at the next sync the counter is raised past the one, and the
        # lease kept under a new token that passes (`_past_refused`).
        self._floor = 0
        self._refused: int | None = None
        # Fields changed here by a change the store did not take (its PUT answered 503): written when the store is
        # back unless another member's change to the same field was taken meanwhile - that one is newer.
        self._unshared: set[str] = set()
        self._slow = False  # the last round took too long to hold a lease through the store
        self._local: LocalControl | None = None
        self._apply: ApplyControl | None = None
        self._task: asyncio.Task | None = None
        self._lock = asyncio.Lock()

    # -- what the gateway asks ---------------------------------------------------------------------

    @property
    def leader(self) -> bool:
        return self._token is not None and self.clock() < self._valid_until

    def fence(self) -> int | None:
        return self._token if self.leader else None

    def token(self) -> int:
        """The token a mutating call on the GPU set carries now; LeaseLost once this member's lease may have run
        out: a call without a token would pass every fence, so it is not sent at all."""
        token = self.fence()
        if token is None:
            raise LeaseLost(f"{self.member} does not hold the GPU set's lease (any more): the call is not sent")
        return token

    def step_down(self, why: str, highest: int | None = None) -> None:
        """A resource refused this member's token, having accepted `highest` (None: it did not say)."""
        if highest is not None and highest > self._floor:
            self._floor = highest
        if self._token is None:
            return
        log.warning("stepping down as the GPU set's leader (token %d): %s", self._token, why)
        self.fenced += 1
        self._refused, self._token = self._token, None

    def caught_up(self) -> bool:
        """Every other live member has applied the control state as this one last wrote it (and published its
        counts since). False while this one has a change not yet written."""
        seen = self.seen
        if seen is None or self._local is None or not self._local().same(seen):
            return False
        return all(version >= seen.version for version in self.heard.values())

    def view(self) -> dict:
        return {
            "cluster": {
                "member": self.member,
                "role": "leader" if self.leader else "follower",
                "fence": self.fence(),
                "connected": self.connected,
                "problem": self.problem,
                "control_version": self.seen.version if self.seen else None,
                "sync_rounds": self.rounds,
                "fenced": self.fenced,
            }
        }

    # -- lifespan ----------------------------------------------------------------------------------

    async def start(self, local: LocalControl, apply: ApplyControl) -> None:
        self._local, self._apply = local, apply
        await self._sync()  # serve on the cluster's state from the first request, if the store answers
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        token, self._token = self._token, None
        if token is not None:
            with contextlib.suppress(StoreUnavailable):
                await self.store.release(self.member, token)  # the next leader need not wait out the lease
        await self.store.close()

    async def share(self) -> None:
        """Write a local change now, within `lease_s` (a PUT's answer waits for it); StoreUnavailable if it could
        not be (it is written when the store is back, unless overtaken: `_not_overtaken`)."""
        try:
            async with asyncio.timeout(self.lease_s):
                async with self._lock:
                    await self._control()
        except (StoreUnavailable, TimeoutError) as exc:
            if self.seen is not None and self._local is not None:
                self._unshared |= self._local().changes(self.seen).keys()
            why = str(exc) or f"the cluster's store did not take the change within {self.lease_s:g} s"
            raise StoreUnavailable(why) from None

    async def refresh(self) -> None:
        """Before an admin read: take what another member wrote since the last sync, so a GET right after a PUT's
        200 on another replica (or worker) reads it. Never raises: a store that does not answer leaves the last
        state, which the loop reports."""
        try:
            async with asyncio.timeout(self.lease_s):
                async with self._lock:
                    await self._control()
        except Exception as exc:
            log.debug("refresh before an admin read failed: %r", exc)

    # -- the loop ----------------------------------------------------------------------------------

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self._sync()
            except Exception:  # a bug in one round must not end the membership
                log.exception("cluster sync failed")

    async def _sync(self) -> None:
        async with self._lock:
            began = self.clock()
            try:
                await self._lease()
                await self._control()
                await self._counts()
            except StoreUnavailable as exc:
                self._unreachable(str(exc))
                return
            except Exception as exc:  # nothing a store answers may end the membership or the start-up
                problem = f"internal: {exc!r}"[:200]
                if problem != self.problem:
                    log.exception("cluster sync failed")
                self._unreachable(problem)
                return
            took = self.clock() - began
            self._slow = took > self.lease_s * SLOW_ROUND
            if self._slow:
                self._too_slow(took)
                return
            if not self.connected and self.rounds:
                log.info("cluster store reachable again")  # not at start-up: it was never unreachable then
            # Connected, and still something to say: keys that do not read as they should (left out meanwhile).
            malformed = self.store.malformed
            self.connected, self.problem = True, "; ".join(malformed.values()) if malformed else None
            self.rounds += 1

    def _too_slow(self, took: float) -> None:
        """A round that completed, too slowly for the lease: renewed this late, a lease lapses between renewals and
        passes from member to member. A member takes no lease through such a store (a leader keeps the one it
        holds while its renewals still arrive in time: its own clock ends it otherwise), and none says it is
        connected, so no switch starts on it."""
        self._unreachable(
            f"the cluster's store is too slow to hold a lease: a sync round took {took:.3g} s, more than "
            f"{SLOW_ROUND:.2g} of the lease ({self.lease_s:g} s)"
        )

    def _unreachable(self, problem: str) -> None:
        """A round that did not complete: serve on the last state seen, and say why (logged when it changes)."""
        if self.connected or self.problem != problem:
            log.warning("cluster store unreachable: %s; serving on the last state seen", problem)
        self.connected, self.problem = False, problem
        self.rounds += 1

    async def _lease(self) -> None:
        asked = self.clock()  # the lease runs from before the store heard us: never longer than the store's
        if self._floor and await self._past_refused(asked):
            return
        if self._token is not None:
            if await self.store.renew(self.member, self._token, self.lease_s):
                self._valid_until = asked + self.lease_s
                return
            log.warning("lost the GPU set's lease (token %d)", self._token)
            self._token = None
        if self._slow:
            return  # the lease would lapse before the next renewal: taken once a round is quick again
        token = await self.store.acquire(self.member, self.lease_s)
        if token is not None:
            self._took(token, asked)

    def _took(self, token: int, asked: float) -> None:
        self._token, self._valid_until = token, asked + self.lease_s
        self.took_lease_round = self.rounds
        log.info("took the cluster's lease (token %d): this member acts for the cluster", token)

    async def _past_refused(self, asked: float) -> bool:
        """A resource refused our token naming a higher one: no token this store hands out below that can pass.
        The counter is raised past it; then, if the store still holds the lease under the refused token (it
        counted lower than the GPU set has seen: restarted empty, or a host's workers restarted), this member keeps
        it under a new token that passes - and so runs again what the refusal stopped. Where another member took
        the lease since, this changes nothing for it. True if this member leads again."""
        floor, refused = self._floor, self._refused
        await self.store.raise_fence(floor)
        log.warning(
            "the cluster's fencing token counter raised past %d, the token a resource of the GPU set accepted "
            "(the store counted lower: restarted empty, or a host's workers restarted?)",
            floor,
        )
        self._floor = 0 if self._floor == floor else self._floor
        self._refused = None
        token = None if refused is None else await self.store.retoken(self.member, refused, self.lease_s)
        if token is None:
            return False
        self._took(token, asked)
        return True

    async def _control(self) -> None:
        local, seen = self._local(), self.seen
        if seen is not None and not local.same(seen):
            await self._write(seen, local)  # changed here since: most often nobody else wrote meanwhile
            return
        stored = await self.store.get_control()
        if stored is None or self._older(stored):
            await self._write(stored, local)
            return
        # A Redis that came back empty counts versions again: a version seen before may hold another state.
        if seen is None or stored.version != seen.version or not stored.same(seen):
            self.seen = stored
            await self._take(stored, local)

    async def _write(self, stored: Control | None, local: Control) -> None:
        """Write what changed here since `self.seen` onto `stored` (as last read) if nobody wrote since; else onto
        what they wrote, read again. Gives up after WRITE_ATTEMPTS (the next round tries again)."""
        seen = self.seen
        changes = local.changes(seen) if seen is not None else {}
        for _ in range(WRITE_ATTEMPTS):
            if stored is None or self._older(stored):
                # The first member (its configuration starts the cluster), a store that lost its state (a Redis
                # restarted empty) or one restored older by a member that missed a change: what this member knows
                # is the newest.
                known = seen.generation if seen is not None else 0
                control = local.model_copy(update={"generation": known + (1 if changes else 0)})
            elif changes := self._not_overtaken(changes, stored):
                control = stored.model_copy(update={**changes, "generation": stored.generation + 1})
            else:  # another member wrote first, and this one has nothing of its own to add: take theirs
                self.seen, self._unshared = stored, set()
                await self._take(stored, local)
                return
            version = await self.store.put_control(control, stored.version if stored is not None else 0)
            if version is not None:
                self.seen, self._unshared = control.model_copy(update={"version": version}), set()
                await self._take(self.seen, local)
                return
            stored = await self.store.get_control()
        log.warning("the cluster's control state changed under %d writes in a row: writing next round", WRITE_ATTEMPTS)

    def _not_overtaken(self, changes: dict, stored: Control) -> dict:
        """`changes` less those the store refused (`_unshared`) to a field another member changed since this one
        last read it: the cluster orders changes by when the store took them, not by when a member reconnected."""
        seen = self.seen
        overtaken = {
            name
            for name in self._unshared & changes.keys()
            if seen is None or getattr(stored, name) != getattr(seen, name)
        }
        if overtaken:
            log.warning(
                "dropped what this replica changed while the cluster's store did not answer (%s): another replica "
                "changed it since, and the store took that",
                ", ".join(f"{name}={changes[name]!r}" for name in sorted(overtaken)),
            )
        return {name: value for name, value in changes.items() if name not in overtaken}

    def _older(self, stored: Control) -> bool:
        return self.seen is not None and stored.generation < self.seen.generation

    async def _take(self, control: Control, local: Control) -> None:
        """Apply what other members wrote (if anything), keeping what changed here since `local` was read: that is
        not in the store yet (the next write carries it)."""
        if control.same(local):
            return
        since = self._local().changes(local)
        try:
            await self._apply(control.model_copy(update=since))
        except Exception:  # one bad state must not end the membership (the next change applies)
            log.exception("applying the cluster's control state (version %d) failed", control.version)

    async def _counts(self) -> None:
        backends = self.pools.all()
        counts = {count_key(backend): self.pools.count(backend) for backend in backends}
        counts[VERSION_KEY] = self.seen.version if self.seen is not None else 0
        await self.store.publish(self.counted_as, counts, self.inflight_ttl_s)
        members = await self.store.inflight()
        elsewhere: Counter[str] = Counter()
        heard: dict[str, int] = {}
        for member, published in members.items():
            if member != self.counted_as:
                heard[member] = published.pop(VERSION_KEY, 0)
                elsewhere.update(published)
        self.heard = heard
        for backend in backends:
            backend.elsewhere = elsewhere[count_key(backend)]


def count_key(backend: Backend) -> str:
    """A backend's published count, by pool and URL: one server may sit in both pools (config.py), each pool
    counting its own requests."""
    return f"{backend.pool} {backend.url}"


Coordination = Solo | Cluster
