"""Core sets for pinning the benchmark's processes: the backend, the gateways and the load apart, so none
takes cycles from another (as on the 16-core host of issue 31: 4 + 6 + 6).

    sets = CoreSets.parse(backend="0-3", gateway="4-9", load="10-15")   # CoreError: overlap, or not on this host

A set is Linux's CPU list syntax (`0-3,8,10-11`, as taskset -c and /sys/.../cpulist write it). Unset roles are
not pinned; with no set at all nothing is (the default: on a 2-core box every process shares both cores).
"""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass

ROLES = ("backend", "gateway", "load")


class CoreError(ValueError):
    """A core set that cannot be used: malformed, overlapping another, or naming a core this host lacks."""


def parse_cpu_list(text: str) -> frozenset[int]:
    """`0-3,8` -> {0, 1, 2, 3, 8}."""
    cores: set[int] = set()
    for part in text.split(","):
        first, dash, last = part.strip().partition("-")
        try:
            low, high = int(first), int(last if dash else first)
        except ValueError:
            raise CoreError(f"{text!r} is not a CPU list (e.g. 0-3,8)") from None
        if low < 0 or high < low:
            raise CoreError(f"{text!r}: {part.strip()!r} is not a range of core numbers")
        cores.update(range(low, high + 1))
    return frozenset(cores)


def format_cpu_list(cores: frozenset[int]) -> str:
    """{0, 1, 2, 3, 8} -> `0-3,8`."""
    runs = itertools.groupby(enumerate(sorted(cores)), lambda pair: pair[1] - pair[0])
    spans = [[core for _, core in run] for _, run in runs]
    return ",".join(f"{span[0]}-{span[-1]}" if len(span) > 1 else str(span[0]) for span in spans)


@dataclass(frozen=True)
class CoreSets:
    backend: frozenset[int] | None = None
    gateway: frozenset[int] | None = None  # crossover and every peer (one is loaded at a time)
    load: frozenset[int] | None = None  # every load generator process

    @classmethod
    def parse(
        cls,
        backend: str | None = None,
        gateway: str | None = None,
        load: str | None = None,
        available: frozenset[int] | None = None,
    ) -> CoreSets:
        """Each role's set, checked: on this host (`available`: the cores this process may use) and disjoint."""
        host = frozenset(os.sched_getaffinity(0)) if available is None else available
        given = {role: text for role, text in zip(ROLES, (backend, gateway, load), strict=True) if text is not None}
        sets = {role: parse_cpu_list(text) for role, text in given.items()}
        for role, cores in sets.items():
            missing = cores - host
            if missing:
                raise CoreError(
                    f"--cores-{role} {given[role]}: core(s) {format_cpu_list(missing)} not on this host "
                    f"(this process may use {format_cpu_list(host)})"
                )
        for (one, a), (other, b) in itertools.combinations(sets.items(), 2):
            if a & b:
                raise CoreError(
                    f"--cores-{one} {given[one]} and --cores-{other} {given[other]} share core(s) "
                    f"{format_cpu_list(a & b)}: the sets must be disjoint"
                )
        return cls(**sets)

    def split_load(self, processes: int) -> list[frozenset[int] | None]:
        """Each load generator's cores: the load set dealt out round robin (one or more cores each when there are
        enough; the whole set for each when there are more processes than cores), or None (not pinned)."""
        if self.load is None:
            return [None] * processes
        cores = sorted(self.load)
        if processes > len(cores):
            return [self.load] * processes
        return [frozenset(cores[i::processes]) for i in range(processes)]


UNPINNED = CoreSets()
