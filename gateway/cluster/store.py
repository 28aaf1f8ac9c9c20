"""What members share, and the `Store` they share it through: the versioned control state, the lease and its token,
the in-flight counts. `Cluster` (coordination.py) runs the loop over a store; the Redis store (redis_store.py) and
the host's (host_store.py) implement it.
"""

from __future__ import annotations

from typing import Any, Protocol

from pydantic import BaseModel, ConfigDict

from crossover.gateway.modes import Mode


class ModeRequest(BaseModel):
    """A PUT /admin/mode taken by a member that does not hold the lease, carried to the one that does."""

    model_config = ConfigDict(frozen=True)

    id: str
    mode: Mode | None = None
    pin: bool | None = None
    # The member that took the PUT (for the leader's log: whose request it runs).
    member: str = ""


class ModeAnswer(BaseModel):
    """What the leader made of a carried `ModeRequest` (`id`): the status its own PUT /admin/mode would have had
    (202 switching, 200 nothing to switch, 409/429 refused), and why it refused."""

    model_config = ConfigDict(frozen=True)

    id: str
    status: int
    error: str | None = None


class Control(BaseModel):
    """The cluster-wide control state. `version` is the store's (0: never stored); `generation` counts the changes
    it descends from, so a state that went back (a store restored by a member that missed the newest change) is
    told from a newer one. `same` compares the state alone."""

    model_config = ConfigDict(frozen=True)

    threshold: int
    hysteresis: int
    policy: str
    # service_tier's room per speculative server (None: a member from before it was shared; each keeps its own).
    priority_headroom: int | None = None
    # Spillover's share of the load for the speculative pool (None: a member from before it was shared).
    spillover_share: float | None = None
    # A forced mode (in-engine: every gate; time-shared: the pin) and whether it is pinned.
    forced_mode: Mode | None = None
    pinned: bool = False
    # Time-shared, as the leader publishes them: the mode that serves, the switch phase, the mode switched to.
    mode: Mode | None = None
    phase: str | None = None
    target: Mode | None = None
    mode_request: ModeRequest | None = None
    mode_answer: ModeAnswer | None = None
    # An operator's PUT /admin/threshold paused the adaptive controller (until PUT /admin/adaptive resumes it).
    adaptive_paused: bool = False
    # The adaptive controller's last decision and move as the leader (the one that decides) last shared them: what
    # every follower's /admin/state shows as `adaptive`.
    adaptive: dict[str, Any] | None = None
    # The operator switches the leader started: a follower that sees one applies the same rate limit from then.
    operator_switches: int = 0
    generation: int = 0
    version: int = 0

    def same(self, other: Control | None) -> bool:
        return other is not None and not self.changes(other)

    def changes(self, since: Control) -> dict:
        """The fields of the state (not its version or generation) that differ from `since`, with their values here."""
        return {
            name: getattr(self, name)
            for name in type(self).model_fields
            if name not in META and getattr(self, name) != getattr(since, name)
        }


META = frozenset({"version", "generation"})


class StoreUnavailable(Exception):
    """The store did not answer (down, cut off, too slow): the message says how."""


class StoreMalformed(StoreUnavailable):
    """The store answered with what cannot be the shared state (someone else's value under its keys): as untrusted as
    no answer; the message names the key."""


class Store(Protocol):
    """Where members share state; every call raises StoreUnavailable when the store does not answer (StoreMalformed
    when it answers with what cannot be the shared state)."""

    # Keys that did not read as they should at the last look, with why (left out, or the state not trusted).
    malformed: dict[str, str]

    async def get_control(self) -> Control | None:
        """The stored control state with its version; None if none was ever stored."""

    async def put_control(self, control: Control, expected: int) -> int | None:
        """Store `control` (its version ignored) if the stored version is still `expected` (0: none stored): the new
        version, larger than any before; None, storing nothing, if another member wrote since."""

    async def acquire(self, member: str, ttl_s: float) -> int | None:
        """Take the lease for `ttl_s` if nobody holds it: the new fencing token (larger than every earlier one)."""

    async def raise_fence(self, at_least: int) -> None:
        """Make every later token larger than `at_least` (a token a resource of the GPU set accepted: the store
        counted lower, having lost its counter). Never lowers it."""

    async def retoken(self, member: str, token: int, ttl_s: float) -> int | None:
        """If `member` still holds the lease under `token`: the same lease for `ttl_s` under a new token (larger than
        every earlier one), else None and nothing changed."""

    async def renew(self, member: str, token: int, ttl_s: float) -> bool:
        """Extend the lease `member` holds under `token` by `ttl_s`; False if it no longer holds it."""

    async def release(self, member: str, token: int) -> None:
        """Give the lease up if `member` still holds it under `token`."""

    async def publish(self, member: str, inflight: dict[str, int], ttl_s: float) -> None:
        """`member`'s in-flight count per backend URL, forgotten after `ttl_s` unless published again."""

    async def inflight(self) -> dict[str, dict[str, int]]:
        """Every live member's last published counts."""

    async def close(self) -> None: ...
