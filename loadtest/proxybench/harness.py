"""Is the gateway the bottleneck, and what does it cost? One zero-delay backend, driven directly, through
crossover and through today's Rust gateways (smg, vllm-router; `peers.py`), in one run on one machine.

    python -m crossover.loadtest.proxybench --markdown bench-out/proxybench.md

Each cell (streaming with --max-tokens chunks and not, at each concurrency, then a paced run whose
chunks come --paced-delay-ms apart) runs the load generator (`proxybench.loadgen`, its own process)
against each target in turn, --rounds times, each round starting one target later, so slow drift on a
shared machine hits all targets alike; a cell's row per target is the median of its rounds. The paced run's
clients start spread over one stream's length (`loadgen --ramp`), not as one burst. Every process it
starts runs in its own process group and is stopped on the way out. Each peer runs from its own venv
(created on first use as .venv-<name> in --venvs); crossover runs on --crossover-python, this Python unless
told (how a Python was built changes what crossover costs: loadtest/proxybench/RESULTS.md). Every target's CPU time
(its whole process tree, from /proc) is measured over each cell's window by the load generator. Exit
status: 0 if every bar line that could be checked passed, 1 if one failed, 2 if the run could not be set up.

On a host with cores to spare (issue 31's table: 16 cores, the peers carried over as wheels):

    python -m crossover.loadtest.proxybench --concurrency 96,768 --paced-concurrency 3072 --rounds 2 \
        --cores-backend 0-3 --backend-workers 4 --cores-gateway 4-9 --workers 6 --cores-load 10-15 --load-procs 6 \
        --wheels wheels/ --markdown bench-out/proxybench-16.md

--cores-* pin each role to its own cores (checked disjoint and present; read back from the kernel into the
report), --workers runs `crossover serve --workers N` (crossover is left out, saying why, where the build lacks
it), --load-procs deals each cell's clients out to several load generators sharing one window. The target
crossover-redis is crossover with `[cluster] redis_url` pointing at a redis-server the run starts: its CPU per
request is judged against crossover's (left out, saying why, where the build never connects to Redis). The
target crossover-w1 is crossover as one process beside a crossover with --workers N: its req/s is the floor the
workers must reach.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from crossover.gateway.cli import non_negative_float, positive_float, positive_int, positive_int_list
from crossover.loadtest.proxybench import loadgen, redisserver
from crossover.loadtest.proxybench.cores import UNPINNED, CoreError, CoreSets, format_cpu_list
from crossover.loadtest.proxybench.cpu import tree_pids
from crossover.loadtest.proxybench.peers import PEERS, SMG, VLLM_ROUTER, InstallFailed
from crossover.loadtest.proxybench.report import (
    CROSSOVER,
    CROSSOVER_ONE,
    CROSSOVER_REDIS,
    DIRECT,
    VARIANTS,
    Bar,
    check_bar,
    combine,
    render_markdown,
    render_summary,
    render_text,
)
from crossover.servers import process

HOST = "127.0.0.1"
# crossover-redis: crossover with [cluster] redis_url set; crossover-w1: crossover as one process, beside --workers N.
TARGETS = (DIRECT, CROSSOVER, *VARIANTS, *PEERS)
DEFAULT_TARGETS = (DIRECT, CROSSOVER, SMG, VLLM_ROUTER)  # sglang-router: superseded by smg, on request only
REPO_ROOT = Path(__file__).resolve().parents[2]  # where the servers and load generators run
READY_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 10.0
# A cell's load generator gets its own window plus this much to start, drain and report.
CELL_SLACK_S = 30.0
# Several load generators start together this long after they are launched (Python and its imports load first).
LOAD_START_S = 3.0
# How long a gateway given a redis_url has to connect to it before the run says this build has no cluster support.
REDIS_CONNECT_TIMEOUT_S = 10.0
# crossover's admission limit in a run: past any concurrency a run sends (crossover_config).
UNLIMITED = 1_000_000


class SetupError(Exception):
    """A server or the load generator could not be brought up (a peer that cannot be installed: InstallFailed)."""


@dataclass(frozen=True)
class Cell:
    kind: str  # "stream", "non-stream" or "paced"
    concurrency: int
    max_tokens: int

    @property
    def stream(self) -> bool:
        return self.kind != "non-stream"


@dataclass(frozen=True)
class Plan:
    concurrency: tuple[int, ...] = (1, 32, 256)
    max_tokens: int = 64
    duration: float = 5.0
    warmup: float = 1.0
    requests: int | None = None  # a fixed count per cell instead of a timed window
    paced: bool = True
    paced_concurrency: int = 256
    paced_delay_ms: float = 20.0
    paced_duration: float = 10.0
    timeout: float = 60.0
    # Each cell, every target in turn: the row is the median of its rounds. Five, not three: the paced and the
    # non-streamed C=1 lines sit within a few percent of vllm-router's, where a median of three flipped between runs.
    rounds: int = 5
    load_procs: int = 1  # load generator processes per cell, the concurrency dealt out among them

    def fast_cells(self) -> list[Cell]:
        return [Cell(kind, c, self.max_tokens) for kind in ("stream", "non-stream") for c in self.concurrency]

    def paced_cell(self) -> Cell:
        return Cell("paced", self.paced_concurrency, self.max_tokens)


@dataclass(frozen=True)
class Setup:
    """How the servers run: their cores, crossover's build and worker processes, the backend's processes."""

    cores: CoreSets = UNPINNED
    crossover_python: str = sys.executable
    workers: int | None = None  # crossover serve --workers N; None: not passed (the build's default)
    backend_workers: int = 1


def spawn(argv: list[str], cwd: Path | None = None, cores: frozenset[int] | None = None) -> subprocess.Popen:
    # stdout goes to our stderr: this process's stdout carries the table only.
    return process.spawn(argv, cwd=cwd, stdout=sys.stderr, affinity=cores)


def wait_serving(url: str, proc: subprocess.Popen) -> None:
    """Ready means a whole chat completion comes back 200: the full path works, not just /health."""
    body = {"model": "zero", "messages": [{"role": "user", "content": "ready?"}], "max_tokens": 1}
    process.wait_ready(url + "/v1/chat/completions", proc, READY_TIMEOUT_S, json=body)


def crossover_config(workdir: Path, spec_url: str, plain_url: str, redis_url: str = "") -> Path:
    # Both pools point at the one backend (through two of its ports: the pools must not share an address). The
    # peers run with no admission limit, so crossover's is set past any load a run sends: the default (1,024 in
    # flight, each worker its share) answered 429 to half of the paced 3,072 streams, a measure of the setting.
    path = workdir / ("crossover-redis.toml" if redis_url else "crossover.toml")
    cluster = f'[cluster]\nredis_url = "{redis_url}"\nname = "proxybench"\n' if redis_url else ""
    path.write_text(
        'log_level = "warning"\n'
        f"[limits]\nmax_inflight = {UNLIMITED}\n"
        f'[pools.speculative]\nbackends = ["{spec_url}"]\n'
        f'[pools.plain]\nbackends = ["{plain_url}"]\n' + cluster
    )
    return path


@dataclass(frozen=True)
class Target:
    url: str
    pid: int  # the root of the process tree whose CPU time is this target's
    command: str  # how it was started, for the report
    # The cores each process of its tree may run on, read back from the kernel once it serves (CPU list syntax).
    cores: tuple[str, ...] = ()


def start(
    argv: list[str], url: str, cwd: Path, procs: list[subprocess.Popen], cores: frozenset[int] | None = None
) -> Target:
    """`argv` started in `cwd` on `cores` (added to `procs` as soon as it runs, for the caller to stop) and serving
    `url`."""
    procs.append(spawn(argv, cwd, cores))
    wait_serving(url, procs[-1])
    command = shlex.join(argv) if cores is None else f"taskset -c {format_cpu_list(cores)} {shlex.join(argv)}"
    return Target(url, procs[-1].pid, command, read_cores(procs[-1].pid))


def read_cores(root: int) -> tuple[str, ...]:
    """The distinct core sets of `root`'s process tree, as the kernel has them."""
    found = set()
    for pid in tree_pids(root):
        with contextlib.suppress(OSError):  # a process that exited meanwhile
            found.add(format_cpu_list(frozenset(os.sched_getaffinity(pid))))
    return tuple(sorted(found))


def zerobackend_argv(port: int, second_port: int, chunk_delay_ms: float, workers: int = 1) -> list[str]:
    argv = [sys.executable, "-m", "crossover.loadtest.proxybench.zerobackend", "--host", HOST]
    argv += ["--port", str(port), "--port", str(second_port), "--chunk-delay-ms", str(chunk_delay_ms)]
    return argv + (["--workers", str(workers)] if workers > 1 else [])


def crossover_argv(python: str, config: Path, port: int, workers: int | None = None) -> list[str]:
    argv = [python, "-m", "crossover.gateway.cli", "serve", "--config", str(config)]
    return [*argv, "--host", HOST, "--port", str(port)] + ([] if workers is None else ["--workers", str(workers)])


def knows_workers(python: str) -> bool:
    """Whether the crossover `python` runs has `serve --workers` (issue 31; an older build does not)."""
    done = subprocess.run(
        [python, "-m", "crossover.gateway.cli", "serve", "--help"],
        capture_output=True,
        text=True,
        timeout=READY_TIMEOUT_S,
        check=False,
    )
    return "--workers" in done.stdout


def wait_redis_client(redis_url: str, gateway: Target) -> None:
    """SetupError unless the gateway connects to Redis: a build without cluster support ignores `[cluster]`, and
    its figures would be crossover's without Redis under another name."""
    deadline = time.monotonic() + REDIS_CONNECT_TIMEOUT_S
    while time.monotonic() < deadline:
        if redisserver.clients(redis_url) > 1:  # more than this probe's own connection
            return
        time.sleep(redisserver.POLL_S)
    raise SetupError(
        f"crossover ({gateway.command}) did not connect to Redis at {redis_url} within "
        f"{REDIS_CONNECT_TIMEOUT_S:g} s: this build has no cluster support ([cluster] redis_url is ignored)"
    )


def absolute(python: str) -> str:
    """A path made absolute (servers run in scratch directories); a bare name (found on PATH) as it is."""
    return str(Path(python).absolute()) if os.sep in python else python


def check_crossover_python(python: str) -> None:
    """SetupError unless `python` runs and imports crossover: what `crossover_argv` starts."""
    try:
        done = subprocess.run(
            [python, "-c", "import crossover.gateway.cli"],
            capture_output=True,
            text=True,
            timeout=READY_TIMEOUT_S,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise SetupError(f"--crossover-python {python} does not run: {exc}") from None
    if done.returncode != 0:
        said = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
        raise SetupError(
            f"--crossover-python {python} cannot import crossover ({said}): "
            f"give it a venv made from that Python with crossover installed (`PYTHON -m venv DIR && DIR/bin/pip "
            f"install -e {REPO_ROOT}`) and pass DIR/bin/python"
        )


class Skipped(Exception):
    """A target this run cannot measure as asked (the build lacks the feature): left out, the reason reported."""


@contextlib.contextmanager
def running_targets(
    targets: tuple[str, ...],
    chunk_delay_ms: float,
    peers: dict[str, Path],
    setup: Setup = Setup(),
    skipped: dict[str, str] | None = None,
) -> Iterator[dict[str, Target]]:
    """Start the backend and the proxies in front of it; yield {target: Target}; stop them all. `peers` holds each
    peer target's executable; a target that cannot run as `setup` asks is left out and its reason put in
    `skipped`."""
    procs: list[subprocess.Popen] = []
    started: dict[str, Target] = {}
    skipped = {} if skipped is None else skipped
    cores = setup.cores
    with tempfile.TemporaryDirectory(prefix="proxybench-") as tmp:
        try:
            port, second_port = process.free_port(HOST), process.free_port(HOST)
            backend_url = f"http://{HOST}:{port}"
            backend = zerobackend_argv(port, second_port, chunk_delay_ms, setup.backend_workers)
            started[DIRECT] = start(backend, backend_url, REPO_ROOT, procs, cores.backend)
            second_url = f"http://{HOST}:{second_port}"
            for name in (CROSSOVER, *VARIANTS):
                if name in targets and name not in skipped:
                    try:
                        started[name] = _start_crossover(name, setup, Path(tmp), backend_url, second_url, procs)
                    except Skipped as exc:
                        skipped[name] = str(exc)
                        print(f"proxybench: {name} left out: {exc}", file=sys.stderr, flush=True)
            for name, exe in peers.items():
                theirs = process.free_port(HOST)
                argv = PEERS[name].argv(exe, backend_url, HOST, theirs, process.free_port(HOST))
                started[name] = start(argv, f"http://{HOST}:{theirs}", Path(tmp), procs, cores.gateway)
            yield {name: started[name] for name in targets if name in started}
        finally:
            process.stop(procs, STOP_TIMEOUT_S)


def _start_crossover(
    name: str, setup: Setup, workdir: Path, backend_url: str, second_url: str, procs: list[subprocess.Popen]
) -> Target:
    """crossover serving (with its own Redis for crossover-redis, as one process for crossover-w1); Skipped if this
    build cannot run as asked."""
    workers = None if name == CROSSOVER_ONE else setup.workers
    if name == CROSSOVER_ONE and setup.workers is None:
        raise Skipped("crossover-w1 is crossover without --workers beside a run with them: give --workers N")
    if workers is not None and not knows_workers(setup.crossover_python):
        raise Skipped(
            f"--workers {setup.workers}: the crossover of {setup.crossover_python} has no `serve --workers` "
            "(issue 31): run without --workers, or give --crossover-python a build that has it"
        )
    redis_url = ""
    if name == CROSSOVER_REDIS:
        try:
            redis_url = redisserver.start(procs, HOST, setup.cores.backend)
        except redisserver.RedisUnavailable as exc:
            raise Skipped(str(exc)) from None
    config = crossover_config(workdir, backend_url, second_url, redis_url)
    ours = process.free_port(HOST)
    argv = crossover_argv(setup.crossover_python, config, ours, workers)
    target = start(argv, f"http://{HOST}:{ours}", REPO_ROOT, procs, setup.cores.gateway)
    if redis_url:
        try:
            wait_redis_client(redis_url, target)
        except SetupError as exc:
            process.stop([procs.pop()], STOP_TIMEOUT_S)  # this gateway only: the others keep running
            raise Skipped(str(exc)) from None
    return target


def run_cell(target: Target, cell: Cell, plan: Plan, cores: CoreSets = UNPINNED) -> dict:
    """The load generator(s) against `target`, measuring its CPU time; returns loadgen's report (one, or several
    processes' `merge`d)."""
    paced = cell.kind == "paced"
    duration = plan.paced_duration if paced else plan.duration
    # Paced streams start spread over one stream's length, as users' requests would arrive, not as one
    # burst of C; the warm-up covers that ramp plus the first streams' lives, so rates are steady.
    stream_s = cell.max_tokens * plan.paced_delay_ms / 1000.0 if paced else 0.0
    warmup = max(plan.warmup, 2.5 * stream_s)
    procs = min(plan.load_procs, cell.concurrency)
    start_at = time.monotonic() + LOAD_START_S if procs > 1 else None
    argvs = []
    for index in range(procs):
        argv = [
            sys.executable,
            "-m",
            "crossover.loadtest.proxybench.loadgen",
            "--url",
            target.url,
            "--concurrency",
            str(_share(cell.concurrency, procs, index)),
            "--max-tokens",
            str(cell.max_tokens),
            "--timeout",
            str(plan.timeout),
            "--ramp",
            str(stream_s),
        ]
        argv += ["--cpu-pid", str(target.pid)] if index == 0 else []  # one measures, over the shared window
        argv += ["--stream"] if cell.stream else []
        argv += ["--start-at", repr(start_at), "--samples"] if start_at is not None else []
        argv += (
            ["--requests", str(_share(plan.requests, procs, index))]
            if plan.requests
            else ["--duration", str(duration), "--warmup", str(warmup)]
        )
        argvs.append(argv)
    limit = duration + warmup + plan.timeout + CELL_SLACK_S + (LOAD_START_S if start_at else 0.0)
    pinned = cores.split_load(procs)
    running = [
        process.spawn(argv, cwd=REPO_ROOT, affinity=core_set, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        for argv, core_set in zip(argvs, pinned, strict=True)
    ]
    try:
        outputs = [proc.communicate(timeout=limit) for proc in running]
    finally:
        process.stop(running, STOP_TIMEOUT_S)
    reports = []
    for argv, proc, (stdout, stderr) in zip(argvs, running, outputs, strict=True):
        if proc.returncode != 0:
            raise SetupError(f"the load generator failed ({shlex.join(argv)}):\n{stderr.decode().strip()}")
        reports.append(json.loads(stdout))
    return reports[0] if procs == 1 else loadgen.merge(reports)


def _share(total: int, parts: int, index: int) -> int:
    """Part `index` of `total` dealt out as evenly as whole numbers allow."""
    return total // parts + (1 if index < total % parts else 0)


def run(
    plan: Plan,
    targets: tuple[str, ...],
    peers: dict[str, Path],
    setup: Setup = Setup(),
    skipped: dict[str, str] | None = None,
) -> tuple[list[dict], dict[str, str]]:
    """Every cell against every target, `plan.rounds` times in turn: (rows, {target: command line}). Rows
    are each target's rounds of a cell `combine`d, and carry `kind`, `target` and `ratio` (req/s over
    direct's). Targets left out go into `skipped` with their reason."""
    rows: list[dict] = []
    commands: dict[str, str] = {}
    stages = [(0.0, plan.fast_cells())] + ([(plan.paced_delay_ms, [plan.paced_cell()])] if plan.paced else [])
    for delay, cells in stages:
        with running_targets(targets, delay, peers, setup, skipped) as started:
            commands.update({name: target.command for name, target in started.items() if delay == 0.0})
            for name, target in started.items():
                print(f"proxybench: {name} runs on cores {' / '.join(target.cores)}", file=sys.stderr, flush=True)
            names = list(started)
            for cell in cells:
                reports: dict[str, list[dict]] = {name: [] for name in names}
                for turn in range(plan.rounds):
                    # Each round starts one target later, so none always runs first (or right after another).
                    for name in names[turn % len(names) :] + names[: turn % len(names)]:
                        report = run_cell(started[name], cell, plan, setup.cores)
                        reports[name].append(report)
                        print(
                            f"proxybench: {cell.kind} C={cell.concurrency} round {turn + 1}/{plan.rounds} {name}: "
                            f"{report['rps']} req/s, {report['cpu_ms_per_request']} CPU ms/request, "
                            f"{report['errors']} errors",
                            file=sys.stderr,
                            flush=True,
                        )
                combined = {name: combine(runs) for name, runs in reports.items()}
                direct = combined[DIRECT]["rps"]
                for name, row in combined.items():
                    ratio = round(row["rps"] / direct, 3) if direct else None
                    cores = {"cores": list(started[name].cores)}
                    rows.append({"kind": cell.kind, "target": name, "ratio": ratio, **row, **cores})
    return rows, commands


def _targets(text: str) -> tuple[str, ...]:
    names = tuple(part.strip() for part in text.split(","))
    unknown = sorted(set(names) - set(TARGETS))
    if unknown or DIRECT not in names:
        raise argparse.ArgumentTypeError(f"targets are {', '.join(TARGETS)}, and must include {DIRECT}")
    return tuple(name for name in TARGETS if name in names)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m crossover.loadtest.proxybench", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument(
        "--targets",
        type=_targets,
        default=DEFAULT_TARGETS,
        help=f"comma-separated, of {', '.join(TARGETS)} (default: {','.join(DEFAULT_TARGETS)})",
    )
    parser.add_argument("--concurrency", type=positive_int_list, default=Plan.concurrency, help="default 1,32,256")
    parser.add_argument(
        "--max-tokens", type=positive_int, default=Plan.max_tokens, help="chunks per stream (default 64)"
    )
    parser.add_argument("--duration", type=positive_float, default=Plan.duration, help="measured seconds per cell")
    parser.add_argument(
        "--warmup", type=non_negative_float, default=Plan.warmup, help="unmeasured seconds before each cell"
    )
    parser.add_argument("--requests", type=positive_int, help="a fixed number of requests per cell instead of a window")
    parser.add_argument("--no-paced", dest="paced", action="store_false", help="skip the paced run")
    parser.add_argument("--paced-concurrency", type=positive_int, default=Plan.paced_concurrency)
    parser.add_argument(
        "--paced-delay-ms", type=non_negative_float, default=Plan.paced_delay_ms, help="gap between chunks"
    )
    parser.add_argument("--paced-duration", type=positive_float, default=Plan.paced_duration, help="measured seconds")
    parser.add_argument("--timeout", type=positive_float, default=Plan.timeout, help="per request, seconds")
    parser.add_argument(
        "--rounds", type=positive_int, default=Plan.rounds, help="runs of each cell per target, in turn (default 5)"
    )
    parser.add_argument(
        "--crossover-python",
        type=absolute,
        default=sys.executable,
        help="the Python crossover runs on, with crossover installed (default: this one); the deploy image's is a "
        "PGO+LTO build, a pyenv or source build without --enable-optimizations is not",
    )
    parser.add_argument(
        "--venvs", type=Path, default=REPO_ROOT, help="where the peers' venvs are made (default: the repository)"
    )
    parser.add_argument(
        "--wheels",
        type=Path,
        help="install the peers from this directory of wheels only (`pip install --no-index --find-links`): a "
        "host without a registry; fill it where there is one with each peer and all it needs, built for that host's "
        "Python (`pip download --only-binary=:all: --python-version 3.12 smg==... -d DIR`)",
    )
    parser.add_argument(
        "--workers", type=positive_int, help="crossover serve --workers N (left out where the build lacks it)"
    )
    parser.add_argument("--backend-workers", type=positive_int, default=1, help="zero backend processes (default 1)")
    parser.add_argument(
        "--load-procs",
        type=positive_int,
        default=Plan.load_procs,
        help="load generator processes per cell, sharing its concurrency and one window (default 1)",
    )
    for role, who in (
        ("backend", "the zero backend (and a crossover-redis run's redis-server)"),
        ("gateway", "crossover and every peer"),
        ("load", "the load generators, dealt out among them"),
    ):
        parser.add_argument(
            f"--cores-{role}",
            metavar="LIST",
            help=f"pin {who} to these cores (CPU list, e.g. 0-3,8; disjoint from the other sets; default: not pinned)",
        )
    parser.add_argument("--markdown", type=Path, help="also write the table and the bar as markdown here")
    parser.add_argument("--json", type=Path, help="also write every row as JSON here")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # SIGTERM unwinds like Ctrl-C, so every server this run started is stopped on the way out.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    plan = Plan(
        tuple(args.concurrency),
        args.max_tokens,
        args.duration,
        args.warmup,
        args.requests,
        args.paced,
        args.paced_concurrency,
        args.paced_delay_ms,
        args.paced_duration,
        args.timeout,
        args.rounds,
        args.load_procs,
    )
    skipped: dict[str, str] = {}
    try:
        cores = CoreSets.parse(args.cores_backend, args.cores_gateway, args.cores_load)
        ours = {CROSSOVER, *VARIANTS} & set(args.targets)
        if ours and args.crossover_python != sys.executable:  # this one runs crossover already
            check_crossover_python(args.crossover_python)
        if args.wheels is not None and not args.wheels.is_dir():
            raise SetupError(f"--wheels {args.wheels}: not a directory")
        peers = {name: PEERS[name].installed(args.venvs, args.wheels) for name in args.targets if name in PEERS}
        setup = Setup(cores, args.crossover_python, args.workers, args.backend_workers)
        rows, commands = run(plan, args.targets, peers, setup, skipped)
    except (CoreError, SetupError, InstallFailed, process.NotReady, subprocess.TimeoutExpired) as exc:
        print(f"proxybench: {exc}", file=sys.stderr)
        return 2
    bars: list[Bar] = check_bar(rows)
    command = shlex.join(["python", "-m", "crossover.loadtest.proxybench", *(sys.argv[1:] if argv is None else argv)])
    print(render_text(rows, bars))
    print()
    print(render_summary(rows))
    for name, reason in skipped.items():
        print(f"SKIPPED  {name}: {reason}")
    if args.markdown:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text(render_markdown(rows, bars, command, commands, skipped))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        result = {
            "command": command,
            "targets": commands,
            "skipped": skipped,
            "rows": rows,
            "bar": [bar.__dict__ for bar in bars],
        }
        args.json.write_text(json.dumps(result, indent=1))
    return 1 if any(bar.passed is False for bar in bars) else 0


if __name__ == "__main__":
    sys.exit(main())
