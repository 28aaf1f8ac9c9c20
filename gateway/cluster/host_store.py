"""The cluster store of one host's workers (`crossover serve --workers N` without `[cluster] redis_url`): the
`Store` of gateway/cluster/coordination.py over the host's folder and shared memory (gateway/cluster/host.py), so the
workers act as one gateway with no service beside them.

    store = HostStore(worker)           # in the worker, after the fork: its lease's lock is its own
    Cluster(store, pools, lease_s=..., interval_s=...)

- The control state is a file written whole (write-then-rename) under a lock, with its version, and only over the
  version its writer read (compared under the lock); the version is also in a cell of the shared memory, so a
  member's poll reads one number and opens the file only when it moved.
- The lease is an exclusive `flock` on a file: the kernel drops it when its holder dies, however it dies, and a
  follower's next poll takes it. Each acquisition writes a token one larger than the last beside it (under the
  lock, so tokens only grow; a new host's start at 1, and the first refusal by a resource that accepted more raises
  them past it, coordination.py). A holder keeps the lease while it lives (a lock has no expiry: a stopped worker keeps
  it until it runs again or dies - the supervisor kills one silent for `worker_timeout`, gateway/serve/workers.py).
- In-flight counts need nothing here: the shared table is exact and every worker reads it (`HostPools`), so the
  host publishes none and sees nobody else's (with `[cluster] redis_url` the workers are Redis members instead).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path

from crossover.gateway.cluster.host import Worker, write_bytes_atomically
from crossover.gateway.cluster.store import Control, StoreUnavailable

CONTROL = "control.json"
CONTROL_LOCK = "control.lock"
LEASE_LOCK = "lease.lock"
TOKEN = "lease.token"
TOKEN_LOCK = "lease.token.lock"


class HostStore:
    def __init__(self, worker: Worker) -> None:
        self.host = worker.host
        self.folder: Path = worker.host.folder
        self._seen: Control | None = None
        self._lease_fd: int | None = None
        self._token: int | None = None
        self.malformed: dict[str, str] = {}  # the host's files are its workers' own: nobody else writes them

    # -- control state -----------------------------------------------------------------------------

    async def get_control(self) -> Control | None:
        version = self.host.control_version()
        if version == 0:
            return None
        if self._seen is None or self._seen.version != version:
            try:
                self._seen = Control.model_validate_json((self.folder / CONTROL).read_bytes())
            except (OSError, ValueError) as exc:
                raise StoreUnavailable(f"the host's control state cannot be read: {exc}") from exc
        return self._seen

    async def put_control(self, control: Control, expected: int) -> int | None:
        try:
            with self._locked(CONTROL_LOCK, fcntl.LOCK_EX):
                if self.host.control_version() != expected:
                    return None  # another worker wrote since its writer read: it re-reads (coordination.py)
                version = expected + 1
                stored = control.model_copy(update={"version": version})
                write_bytes_atomically(self.folder / CONTROL, stored.model_dump_json().encode())
                self.host.set_control_version(version)
        except OSError as exc:
            raise StoreUnavailable(f"the host's control state cannot be written: {exc}") from exc
        self._seen = stored
        return version

    # -- the lease ---------------------------------------------------------------------------------

    async def acquire(self, member: str, ttl_s: float) -> int | None:
        if self._token is not None:
            return self._token
        fd = os.open(self.folder / LEASE_LOCK, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None  # another worker leads
        try:
            token = self._next_token()
        except StoreUnavailable:
            os.close(fd)  # drops the lock: a lease without a token is no lease
            raise
        self._lease_fd, self._token = fd, token
        return token

    async def retoken(self, member: str, token: int, ttl_s: float) -> int | None:
        if self._token != token:
            return None
        self._token = self._next_token()
        return self._token

    def _next_token(self) -> int:
        """One larger than every token handed out so far, written before it is used."""
        try:
            with self._locked(TOKEN_LOCK, fcntl.LOCK_EX):
                token = self._counted() + 1
                write_bytes_atomically(self.folder / TOKEN, str(token).encode())
        except (OSError, ValueError) as exc:
            raise StoreUnavailable(f"the host's lease token cannot be written: {exc}") from exc
        return token

    async def raise_fence(self, at_least: int) -> None:
        try:
            with self._locked(TOKEN_LOCK, fcntl.LOCK_EX):
                if self._counted() < at_least:
                    write_bytes_atomically(self.folder / TOKEN, str(at_least).encode())
        except (OSError, ValueError) as exc:
            raise StoreUnavailable(f"the host's lease token cannot be raised: {exc}") from exc

    def _counted(self) -> int:
        """The last token handed out (0: none yet)."""
        path = self.folder / TOKEN
        return int(path.read_text() or 0) if path.exists() else 0

    async def renew(self, member: str, token: int, ttl_s: float) -> bool:
        return self._token == token

    async def release(self, member: str, token: int) -> None:
        if self._token == token and self._lease_fd is not None:
            fd, self._lease_fd, self._token = self._lease_fd, None, None
            os.close(fd)  # drops the lock

    # -- in-flight counts: the shared table's ---------------------------------------------------------

    async def publish(self, member: str, inflight: dict[str, int], ttl_s: float) -> None:
        pass

    async def inflight(self) -> dict[str, dict[str, int]]:
        return {}

    async def close(self) -> None:
        if self._token is not None:
            await self.release("", self._token)

    @contextlib.contextmanager
    def _locked(self, name: str, how: int):
        fd = os.open(self.folder / name, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, how)
            yield
        finally:
            os.close(fd)
