"""The fencing token: what makes a late call from a gateway that lost its lease on a GPU set harmless.

Every mutating call on a GPU set (the agent's start, stop, release and resume; the patched engine's gate) carries
`X-Crossover-Fence: N`, the token of the lease its sender holds. The resource remembers the highest token it has
accepted and refuses a lower one with 409 `fenced`: a replica paused past its lease, then resumed, cannot undo
what the replica that took the lease over has done. A call without the header is a gateway without a cluster, and
is accepted as before - so a replica of a cluster never sends one: once its lease may have run out it sends
nothing (`LeaseLost`, from `Cluster.token()`), even in the middle of a switch.

A token more than `MAX_FENCE_JUMP` above the highest accepted is refused too, with 403 `fence_jump` - not `fenced`,
which tells a gateway that a newer lease holder leads: no lease holder is that far ahead, and a resource that took
10^18-1 from anyone holding the agent's token would shut every cluster out for good. A resource with no token yet
takes any; an operator who means a larger jump allows it on the resource (`--fence-max-jump`).
"""

from __future__ import annotations

import re

FENCE_HEADER = "X-Crossover-Fence"
FENCED = "fenced"
FENCE_JUMP = "fence_jump"
# Far more lease changes than a resource misses in practice (each is one failover or restart of a replica, seconds
# apart), far fewer than would take a counter anywhere near the 18 digits a header may carry.
MAX_FENCE_JUMP = 10_000


def fence_headers(token: int | None) -> dict[str, str]:
    """The header a mutating call carries under the lease `token` (none without a cluster)."""
    return {} if token is None else {FENCE_HEADER: str(token)}


def parse_fence(value: str | None) -> int | None:
    """The token a call carries, or None; ValueError for a header that is not a non-negative integer."""
    if value is None:
        return None
    if not value.isascii() or not value.isdigit() or len(value) > 18:
        raise ValueError(f"{FENCE_HEADER} must be a non-negative integer of at most 18 digits, got {value[:40]!r}")
    return int(value)


class Fenced(Exception):
    """A resource refused a call with 409 `fenced`: it has accepted a newer token, so another replica holds the lease
    on the GPU set now. Whoever sent the call steps down; retrying with the same token can never succeed."""

    @property
    def highest(self) -> int | None:
        """The token the resource has accepted (None: it did not say): the store's counter is raised past it, so the
        next lease's token passes - after a store that lost its counter, not one lease per missing token."""
        return refused_highest(str(self))


class LeaseLost(Fenced):
    """A replica of a cluster that no longer holds the lease (by its own clock) was about to act on the GPU set: the
    call is not sent. Without a token it would pass as a gateway without a cluster's, which every fence lets
    through - a replica paused between two calls of a switch would stop or release what the new leader serves."""


def refusal(token: int, highest: int) -> str:
    """What a resource says when it refuses `token` (both tokens named, for the log on either side, and read back by
    `refused_highest`: the agent, the stand-in and the SGLang patch word it alike)."""
    return (
        f"fenced: this call carries token {token}, but token {highest} has been accepted since - a newer lease "
        "holder acts on this GPU set"
    )


_REFUSED = re.compile(r"fenced: this call carries token [0-9]{1,18}, but token ([0-9]{1,18}) has been accepted")


def refused_highest(text: str) -> int | None:
    """The highest token a refusal (`refusal`'s words, anywhere in `text`) says its resource accepted, or None."""
    found = _REFUSED.search(text)
    return int(found.group(1)) if found else None


def jumps_too_far(token: int, highest: int | None, max_jump: int) -> bool:
    """Whether `token` lies more than `max_jump` above `highest`, the highest accepted (None: none yet, anything goes;
    `max_jump` 0: no limit)."""
    return highest is not None and max_jump > 0 and token - highest > max_jump


def jump_refusal(token: int, highest: int, max_jump: int) -> str:
    """What a resource says when it refuses a jump (no `refusal()` wording: this is not a newer lease holder)."""
    return (
        f"fence_jump: this call carries token {token}, more than {max_jump} above {highest}, the highest this GPU set "
        "accepted - no lease holder is that far ahead; an operator who means it allows the jump (--fence-max-jump)"
    )


def is_fenced(status: int, body: object) -> bool:
    """Whether an answer is a fence's refusal: 409 with code `fenced` (OpenAI-style, the agent) or reason `fenced`
    (the patched engine's gate)."""
    if status != 409 or not isinstance(body, dict):
        return False
    error = body.get("error")
    return (isinstance(error, dict) and error.get("code") == FENCED) or body.get("reason") == FENCED
