"""CPU time of a process tree, from /proc: what a proxy spends, whatever its layout of processes and threads.

    before = tree_cpu_seconds(pid)
    ...                                    # the measured window
    spent = tree_cpu_seconds(pid) - before

A process's /proc/<pid>/stat counts all its threads (utime, stime) and the children it has reaped (cutime,
cstime: Linux adds a reaped child's own and reaped-children's time there). Summed over the live tree, the total
only grows, so a difference is the CPU the tree spent in between even if a child exits meanwhile - as long as its
parent reaps it. Linux only (the proxy benchmark's machine).
"""

from __future__ import annotations

import os

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
PROC = "/proc"


def _read_stat(pid: str) -> tuple[int, int] | None:
    """(parent pid, utime+stime+cutime+cstime in ticks), or None if the process is gone."""
    try:
        with open(f"{PROC}/{pid}/stat", "rb") as file:
            stat = file.read()
    except OSError:
        return None
    # The command name is in parentheses and may hold spaces or parentheses itself: fields follow the last ")".
    fields = stat[stat.rindex(b")") + 2 :].split()
    # fields[0] is field 3 of proc(5) (state): ppid is 4, utime 14, stime 15, cutime 16, cstime 17.
    return int(fields[1]), int(fields[11]) + int(fields[12]) + int(fields[13]) + int(fields[14])


def _snapshot() -> tuple[dict[int, list[int]], dict[int, int]]:
    """({parent: [children]}, {pid: CPU ticks}) of every live process."""
    children: dict[int, list[int]] = {}
    ticks: dict[int, int] = {}
    for entry in os.scandir(PROC):
        if not entry.name.isdigit():
            continue
        stat = _read_stat(entry.name)
        if stat is not None:
            pid = int(entry.name)
            children.setdefault(stat[0], []).append(pid)
            ticks[pid] = stat[1]
    return children, ticks


def _tree(root: int, children: dict[int, list[int]]) -> list[int]:
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo += children.get(pid, [])
    return found


def tree_pids(root: int) -> list[int]:
    """`root` and all its live descendants."""
    return _tree(root, _snapshot()[0])


def tree_cpu_seconds(root: int) -> float:
    """User plus system CPU seconds of `root` and all its descendants (threads and reaped children included)."""
    children, ticks = _snapshot()
    return sum(ticks.get(pid, 0) for pid in _tree(root, children)) / CLOCK_TICKS
