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
told (how a Python was built changes what crossover costs: README, "Performance"). Every target's CPU time
(its whole process tree, from /proc) is measured over each cell's window by the load generator. Exit
status: 0 if every bar line that could be checked passed, 1 if one failed, 2 if the run could not be set up.
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
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from crossover.gateway.cli import non_negative_float, positive_float, positive_int, positive_int_list
from crossover.loadtest.proxybench.peers import PEERS, SMG, VLLM_ROUTER, InstallFailed
from crossover.loadtest.proxybench.report import (
    CROSSOVER,
    DIRECT,
    Bar,
    check_bar,
    combine,
    render_markdown,
    render_text,
)
from crossover.servers import process

HOST = "127.0.0.1"
TARGETS = (DIRECT, CROSSOVER, *PEERS)
DEFAULT_TARGETS = (DIRECT, CROSSOVER, SMG, VLLM_ROUTER)  # sglang-router: superseded by smg, on request only
REPO_ROOT = Path(__file__).resolve().parents[2]  # where the servers and load generators run
READY_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 10.0
# A cell's load generator gets its own window plus this much to start, drain and report.
CELL_SLACK_S = 30.0


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

    def fast_cells(self) -> list[Cell]:
        return [Cell(kind, c, self.max_tokens) for kind in ("stream", "non-stream") for c in self.concurrency]

    def paced_cell(self) -> Cell:
        return Cell("paced", self.paced_concurrency, self.max_tokens)


def spawn(argv: list[str], cwd: Path | None = None) -> subprocess.Popen:
    # stdout goes to our stderr: this process's stdout carries the table only.
    return process.spawn(argv, cwd=cwd, stdout=sys.stderr)


def wait_serving(url: str, proc: subprocess.Popen) -> None:
    """Ready means a whole chat completion comes back 200: the full path works, not just /health."""
    body = {"model": "zero", "messages": [{"role": "user", "content": "ready?"}], "max_tokens": 1}
    process.wait_ready(url + "/v1/chat/completions", proc, READY_TIMEOUT_S, json=body)


def crossover_config(workdir: Path, spec_url: str, plain_url: str) -> Path:
    # Both pools point at the one backend (through two of its ports: the pools must not share an address).
    path = workdir / "crossover.toml"
    path.write_text(
        'log_level = "warning"\n'
        f'[pools.speculative]\nbackends = ["{spec_url}"]\n'
        f'[pools.plain]\nbackends = ["{plain_url}"]\n'
    )
    return path


@dataclass(frozen=True)
class Target:
    url: str
    pid: int  # the root of the process tree whose CPU time is this target's
    command: str  # how it was started, for the report


def start(argv: list[str], url: str, cwd: Path, procs: list[subprocess.Popen]) -> Target:
    """`argv` started in `cwd` (added to `procs` as soon as it runs, for the caller to stop) and serving `url`."""
    procs.append(spawn(argv, cwd))
    wait_serving(url, procs[-1])
    return Target(url, procs[-1].pid, shlex.join(argv))


def zerobackend_argv(port: int, second_port: int, chunk_delay_ms: float) -> list[str]:
    argv = [sys.executable, "-m", "crossover.loadtest.proxybench.zerobackend", "--host", HOST]
    return [*argv, "--port", str(port), "--port", str(second_port), "--chunk-delay-ms", str(chunk_delay_ms)]


def crossover_argv(python: str, config: Path, port: int) -> list[str]:
    argv = [python, "-m", "crossover.gateway.cli", "serve", "--config", str(config)]
    return [*argv, "--host", HOST, "--port", str(port)]


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


@contextlib.contextmanager
def running_targets(
    targets: tuple[str, ...], chunk_delay_ms: float, peers: dict[str, Path], crossover_python: str = sys.executable
) -> Iterator[dict[str, Target]]:
    """Start the backend and the proxies in front of it; yield {target: Target}; stop them all.
    `peers` holds each peer target's executable; crossover runs on `crossover_python`."""
    procs: list[subprocess.Popen] = []
    started: dict[str, Target] = {}
    with tempfile.TemporaryDirectory(prefix="proxybench-") as tmp:
        try:
            port, second_port = process.free_port(HOST), process.free_port(HOST)
            backend_url = f"http://{HOST}:{port}"
            backend = zerobackend_argv(port, second_port, chunk_delay_ms)
            started[DIRECT] = start(backend, backend_url, REPO_ROOT, procs)
            if CROSSOVER in targets:
                config = crossover_config(Path(tmp), backend_url, f"http://{HOST}:{second_port}")
                ours = process.free_port(HOST)
                argv = crossover_argv(crossover_python, config, ours)
                started[CROSSOVER] = start(argv, f"http://{HOST}:{ours}", REPO_ROOT, procs)
            for name, exe in peers.items():
                theirs = process.free_port(HOST)
                argv = PEERS[name].argv(exe, backend_url, HOST, theirs, process.free_port(HOST))
                started[name] = start(argv, f"http://{HOST}:{theirs}", Path(tmp), procs)
            yield {name: started[name] for name in targets}
        finally:
            process.stop(procs, STOP_TIMEOUT_S)


def run_cell(target: Target, cell: Cell, plan: Plan) -> dict:
    """One load generator run against `target`, measuring its CPU time; returns loadgen's report."""
    paced = cell.kind == "paced"
    duration = plan.paced_duration if paced else plan.duration
    # Paced streams start spread over one stream's length, as users' requests would arrive, not as one
    # burst of C; the warm-up covers that ramp plus the first streams' lives, so rates are steady.
    stream_s = cell.max_tokens * plan.paced_delay_ms / 1000.0 if paced else 0.0
    warmup = max(plan.warmup, 2.5 * stream_s)
    argv = [
        sys.executable,
        "-m",
        "crossover.loadtest.proxybench.loadgen",
        "--url",
        target.url,
        "--cpu-pid",
        str(target.pid),
        "--concurrency",
        str(cell.concurrency),
        "--max-tokens",
        str(cell.max_tokens),
        "--timeout",
        str(plan.timeout),
        "--ramp",
        str(stream_s),
    ]
    argv += ["--stream"] if cell.stream else []
    argv += (
        ["--requests", str(plan.requests)] if plan.requests else ["--duration", str(duration), "--warmup", str(warmup)]
    )
    limit = duration + warmup + plan.timeout + CELL_SLACK_S
    done = subprocess.run(argv, capture_output=True, text=True, timeout=limit, check=False, cwd=REPO_ROOT)
    if done.returncode != 0:
        raise SetupError(f"the load generator failed ({shlex.join(argv)}):\n{done.stderr.strip()}")
    return json.loads(done.stdout)


def run(
    plan: Plan, targets: tuple[str, ...], peers: dict[str, Path], crossover_python: str = sys.executable
) -> tuple[list[dict], dict[str, str]]:
    """Every cell against every target, `plan.rounds` times in turn: (rows, {target: command line}). Rows
    are each target's rounds of a cell `combine`d, and carry `kind`, `target` and `ratio` (req/s over
    direct's)."""
    rows: list[dict] = []
    commands: dict[str, str] = {}
    stages = [(0.0, plan.fast_cells())] + ([(plan.paced_delay_ms, [plan.paced_cell()])] if plan.paced else [])
    for delay, cells in stages:
        with running_targets(targets, delay, peers, crossover_python) as started:
            commands.update({name: target.command for name, target in started.items() if delay == 0.0})
            names = list(started)
            for cell in cells:
                reports: dict[str, list[dict]] = {name: [] for name in names}
                for turn in range(plan.rounds):
                    # Each round starts one target later, so none always runs first (or right after another).
                    for name in names[turn % len(names) :] + names[: turn % len(names)]:
                        report = run_cell(started[name], cell, plan)
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
                    rows.append({"kind": cell.kind, "target": name, "ratio": ratio, **row})
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
    )
    try:
        if CROSSOVER in args.targets and args.crossover_python != sys.executable:  # this one runs crossover already
            check_crossover_python(args.crossover_python)
        peers = {name: PEERS[name].installed(args.venvs) for name in args.targets if name in PEERS}
        rows, commands = run(plan, args.targets, peers, args.crossover_python)
    except (SetupError, InstallFailed, process.NotReady, subprocess.TimeoutExpired) as exc:
        print(f"proxybench: {exc}", file=sys.stderr)
        return 2
    bars: list[Bar] = check_bar(rows)
    command = shlex.join(["python", "-m", "crossover.loadtest.proxybench", *(sys.argv[1:] if argv is None else argv)])
    print(render_text(rows, bars))
    if args.markdown:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text(render_markdown(rows, bars, command, commands))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        result = {"command": command, "targets": commands, "rows": rows, "bar": [bar.__dict__ for bar in bars]}
        args.json.write_text(json.dumps(result, indent=1))
    return 1 if any(bar.passed is False for bar in bars) else 0


if __name__ == "__main__":
    sys.exit(main())
