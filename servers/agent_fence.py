"""The agent's side of the fencing token (gateway/engines/fence.py): the highest token each GPU accepted, on disk.

    fences = AgentFences(profile, state_dir)
    refused = fences.admit("plain", 7)   # None: accepted (and remembered); else a FenceRefusal (status, code, why)

A call on a server is checked against every GPU the server runs on, so servers that share GPUs share a fence
(a server with no GPUs, a stand-in on CPU, is its own). A call that passes raises the fence on all of its GPUs
before the operation begins, whatever the operation then does: the new lease holder's first call shuts the old
one out, even one refused as busy. The tokens are kept per GPU, not per server or per profile, so a profile that
regroups the GPUs later still remembers what each one accepted. A token lower than the highest is refused with 409
`fenced`; one more than `max_jump` above it with 403 `fence_jump` (a GPU with no token yet takes any). Every raise
is logged at INFO with the old and the new value.

They live in `<state dir>/fence.json`, written (and flushed to disk) before the call is answered, so an agent that
restarts does not forget a token and let a paused ex-leader back in. An operator lowers or clears them with
`crossover servers fence PROFILE --set gpu:0=N / --clear gpu:0` (`lower()`), which writes the same file under the
same lock (`fence.lock`); the running agent reads the file again before each check, so it takes the change at its
next call without a restart. Lowering is deliberately not on the agent's HTTP API: every gateway replica holds the
agent's token, and a fence any token holder can lower fences nothing - it takes write access to the state dir.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from crossover.gateway.engines import FENCE_JUMP, FENCED, MAX_FENCE_JUMP, jump_refusal, jumps_too_far, refusal
from crossover.servers.profile import Profile, Server

FENCE_FILE = "fence.json"
LOCK_FILE = "fence.lock"

logger = logging.getLogger(__name__)


class FenceFile(BaseModel):
    model_config = ConfigDict(extra="ignore")

    # "gpu:<id>" (or "server:<name>" for a server without GPUs) -> the highest token accepted on it.
    highest: dict[str, int] = Field(default_factory=dict)


@dataclass(frozen=True)
class FenceRefusal:
    """Why a call's token was refused: 409 `fenced` (a newer lease holder leads) or 403 `fence_jump` (too far up)."""

    status: int
    code: str
    message: str


def fence_keys(server: Server) -> list[str]:
    return [f"gpu:{gpu}" for gpu in server.gpus] or [f"server:{server.name}"]


@contextlib.contextmanager
def locked(directory: Path) -> Iterator[None]:
    """Serialise read-modify-write of fence.json between the agent and `crossover servers fence`. Held for one
    read and at most one small write: the agent takes it on its event loop, where it never waits long."""
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / LOCK_FILE, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def read_fences(directory: Path) -> dict[str, int]:
    """The tokens in `directory`'s fence.json ({} without one); RuntimeError if it cannot be read."""
    path = directory / FENCE_FILE
    try:
        return dict(FenceFile.model_validate_json(path.read_bytes()).highest)
    except FileNotFoundError:
        return {}
    except (OSError, ValidationError) as exc:
        # Starting with no memory of the tokens would let a stale gateway back in: refuse to start instead.
        raise RuntimeError(f"{path}: unreadable fencing tokens ({exc}); inspect it, then remove it") from None


def write_fences(directory: Path, highest: dict[str, int]) -> None:
    """Replace fence.json atomically and durably (file and rename both on disk before this returns)."""
    path = directory / FENCE_FILE
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w") as file:
        file.write(FenceFile(highest=highest).model_dump_json(indent=2))
        file.flush()
        os.fsync(file.fileno())
    os.replace(tmp, path)
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def lower(directory: Path, changes: dict[str, int | None]) -> dict[str, tuple[int, int | None]]:
    """Set each key's token to a lower one (None: clear it); returns key -> (old, new) for what changed. ValueError
    (nothing written) if a key has no token or a change would raise one: raising is the lease holders' business."""
    if not directory.is_dir():
        raise ValueError(f"{directory}: no such state dir (is --state-dir the agent's?)")
    with locked(directory):
        highest = read_fences(directory)
        for key, token in changes.items():
            if key not in highest:
                raise ValueError(f"{key} has no token: nothing to lower")
            if token is not None and token > highest[key]:
                raise ValueError(f"{key} is at {highest[key]}: {token} would raise it (only a lease holder does)")
        done = {key: (highest[key], token) for key, token in changes.items() if token != highest[key]}
        for key, (_, token) in done.items():
            if token is None:
                del highest[key]
            else:
                highest[key] = token
        if done:
            write_fences(directory, highest)
    return done


class AgentFences:
    def __init__(self, profile: Profile, directory: Path, *, max_jump: int = MAX_FENCE_JUMP) -> None:
        self.profile = profile
        self.directory = Path(directory)
        self.path = self.directory / FENCE_FILE
        self.max_jump = max_jump
        with locked(self.directory):
            self.highest = read_fences(self.directory)

    def current(self, name: str) -> int | None:
        """The highest token the server's GPU set accepted, or None (no token yet)."""
        tokens = [self.highest[key] for key in fence_keys(self.profile.server(name)) if key in self.highest]
        return max(tokens, default=None)

    def refresh(self) -> None:
        """Take what an operator wrote to fence.json since (`crossover servers fence`)."""
        with locked(self.directory):
            self._reread()

    def admit(self, name: str, token: int | None) -> FenceRefusal | None:
        """None if a call on `name` carrying `token` passes (a call without one always does), else why not."""
        if token is None:
            return None
        with locked(self.directory):
            self._reread()
            highest = self.current(name)
            if highest is not None and token < highest:
                return FenceRefusal(409, FENCED, refusal(token, highest))
            if highest is not None and jumps_too_far(token, highest, self.max_jump):
                return FenceRefusal(403, FENCE_JUMP, jump_refusal(token, highest, self.max_jump))
            keys = fence_keys(self.profile.server(name))
            if any(self.highest.get(key) != token for key in keys):
                self.highest.update(dict.fromkeys(keys, token))
                write_fences(self.directory, self.highest)
                logger.info("fence of %r (%s) raised from %s to %d", name, ", ".join(keys), highest, token)
        return None

    def _reread(self) -> None:
        # The file, not this agent's memory, is the record: an operator may have lowered it. Reading a few hundred
        # bytes per call that moves a GPU set costs nothing beside the call, and unlike an mtime or inode check it
        # cannot miss a change made within one timestamp tick.
        try:
            on_disk = read_fences(self.directory)
        except RuntimeError as exc:
            # Keep what this agent remembers (it rewrites the file at the next raise) rather than forget every token.
            logger.error("%s - keeping the tokens this agent remembers", exc)
            return
        if on_disk == self.highest:
            return
        for key in sorted(set(on_disk) | set(self.highest)):
            if on_disk.get(key) != self.highest.get(key):
                logger.warning(
                    "fence of %s changed on disk (an operator's `crossover servers fence`?): %s -> %s",
                    key,
                    self.highest.get(key),
                    on_disk.get(key),
                )
        self.highest = on_disk
