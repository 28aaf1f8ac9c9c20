"""What the supervisor started, on disk, so `down` works from another process - even after the supervisor
that started the servers was killed with SIGKILL - and an agent restart finds running servers again.

    store = StateStore(default_state_dir("standin-partitioned"))
    with store.locked():
        records = store.load()

One JSON file per profile (`state.json`), written atomically under an flock. A pid alone is not an identity
(pids are reused), so each record keeps the process's start time from /proc and its process group.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError

STATE_FILE = "state.json"
LOCK_FILE = "state.lock"


class ServerRecord(BaseModel):
    model_config = ConfigDict(extra="ignore")

    pid: int
    pgid: int
    start_ticks: int | None  # /proc/<pid>/stat field 22: tells our process from a later one with its pid
    started_at: float  # wall clock (epoch seconds)
    log: str
    url: str
    argv: list[str] = Field(default_factory=list)
    ready_s: float | None = None  # how long the last start took to answer a generation
    released: bool = False  # sleep: GPU memory released, weights in host memory
    stopping: bool = False  # a stop (from any process) has begun: its exit is not a crash


class StateFile(BaseModel):
    model_config = ConfigDict(extra="ignore")

    profile: str
    servers: dict[str, ServerRecord] = Field(default_factory=dict)


def default_state_dir(profile: str) -> Path:
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "crossover" / profile


class StateStore:
    def __init__(self, directory: Path, profile: str):
        self.directory = Path(directory)
        self.profile = profile

    @property
    def logs(self) -> Path:
        return self.directory / "logs"

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """Serialise read-modify-write across processes (a CLI and an agent on one state dir)."""
        self.directory.mkdir(parents=True, exist_ok=True)
        with open(self.directory / LOCK_FILE, "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def load(self) -> dict[str, ServerRecord]:
        path = self.directory / STATE_FILE
        try:
            state = StateFile.model_validate_json(path.read_text())
        except FileNotFoundError:
            return {}
        except (OSError, ValidationError) as exc:
            raise RuntimeError(f"{path}: unreadable state ({exc}); inspect it, then remove it") from None
        return dict(state.servers)

    def save(self, records: dict[str, ServerRecord]) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self.directory / STATE_FILE
        tmp = path.with_suffix(".tmp")
        tmp.write_text(StateFile(profile=self.profile, servers=records).model_dump_json(indent=2))
        os.replace(tmp, path)

    def put(self, name: str, record: ServerRecord) -> None:
        with self.locked():
            records = self.load()
            records[name] = record
            self.save(records)

    def update(self, name: str, **changes) -> None:
        with self.locked():
            records = self.load()
            if name in records:
                records[name] = records[name].model_copy(update=changes)
                self.save(records)

    def remove(self, name: str) -> None:
        with self.locked():
            records = self.load()
            if records.pop(name, None) is not None:
                self.save(records)


def start_ticks(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) may contain spaces and parentheses: split after its closing one.
    return int(stat.rsplit(")", 1)[1].split()[19])


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes in process group `pgid`, found by scanning /proc."""
    members = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            fields = Path(entry.path, "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            members.append(int(entry.name))
    return members


def record_members(record: ServerRecord) -> list[int]:
    """Live processes of the recorded server's group - never another group that reuses its id.

    The kernel does not hand out a pid that is still some group's id, so while any process of our group
    lives, the id is ours. Only when a process with pid == pgid exists but started at another time has the
    id been reused by a new group after ours ended.
    """
    leader_ticks = start_ticks(record.pgid)
    if leader_ticks is not None and record.start_ticks is not None and leader_ticks != record.start_ticks:
        return []
    return group_members(record.pgid)


def record_alive(record: ServerRecord) -> bool:
    """The recorded leader still runs, or any process of its group does."""
    return bool(record_members(record))
