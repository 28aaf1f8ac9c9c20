"""The state dir: records survive the process that wrote them, and a process group id that another group
reuses after ours ended is never taken for ours (down would kill a stranger)."""

from __future__ import annotations

import sys
import time

import pytest

from crossover.servers.process import spawn, stop
from crossover.servers.state import ServerRecord, StateStore, record_alive, record_members, start_ticks

SLEEPER = [sys.executable, "-c", "import time; time.sleep(600)"]


def record_of(pid: int, ticks: int | None) -> ServerRecord:
    return ServerRecord(pid=pid, pgid=pid, start_ticks=ticks, started_at=time.time(), log="x.log", url="http://x")


@pytest.fixture
def sleeper():
    proc = spawn(SLEEPER, die_with_parent=False)
    yield proc
    stop([proc])


def test_records_round_trip_and_are_removed(tmp_path):
    store = StateStore(tmp_path / "state", "p")
    assert store.load() == {}
    store.put("a", record_of(123, 456))
    store.update("a", released=True, ready_s=1.5)
    (loaded,) = StateStore(tmp_path / "state", "p").load().values()
    assert loaded.released and loaded.ready_s == 1.5 and loaded.pgid == 123
    store.remove("a")
    assert store.load() == {}


def test_an_unreadable_state_file_is_reported_not_ignored(tmp_path):
    store = StateStore(tmp_path, "p")
    (tmp_path / "state.json").write_text("{not json")
    with pytest.raises(RuntimeError, match="unreadable state"):
        store.load()


def test_our_group_is_recognised_and_a_reused_id_is_not(sleeper):
    ours = record_of(sleeper.pid, start_ticks(sleeper.pid))
    assert record_members(ours) == [sleeper.pid] and record_alive(ours)
    # Same id, another start time: a new group that got our old id after ours ended.
    stranger = record_of(sleeper.pid, start_ticks(sleeper.pid) - 1)
    assert record_members(stranger) == [] and not record_alive(stranger)


def test_a_dead_group_is_not_alive(sleeper):
    record = record_of(sleeper.pid, start_ticks(sleeper.pid))
    stop([sleeper])
    assert not record_alive(record)
