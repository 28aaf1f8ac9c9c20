"""CPU cores claimed for a test run's engines, so concurrent runs on one host do not pin onto the same cores.

    with claimed_cores(2) as cores:     # e.g. [3, 7]: the cores no other run holds, where there are any
        ...                             # start one engine on each

Each core is a lock file in a directory every run on the host shares (LOCK_DIR); a run holds an exclusive
`flock` on each core it took for as long as it runs, and the kernel releases it when the run ends however it
ends. Cores are taken from this process's affinity, free ones first; where fewer are free than asked, the rest
are shared with another run (said on stderr: the engines then compete, which the tests judge as a busy machine).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

LOCK_DIR = Path(tempfile.gettempdir()) / "crossover-cores"


def _try_lock(core: int) -> int | None:
    fd = os.open(LOCK_DIR / f"core-{core}.lock", os.O_RDWR | os.O_CREAT, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


@contextlib.contextmanager
def claimed_cores(count: int) -> Iterator[list[int]]:
    """`count` cores of this process's affinity (repeated in turn where it has fewer), free ones first."""
    LOCK_DIR.mkdir(exist_ok=True)
    mine = sorted(os.sched_getaffinity(0))
    held: dict[int, int] = {}  # core -> locked fd
    try:
        for core in mine:
            if len(held) == count:
                break
            if (fd := _try_lock(core)) is not None:
                held[core] = fd
        taken = list(held)
        shared = [core for core in mine if core not in held]
        while len(taken) < count:
            taken.append((shared or mine)[len(taken) % len(shared or mine)])
        if len(held) < min(count, len(mine)):
            print(f"host_cores: {count} cores wanted, {len(held)} free; sharing {taken}", file=sys.stderr)
        yield taken
    finally:
        for fd in held.values():
            os.close(fd)
