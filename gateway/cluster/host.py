"""What a host's workers share (`crossover serve --workers N`, gateway/serve/workers.py): per-backend in-flight counts
exact across the workers, and one /metrics that adds every worker's numbers up.

    host = Host(workers, backends, folder)     # by the supervisor, before it forks: the table and the folder
    worker = Worker(host, slot)                # in worker `slot`: create_app(settings, worker=worker)

In flight: one row of 8-byte cells per worker in anonymous shared memory (inherited across fork), each cell written
by its worker alone (no lock: one writer per cell, aligned stores), summed on read. The supervisor zeroes a dead
worker's row before its replacement starts. Routing, /admin/state and /metrics read the sum, so every worker sees
the host's load as one gateway would; a lease costs one store more than in a single process.

Liveness: the loop that answers scrapes (every `ASKED_POLL_S`, on the worker's event loop) also writes a heartbeat
in the worker's row; the supervisor kills a worker whose heartbeat is older than `worker_timeout` and counts it in a
host cell (`crossover_workers_killed_total`).

Metrics: each worker writes its counters and histograms (and the gauges that add up) to a file of its own in the
host's folder (tmpfs where there is one) when a scrape asks (a host cell the scraping worker counts up; the others
look at it every `ASKED_POLL_S` and answer in a cell of their row), and at least every `PUBLISH_S` (what a dead
worker last published is what it keeps). A scrape asks, waits up to `ANSWER_WAIT_S` for every serving worker's
answer, then answers its own live numbers plus the others' published ones plus those of workers that died
(retired, so a counter never goes back). Whichever worker answers, a scrape is the host's sum as of the scrape (a
worker that cannot answer, stopped: as it last published). Publishing costs a collect and a file: on demand, a busy
host does not pay it four times a second for scrapes nobody makes.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import mmap
import os
import shutil
import socket
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.samples import Sample

from crossover.gateway.admission import Admission
from crossover.gateway.backends import Backend, Lease, Pools
from crossover.gateway.config import SPECULATIVE

# A row's first cells, before one per backend: the worker's pid once it serves (0 before), its admitted and queued
# requests (every `ASKED_POLL_S`), the scrape it last published for (the host's ASKED count it answered), and its
# heartbeat: CLOCK_MONOTONIC in ms (one clock for every process of the host), written by the same loop (0 before).
PID, ACTIVE, QUEUED, ANSWERED, HEARTBEAT = range(5)
HEADER_CELLS = 5
# The host's own row: the control state's version (gateway/cluster/host_store.py), the scrapes asked for, the workers
# the supervisor killed for silence (it is their one writer).
CONTROL_VERSION, ASKED, KILLED = range(3)
CELL = 8  # bytes: an int64, "q"
CELLS_PER_LINE = 64 // CELL

# How often a worker looks whether a scrape asked for its metrics (and updates its admitted and queued cells).
ASKED_POLL_S = 0.05
# How long a scrape waits for the other workers' answers (one stopped or dying never answers: its last file counts).
ANSWER_WAIT_S = 1.0
# A worker publishes at least this often, asked or not: what a worker that dies loses of its counts.
PUBLISH_S = 1.0
# Gauges that are a sum over workers (each worker's queue); the in-flight gauges read the shared table instead, and
# the rest (threshold, health as each worker's probes see it) are one value, whichever worker answers.
# crossover_cluster_leader: 1 on the host whose worker holds the lease.
SUMMED_GAUGES = frozenset(
    {"crossover_admission_queued_requests", "crossover_switch_queued_requests", "crossover_cluster_leader"}
)
RETIRED = "retired"
# In the retired numbers: the requests each slot's dead workers had ended, by slot (crossover_worker_requests).
RETIRED_BY_SLOT = "#requests_by_slot"
FOLDER_PREFIX = "crossover-workers-"

Samples = dict[str, dict[str, float]]  # family name -> {sample key: value}; a key is json of (name, labels)


class Host:
    """The shared table and folder of one host's workers, made before the workers are forked."""

    def __init__(self, workers: int, backends: int, folder: Path) -> None:
        self.workers = workers
        # The host as a member of a Redis cluster: whose in-flight counts its workers publish
        # (gateway/cluster/coordination.py).
        self.member = f"{socket.gethostname()}:{os.getpid()}"
        # Rows whole cache lines apart: a worker storing to its row does not evict the others' (false sharing).
        self.width = -(-(HEADER_CELLS + backends) // CELLS_PER_LINE) * CELLS_PER_LINE
        self.folder = folder
        # A row per worker, then the host's own: the control state's version (gateway/cluster/host_store.py).
        self._memory = mmap.mmap(-1, (workers + 1) * self.width * CELL)  # MAP_SHARED | MAP_ANONYMOUS
        self.cells = memoryview(self._memory).cast("q")
        self._control = workers * self.width

    @staticmethod
    def folder_for_metrics() -> tempfile.TemporaryDirectory:
        """A private folder for the published metrics, in memory where the host has /dev/shm. Its name carries the
        supervisor's pid: a supervisor killed by SIGKILL cannot remove its folder, so the next one to start removes
        the folders of supervisors that are gone (memory of tmpfs is the host's RAM)."""
        shm = Path("/dev/shm")
        parent = shm if shm.is_dir() else Path(tempfile.gettempdir())
        remove_orphans(parent)
        return tempfile.TemporaryDirectory(prefix=f"{FOLDER_PREFIX}{os.getpid()}-", dir=parent)

    def row(self, slot: int) -> memoryview:
        return self.cells[slot * self.width : (slot + 1) * self.width]

    def column(self, column: int) -> memoryview:
        """`column` of every worker's row: a live view, whose sum is the host's count."""
        return self.cells[column : self._control : self.width]

    def control_version(self) -> int:
        return self.cells[self._control + CONTROL_VERSION]

    def set_control_version(self, version: int) -> None:
        self.cells[self._control + CONTROL_VERSION] = version

    def asked(self) -> int:
        """Scrapes asked for so far: a worker that answered fewer has not published since the last one began."""
        return self.cells[self._control + ASKED]

    def ask(self) -> int:
        """A scrape begins: the count every serving worker must answer. Two workers asking at once may both write
        the same count (no lock); any answer to it still follows both asks, since each read the count before it."""
        asked = self.cells[self._control + ASKED] + 1
        self.cells[self._control + ASKED] = asked
        return asked

    def waiting_for(self, asked: int, slot: int) -> bool:
        """Whether a serving worker other than `slot` has not answered scrape `asked` yet."""
        cells, width = self.cells, self.width
        return any(
            cells[other * width + PID] and cells[other * width + ANSWERED] < asked
            for other in range(self.workers)
            if other != slot
        )

    def pid(self, slot: int) -> int:
        """The worker's pid once it serves, else 0."""
        return self.cells[slot * self.width + PID]

    def silent_ms(self, slot: int, now_ms: int) -> int | None:
        """How long worker `slot` has not beaten (`now_ms`: `heartbeat_ms()`), or None while there is nothing to
        judge: it does not serve yet, or its loop has not beaten once (a slow start is not a hang)."""
        beat = self.cells[slot * self.width + HEARTBEAT]
        if not self.pid(slot) or not beat:
            return None
        return now_ms - beat

    def killed(self) -> int:
        """Workers the supervisor killed for silence (gateway/serve/workers.py)."""
        return self.cells[self._control + KILLED]

    def count_killed(self) -> None:
        self.cells[self._control + KILLED] += 1

    def published(self, slot: int | str) -> Path:
        return self.folder / f"worker-{slot}.json"

    def read(self, slot: int | str) -> Samples:
        try:
            return json.loads(self.published(slot).read_bytes())
        except (OSError, ValueError):
            return {}  # not published yet (a worker starting), or gone

    def retire(self, slot: int) -> None:
        """A worker died: its row counts nothing any more, and the counters and histograms it last published join
        the retired numbers (its replacement starts from zero)."""
        row = self.row(slot)
        for cell in range(self.width):
            row[cell] = 0
        retired = self.read(RETIRED)
        published = self.read(slot)
        by_slot = retired.setdefault(RETIRED_BY_SLOT, {})
        by_slot[str(slot)] = by_slot.get(str(slot), 0.0) + sum(published.get("crossover_requests", {}).values())
        for name, samples in published.items():
            if name in SUMMED_GAUGES:
                continue  # a gauge is now: a dead worker queues nothing and leads nothing
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
        """Publish when a scrape asks, and at least every PUBLISH_S."""
        loop, row, host = asyncio.get_running_loop(), self.row, self.host
        published_at = float("-inf")
        while True:
            # From the event loop, not a thread: a loop that stops turning stops the heartbeat, and the supervisor
            # replaces the worker (gateway/serve/workers.py).
            row[HEARTBEAT] = heartbeat_ms()
            asked = host.asked()
            if asked != row[ANSWERED] or loop.time() - published_at >= PUBLISH_S:
                self.publish(registry, admission)
                row[ANSWERED] = asked  # after the file is in place: an answer means the file is this fresh
                published_at = loop.time()
            else:
                row[ACTIVE], row[QUEUED] = admission.active, admission.queued
            await asyncio.sleep(ASKED_POLL_S)

    async def gather(self) -> None:
        """Before a scrape: every other serving worker publishes (up to ANSWER_WAIT_S)."""
        asked = self.host.ask()
        self.row[ANSWERED] = asked  # its own numbers are live in this scrape: no file to write for it
        deadline = asyncio.get_running_loop().time() + ANSWER_WAIT_S
        while self.host.waiting_for(asked, self.slot) and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(ASKED_POLL_S / 5)

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


def heartbeat_ms() -> int:
    """Now on CLOCK_MONOTONIC, which every process of the host reads alike (a heartbeat's unit)."""
    return time.monotonic_ns() // 1_000_000


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
            "Requests each worker slot of this host has ended (as crossover_requests_total), its replaced workers' "
            "included: a counter that never goes back.",
            labels=["worker"],
        )
        retired = others.get(RETIRED, {}).get(RETIRED_BY_SLOT, {})
        for slot, samples in sorted({**others, self.worker.slot: own}.items(), key=lambda item: str(item[0])):
            if slot != RETIRED:
                ended = sum(samples.get("crossover_requests", {}).values()) + retired.get(str(slot), 0.0)
                split.add_metric([str(slot)], ended)
        yield split
        yield CounterMetricFamily(
            "crossover_workers_killed",
            "Workers the supervisor killed (SIGKILL) and replaced because their event loop was silent for longer "
            "than worker_timeout.",
            value=self.worker.host.killed(),
        )


@dataclass
class HostPools(Pools):
    """The pools as one of a host's workers sees them: each backend's in-flight count is the host's."""

    worker: Worker | None = None
    _columns: dict[Backend, int] = field(default_factory=dict, repr=False)
    # Each backend's column over the workers' rows: a live view of the shared table, made once, so a read is one
    # `sum` (no slice, no call per backend), asked only for the backends of the pool a decision reads.
    _counts: dict[Backend, memoryview] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        assert self.worker is not None, "HostPools.from_settings(settings, worker=...)"
        self._columns = {backend: HEADER_CELLS + index for index, backend in enumerate(self.all())}
        self._counts = {backend: self.worker.host.column(column) for backend, column in self._columns.items()}

    def lease(self, backend: Backend) -> HostLease:
        return HostLease(backend, self.worker.row, self._columns[backend])

    def count(self, backend: Backend) -> int:
        return sum(self._counts[backend])

    def pool_load(self, name: str) -> int:
        if self.load_signal == "local":  # the default, asked once per request: as Pools does, over the host's table
            counts, load = self._counts, 0
            for backend in self.speculative if name == SPECULATIVE else self.plain:
                load += sum(counts[backend]) + backend.elsewhere
            return load
        return sum([self.backend_load(backend) for backend in self.pool(name)])


class HostLease(Lease):
    """A lease that keeps this worker's cell for its backend equal to its own count."""

    __slots__ = ("column", "row")

    def __init__(self, backend: Backend, row: memoryview, column: int) -> None:
        # Lease.__init__ inlined: one lease per request.
        inflight = backend.inflight = backend.inflight + 1
        self.backend: Backend | None = backend
        self.level = inflight
        self.row, self.column = row, column
        row[column] = inflight

    def release(self) -> None:
        backend = self.backend
        if backend is not None:
            inflight = backend.inflight = backend.inflight - 1
            self.backend = None
            self.row[self.column] = inflight


def remove_orphans(parent: Path) -> None:
    """Remove the metrics folders (under `parent`) of supervisors that are gone, this user's only."""
    for folder in parent.glob(f"{FOLDER_PREFIX}*-*"):
        pid = folder.name.removeprefix(FOLDER_PREFIX).split("-", 1)[0]
        try:
            if not pid.isdigit() or folder.stat().st_uid != os.getuid():
                continue
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(folder, ignore_errors=True)
        except OSError:
            continue  # alive (another user's process: PermissionError), or the folder went meanwhile
