"""`crossover serve --workers N`: N processes serving one port, acting as one gateway (what they share:
gateway/cluster/host.py).

    return serve_workers(settings, host, port)     # the supervisor, until it is stopped; the exit status

The supervisor binds the port once per worker (SO_REUSEPORT) and forks the workers, each of which serves its own
socket: the kernel spreads new connections evenly over the sockets (a hash of the connection's addresses), where one
socket shared by all would let whichever worker wakes first take a whole burst of keep-alive connections. The
supervisor keeps every socket open, so while a worker is replaced, the connections the kernel gives its socket wait
in the backlog for the replacement instead of being refused. It serves nothing and runs no event loop: it waits for
signals (blocked, and read with sigtimedwait, so nothing runs in a handler).
- A worker that dies is replaced in its slot, its row of in-flight counts zeroed and its metrics retired first; the
  other workers' connections and streams are theirs and go on. A worker that dies before it ever served is a
  start-up problem a replacement would repeat: if no worker has served yet, the gateway stops (exit 1); later, the
  replacement is retried with a growing delay while the others serve.
- A worker that hangs (stopped, stuck in a blocking call, a loop that never yields) does not die: each worker's event
  loop writes a heartbeat in its row (gateway/cluster/host.py), and the supervisor, awake at least every `WATCH_S` while
  workers run, SIGKILLs one that has served and been silent for longer than `worker_timeout` (as gunicorn's
  --timeout does); it is then replaced as above. Its lease, an flock, dies with it, so another worker takes it up.
- SIGTERM or SIGINT goes to every worker (each drains as one process does, gateway/serve/server.py; a second SIGINT
  forces their exit, as it does there); the supervisor exits 0 (130 after SIGINT) once all are gone.

The workers are one gateway through gateway/cluster/host.py (in-flight counts, metrics) and, as members of the host's
cluster, gateway/cluster/host_store.py (the control state a PUT changes; the lease: one worker runs the switch
controller or the in-engine gates, the others follow, and if it dies another takes over).

Workers run in their own process group, so a terminal's Ctrl-C reaches the supervisor alone, which passes it on
once; and they die with it (PR_SET_PDEATHSIG: SIGTERM, so they drain even if it is killed).

Limits: each worker admits its exact share of `limits.max_inflight` and of `limits.max_queued` (the shares add up to
the settings' numbers), so the host never admits or queues more than they say. A worker at its share refuses
while another may have room: the price of no queue across processes.
"""

from __future__ import annotations

import ctypes
import logging
import logging.config
import os
import signal
import socket
import sys
import time
import traceback
from pathlib import Path

from crossover.gateway.backends import Pools
from crossover.gateway.cluster import Host, Worker, heartbeat_ms
from crossover.gateway.config import Settings
from crossover.gateway.serve.server import BACKLOG, log_config, make_server

log = logging.getLogger("crossover.workers")

SIGNALS = {signal.SIGCHLD, signal.SIGTERM, signal.SIGINT}
_PR_SET_PDEATHSIG = 1
# A replacement that dies before serving is tried again after this, doubled each time up to the cap.
RETRY_S = 0.5
RETRY_CAP_S = 30.0
START_FAILED = 1
# The supervisor judges the workers' heartbeats at least this often (a quarter of worker_timeout if that is less).
WATCH_S = 1.0


def share(total: int, workers: int, slot: int) -> int:
    """Worker `slot`'s part of `total`: the parts differ by at most one and add up to `total`."""
    return total // workers + (1 if slot < total % workers else 0)


def worker_settings(settings: Settings, slot: int) -> Settings:
    limits = settings.limits
    shared = limits.model_copy(
        update={
            "max_inflight": share(limits.max_inflight, settings.workers, slot),
            "max_queued": share(limits.max_queued, settings.workers, slot),
        }
    )
    return settings.model_copy(update={"limits": shared})


def check_workers(settings: Settings) -> None:
    """Raise ValueError for settings N workers cannot serve as one gateway."""
    if settings.workers > settings.limits.max_inflight:
        raise ValueError(
            f"workers = {settings.workers} is more than limits.max_inflight = {settings.limits.max_inflight}: "
            "each worker admits its share of it, and a worker with none would refuse everything"
        )


def serve_workers(settings: Settings, host: str, port: int) -> int:
    logging.config.dictConfig(log_config(settings.log_level))
    listeners = bind(host, port, settings.workers)
    backends = len(Pools.from_settings(settings).all())
    try:
        with Host.folder_for_metrics() as folder:
            shared = Host(settings.workers, backends, Path(folder))
            return Supervisor(settings, host, port, listeners, shared).run()
    finally:
        for listener in listeners:
            listener.close()


def bind(host: str, port: int, count: int) -> list[socket.socket]:
    """`count` sockets listening on host:port together (port 0: the one the first was given)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listeners: list[socket.socket] = []
    for _ in range(count):
        listeners.append(socket.create_server((host, port), family=family, backlog=BACKLOG, reuse_port=True))
        port = listeners[0].getsockname()[1]
    return listeners


class Supervisor:
    def __init__(self, settings: Settings, host: str, port: int, listeners: list[socket.socket], shared: Host) -> None:
        self.settings, self.host, self.port = settings, host, port
        self.listeners = listeners
        self.shared = shared
        self.pids: dict[int, int] = {}  # pid -> slot
        self.retry_at: dict[int, float] = {}  # slot -> when its replacement starts
        self.retry_s = RETRY_S
        self.served = False  # some worker has served
        self.stopping: int | None = None  # the signal that stops the gateway
        self.status = 0
        self.timeout_ms = settings.worker_timeout * 1000
        self.watch_s = min(WATCH_S, settings.worker_timeout / 4)
        self.killed: set[int] = set()  # pids killed for silence, not reaped yet

    def run(self) -> int:
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, SIGNALS)
        try:
            for slot in range(self.settings.workers):
                self.start(slot, mask)
            port = self.listeners[0].getsockname()[1]
            log.info("serving on %s:%d with %d workers", self.host, port, self.settings.workers)
            while self.pids or (self.retry_at and self.stopping is None):
                self.wait(mask)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        if self.stopping == signal.SIGINT:
            return 130  # 128 + SIGINT, as a shell reports Ctrl-C
        return self.status

    def wait(self, mask) -> None:
        # Awake at least every watch_s while workers run, to judge their heartbeats; and when a retry is due.
        timeout = self.watch_s if self.pids else None
        if self.retry_at and self.stopping is None:
            due = max(0.0, min(self.retry_at.values()) - time.monotonic())
            timeout = due if timeout is None else min(timeout, due)
        info = signal.sigwaitinfo(SIGNALS) if timeout is None else signal.sigtimedwait(SIGNALS, timeout)
        if info is None:
            for slot, when in list(self.retry_at.items()):
                if when <= time.monotonic():
                    del self.retry_at[slot]
                    self.start(slot, mask)
        elif info.si_signo == signal.SIGCHLD:
            self.reap(mask)
        else:
            self.stop(info.si_signo)
        self.watch()

    def watch(self) -> None:
        """Kill the workers silent for longer than worker_timeout (draining ones too: a drain's loop still beats);
        reap() then replaces them as any worker that died after serving."""
        for pid, slot, silent_ms in silent(self.shared, self.pids, heartbeat_ms(), self.timeout_ms):
            if pid in self.killed:
                continue  # dying: its SIGCHLD is on its way
            log.warning(
                "worker %d (pid %d) silent for %.1f s (worker_timeout %g s): killing it",
                slot,
                pid,
                silent_ms / 1000,
                self.settings.worker_timeout,
            )
            os.kill(pid, signal.SIGKILL)
            self.killed.add(pid)
            self.shared.count_killed()

    def stop(self, signo: int) -> None:
        if self.stopping is None:
            self.stopping = signo
            log.info("stopping %d workers (%s)", len(self.pids), signal.Signals(signo).name)
            # The workers close theirs as they start draining: with these closed too, new connections are refused
            # (a load balancer tries elsewhere) rather than left waiting in a backlog nobody accepts from.
            for listener in self.listeners:
                listener.close()
        self.retry_at.clear()
        for pid in self.pids:
            os.kill(pid, signo)

    def reap(self, mask) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            slot = self.pids.pop(pid)
            self.killed.discard(pid)
            had_served = self.shared.pid(slot) == pid
            self.served = self.served or had_served or any(self.shared.pid(s) for s in range(self.shared.workers))
            self.shared.retire(slot)
            if self.stopping is not None:
                continue
            how = describe(status)
            if had_served:
                log.warning("worker %d (pid %d) %s; starting a replacement", slot, pid, how)
                self.retry_s = RETRY_S
                self.start(slot, mask)
            elif not self.served:
                log.error("worker %d (pid %d) %s before it served: stopping", slot, pid, how)
                self.status = START_FAILED
                self.stop(signal.SIGTERM)
            else:
                log.error("worker %d (pid %d) %s before it served; trying again in %g s", slot, pid, how, self.retry_s)
                self.retry_at[slot] = time.monotonic() + self.retry_s
                self.retry_s = min(2 * self.retry_s, RETRY_CAP_S)

    def start(self, slot: int, mask) -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        supervisor = os.getpid()
        pid = os.fork()
        if pid:
            self.pids[pid] = slot
            return
        status = START_FAILED
        try:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)
            os.setpgid(0, 0)
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
            if os.getppid() == supervisor:  # else it died before prctl took effect
                status = self.serve(slot)
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(status)

    def serve(self, slot: int) -> int:
        """Worker `slot`'s life: the gateway of one process on the shared socket."""
        worker = Worker(self.shared, slot)
        server = make_server(worker_settings(self.settings, slot), self.host, self.port, worker=worker)
        for other, listener in enumerate(self.listeners):
            if other != slot:
                listener.close()  # the supervisor holds it for its own worker
        server.run(sockets=[self.listeners[slot]])
        if not server.started:
            return START_FAILED
        return 130 if server.interrupted else 0


def silent(host: Host, pids: dict[int, int], now_ms: int, timeout_ms: float) -> list[tuple[int, int, int]]:
    """(pid, slot, ms silent) of each worker in `pids` (pid -> slot) whose heartbeat is older than `timeout_ms`.
    Only a worker that serves (its pid in its row: not a replacement starting) and has beaten once is judged."""
    judged = []
    for pid, slot in pids.items():
        if host.pid(slot) == pid and (silent_ms := host.silent_ms(slot, now_ms)) is not None and silent_ms > timeout_ms:
            judged.append((pid, slot, silent_ms))
    return judged


def describe(status: int) -> str:
    if os.WIFSIGNALED(status):
        return f"was killed by {signal.Signals(os.WTERMSIG(status)).name}"
    return f"exited with status {os.waitstatus_to_exitcode(status)}"
