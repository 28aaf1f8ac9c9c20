"""What a host's workers share (`crossover serve --workers N`, gateway/workers.py): per-backend in-flight counts
exact across the workers, and one /metrics that adds every worker's numbers up.

    host = Host(workers, backends, folder)     # by the supervisor, before it forks: the table and the folder
    worker = Worker(host, slot)                # in worker `slot`: create_app(settings, worker=worker)

In flight: one row of 8-byte cells per worker in anonymous shared memory (inherited across fork), each cell written
by its worker alone (no lock: one writer per cell, aligned stores), summed on read. The supervisor zeroes a dead
worker's row before its replacement starts. Routing, /admin/state and /metrics read the sum, so every worker sees
the host's load as one gateway would; a lease costs one store more than in a single process.

Metrics: every `PUBLISH_S` each worker writes its counters and histograms (and the gauges that add up) to a file of
its own in the host's folder (tmpfs where there is one); a scrape answers its own live numbers plus the others'
last published ones plus those of workers that died (retired, so a counter never goes back). Whichever worker
answers, a scrape is the host's sum, the other workers' part at most `PUBLISH_S` old.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import mmap
import os
import socket
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.samples import Sample

from crossover.gateway.admission import Admission
from crossover.gateway.pools import Backend, Lease, Pools

# A row's first cells, before one per backend: the worker's pid once it serves (0 before), its admitted and queued
# requests (published with its metrics).
PID, ACTIVE, QUEUED = range(3)
HEADER_CELLS = 3
CELL = 8  # bytes: an int64, "q"
CELLS_PER_LINE = 64 // CELL

# How often a worker publishes its metrics for the others' scrapes: the most a scrape's other-worker part lags.
PUBLISH_S = 0.25
# Gauges that are a sum over workers (each worker's queue); the in-flight gauges read the shared table instead, and
# the rest (threshold, health as each worker's probes see it) are one value, whichever worker answers.
# crossover_cluster_leader: 1 on the host whose worker holds the lease.
SUMMED_GAUGES = frozenset(
    {"crossover_admission_queued_requests", "crossover_switch_queued_requests", "crossover_cluster_leader"}
)
RETIRED = "retired"

Samples = dict[str, dict[str, float]]  # family name -> {sample key: value}; a key is json of (name, labels)


class Host:
    """The shared table and folder of one host's workers, made before the workers are forked."""

    def __init__(self, workers: int, backends: int, folder: Path) -> None:
        self.workers = workers
        # The host as a member of a Redis cluster: whose in-flight counts its workers publish (gateway/coordination.py).
        self.member = f"{socket.gethostname()}:{os.getpid()}"
        # Rows whole cache lines apart: a worker storing to its row does not evict the others' (false sharing).
        self.width = -(-(HEADER_CELLS + backends) // CELLS_PER_LINE) * CELLS_PER_LINE
        self.folder = folder
        # A row per worker, then the host's own: the control state's version (gateway/host_store.py).
        self._memory = mmap.mmap(-1, (workers + 1) * self.width * CELL)  # MAP_SHARED | MAP_ANONYMOUS
        self.cells = memoryview(self._memory).cast("q")
        self._control = workers * self.width

    @staticmethod
    def folder_for_metrics() -> tempfile.TemporaryDirectory:
        """A private folder for the published metrics, in memory where the host has /dev/shm."""
        shm = Path("/dev/shm")
        return tempfile.TemporaryDirectory(prefix="crossover-workers-", dir=shm if shm.is_dir() else None)

    def row(self, slot: int) -> memoryview:
        return self.cells[slot * self.width : (slot + 1) * self.width]

    def total(self, column: int) -> int:
        return sum(self.cells[column : self._control : self.width])

    def control_version(self) -> int:
        return self.cells[self._control]

    def set_control_version(self, version: int) -> None:
        self.cells[self._control] = version

    def pid(self, slot: int) -> int:
        """The worker's pid once it serves, else 0."""
        return self.cells[slot * self.width + PID]

    def published(self, slot: int | str) -> Path:
        return self.folder / f"worker-{slot}.json"

    def read(self, slot: int | str) -> Samples:
        try:
            return json.loads(self.published(slot).read_bytes())
        except (OSError, ValueError):
            return {}  # not published yet (a worker starting), or gone

    def retire(self, slot: int) -> None:
        """A worker died: its row counts nothing any more, and what it last published joins the retired numbers
        (its replacement starts from zero)."""
        row = self.row(slot)
        for cell in range(self.width):
            row[cell] = 0
        retired = self.read(RETIRED)
        for name, samples in self.read(slot).items():
            into = retired.setdefault(name, {})
            for key, value in samples.items():
                into[key] = into.get(key, 0.0) + value
        write_atomically(self.published(RETIRED), retired)
        with contextlib.suppress(FileNotFoundError):
            self.published(slot).unlink()


@dataclass(eq=False)
class Worker:
    """One worker's place on its host: its row and its published metrics."""

    host: Host
    slot: int
    row: memoryview = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.row = self.host.row(self.slot)

    def serving(self) -> None:
        self.row[PID] = os.getpid()

    def publish(self, registry: CollectorRegistry, admission: Admission) -> None:
        self.row[ACTIVE], self.row[QUEUED] = admission.active, admission.queued
        write_atomically(self.host.published(self.slot), summable(registry.collect()))

    async def publish_every(self, registry: CollectorRegistry, admission: Admission) -> None:
        while True:
            self.publish(registry, admission)
            await asyncio.sleep(PUBLISH_S)

    def others(self) -> dict[int | str, Samples]:
        """What the other workers last published, and the retired numbers."""
        slots: list[int | str] = [slot for slot in range(self.host.workers) if slot != self.slot]
        return {slot: self.host.read(slot) for slot in [*slots, RETIRED]}

    def admitted(self, admission: Admission) -> tuple[int, int]:
        """The host's admitted and queued requests: this worker's live, the others' as last published."""
        width, cells = self.host.width, self.host.cells
        others = [slot for slot in range(self.host.workers) if slot != self.slot]
        active = admission.active + sum(cells[slot * width + ACTIVE] for slot in others)
        queued = admission.queued + sum(cells[slot * width + QUEUED] for slot in others)
        return active, queued


def summable(families: Iterator[Metric]) -> Samples:
    """The samples that add up over workers: counters and histograms (less their per-process `_created`) and the
    gauges in SUMMED_GAUGES."""
    out: Samples = {}
    for family in families:
        if family.type in ("counter", "histogram") or family.name in SUMMED_GAUGES:
            out[family.name] = {
                json.dumps([sample.name, sorted(sample.labels.items())]): sample.value
                for sample in family.samples
                if not sample.name.endswith("_created")
            }
    return out


def write_atomically(path: Path, payload: Samples) -> None:
    write_bytes_atomically(path, json.dumps(payload).encode())


def write_bytes_atomically(path: Path, data: bytes) -> None:
    """Write-then-rename: a reader sees the old file or the new one, never half of one."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "wb") as file:
        file.write(data)
    os.replace(tmp, path)


class HostRegistry:
    """/metrics of one worker as the host's: what `generate_latest` reads instead of the worker's own registry."""

    def __init__(self, registry: CollectorRegistry, worker: Worker) -> None:
        self.registry = registry
        self.worker = worker

    def collect(self) -> Iterator[Metric]:
        others = self.worker.others()
        own: Samples = {}
        for family in self.registry.collect():
            if family.type not in ("counter", "histogram") and family.name not in SUMMED_GAUGES:
                yield family
                continue
            mine = summable([family])[family.name]
            own[family.name] = mine
            merged = dict(mine)
            for samples in others.values():
                for key, value in samples.get(family.name, {}).items():
                    merged[key] = merged.get(key, 0.0) + value
            summed = Metric(family.name, family.documentation, family.type, family.unit)
            for key, value in merged.items():
                name, labels = json.loads(key)
                summed.samples.append(Sample(name, dict(labels), value))
            yield summed
        split = CounterMetricFamily(
            "crossover_worker_requests",
            "Requests each live worker of this host has ended (as crossover_requests_total); starts at 0 when a "
            "worker is replaced.",
            labels=["worker"],
        )
        for slot, samples in sorted({**others, self.worker.slot: own}.items(), key=lambda item: str(item[0])):
            if slot != RETIRED:
                split.add_metric([str(slot)], sum(samples.get("crossover_requests", {}).values()))
        yield split


@dataclass
class HostPools(Pools):
    """The pools as one of a host's workers sees them: each backend's in-flight count is the host's."""

    worker: Worker | None = None
    _columns: dict[Backend, int] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        assert self.worker is not None, "HostPools.from_settings(settings, worker=...)"
        self._columns = {backend: HEADER_CELLS + index for index, backend in enumerate(self.all())}

    def lease(self, backend: Backend) -> HostLease:
        return HostLease(backend, self.worker.row, self._columns[backend])

    def count(self, backend: Backend) -> int:
        return self.worker.host.total(self._columns[backend])

    def pool_load(self, name: str) -> int:
        return sum([self.backend_load(backend) for backend in self.pool(name)])


class HostLease(Lease):
    """A lease that keeps this worker's cell for its backend equal to its own count."""

    __slots__ = ("column", "row")

    def __init__(self, backend: Backend, row: memoryview, column: int) -> None:
        super().__init__(backend)
        self.row, self.column = row, column
        row[column] = backend.inflight

    def release(self) -> None:
        backend = self.backend
        if backend is not None:
            super().release()
            self.row[self.column] = backend.inflight
