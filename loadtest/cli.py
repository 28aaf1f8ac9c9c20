"""`crossover bench` and `crossover bench report`: argument parsing only; the work lives in bench.py/report.py."""

from __future__ import annotations

import argparse
import os
import sys
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING

from crossover.gateway.cli import non_negative_int, positive_float, positive_int, positive_int_list
from crossover.loadtest.config import (
    DEFAULT_CONCURRENCY,
    DEFAULT_INPUT_LEN,
    DEFAULT_OUTPUT_LEN,
    DEFAULT_PASSES,
    DEFAULT_REQUEST_TIMEOUT_S,
    DEFAULT_WARMUP_ROUNDS,
)

if TYPE_CHECKING:
    from pydantic import ValidationError

    from crossover.loadtest.plan import Target

DEFAULT_SPECULATIVE, DEFAULT_PLAIN = "speculative", "plain"
# Plan fields -> the flag a user would fix.
FLAGS = {
    "targets": "--target",
    "concurrencies": "--concurrency",
    "output_len": "--output-len",
    "input_len": "--input-len",
    "extra_body": "--extra-body",
    "requests": "--requests-per-level",
    "duration_s": "--duration-per-level",
    "warmup_rounds": "--warmup-rounds",
    "passes": "--passes",
    "request_timeout_s": "--request-timeout",
}


def register(subparsers: argparse._SubParsersAction) -> None:
    bench = subparsers.add_parser(
        "bench",
        help="closed-loop concurrency sweep of OpenAI-compatible targets; finds the crossover",
        description="Sweep each --target with closed-loop streaming chat completions at every concurrency, "
        "write results.json/results.csv/throughput.png/latency.png, find where the plain target's "
        "throughput meets the speculative one's and recommend a gateway threshold.",
        epilog="Exit status: 0 done; 1 the run failed, --apply failed, or the crossover was refused because a "
        "simulated target fell behind its schedule in a level even when its passes were measured again (results "
        "are still written); 2 bad arguments.",
    )
    bench.add_argument(
        "--target",
        action="append",
        default=[],
        metavar="NAME=URL",
        help="a server to benchmark, e.g. speculative=http://127.0.0.1:30001 (repeatable)",
    )
    bench.add_argument(
        "--concurrency",
        type=positive_int_list,
        default=list(DEFAULT_CONCURRENCY),
        metavar="C,C,...",
        help=f"levels, run in ascending order (default {','.join(map(str, DEFAULT_CONCURRENCY))})",
    )
    bench.add_argument(
        "--output-len",
        type=positive_int,
        default=DEFAULT_OUTPUT_LEN,
        help="max_tokens per request (default: %(default)s)",
    )
    bench.add_argument(
        "--input-len",
        type=positive_int,
        default=DEFAULT_INPUT_LEN,
        help="approximate prompt tokens (default: %(default)s)",
    )
    amount = bench.add_mutually_exclusive_group()
    amount.add_argument(
        "--requests-per-level",
        type=positive_int,
        metavar="N",
        help="measured requests per target and level (default 3 x C, at least 16)",
    )
    amount.add_argument(
        "--duration-per-level",
        type=positive_float,
        metavar="S",
        help="measure each target and level for S seconds instead",
    )
    bench.add_argument(
        "--warmup-rounds",
        type=non_negative_int,
        default=DEFAULT_WARMUP_ROUNDS,
        metavar="R",
        help=f"unmeasured requests per pass of a level, in rounds of C (default {DEFAULT_WARMUP_ROUNDS})",
    )
    bench.add_argument(
        "--passes",
        type=positive_int,
        default=DEFAULT_PASSES,
        metavar="N",
        help="measure each level in N passes, the targets alternating (A B B A), each a warm-up and a window of "
        "its share of the level: load that drifts widens the intervals instead of faking a lead; a pass a "
        f"stand-in fell behind in is measured again (default {DEFAULT_PASSES})",
    )
    bench.add_argument(
        "--lockstep",
        action="store_true",
        help="start all C workers with full-length requests at once and let them stay in step "
        "(bench_serving's and the stand-in's virtual curves' closed loop); default: out of step",
    )
    bench.add_argument("--model", help="model name to request (default: the first of the first target's /v1/models)")
    bench.add_argument(
        "--speculative",
        default=DEFAULT_SPECULATIVE,
        metavar="NAME",
        help="the speculative target (default: %(default)s; gate-off with --in-engine)",
    )
    bench.add_argument(
        "--plain",
        default=DEFAULT_PLAIN,
        metavar="NAME",
        help="the plain target (default: %(default)s; gate-0 with --in-engine)",
    )
    bench.add_argument(
        "--in-engine",
        metavar="URL",
        help="a patched SGLang (patches/sglang-0.5.23): measure it with its gate off and at 0 as targets gate-off "
        "and gate-0 (the crossover then compares those two; its own gate is restored at the end)",
    )
    bench.add_argument(
        "--admin-key-file", type=Path, metavar="FILE", help="the --in-engine server's admin key, for setting its gate"
    )
    bench.add_argument("--out", type=Path, help="output directory (default ./crossover-bench-<time>)")
    bench.add_argument("--apply", metavar="GATEWAY_URL", help="PUT the recommended threshold to this gateway")
    bench.add_argument("--admin-token", help="gateway admin token (default $CROSSOVER_ADMIN_TOKEN)")
    bench.add_argument("--api-key", help="bearer token for the targets (default $OPENAI_API_KEY)")
    bench.add_argument(
        "--extra-body", default="{}", metavar="JSON", help="fields merged into every request (default: none)"
    )
    bench.add_argument(
        "--no-ignore-eos",
        dest="ignore_eos",
        action="store_false",
        help="let requests stop at EOS (default: ignore_eos, exactly --output-len tokens)",
    )
    bench.add_argument(
        "--request-timeout",
        type=positive_float,
        default=DEFAULT_REQUEST_TIMEOUT_S,
        metavar="S",
        help="limit on one whole request (default: %(default)g)",
    )
    bench.add_argument("--seed", type=int, default=0, help="seed for prompt generation (default: %(default)s)")
    bench.add_argument("--no-plots", dest="plots", action="store_false", help="skip the PNGs")
    bench.set_defaults(run=run_bench)

    sub = bench.add_subparsers(dest="bench_command", metavar="{report}")
    report = sub.add_parser(
        "report",
        help="re-draw and compare saved runs",
        description="Print, re-draw and compare results of earlier `crossover bench` runs.",
        epilog="Exit status: 0 done; 1 a results file unreadable, --apply failed, or a run's crossover was refused "
        "(as its bench exited; its plots say REFUSED); 2 bad arguments.",
    )
    report.add_argument("dirs", nargs="+", type=Path, metavar="DIR", help="run directories (or results.json)")
    report.add_argument(
        "--out",
        type=Path,
        help="where to draw (default: the run's own directory for one run, ./crossover-report for several)",
    )
    report.add_argument("--speculative", metavar="NAME", help="re-analyse with this speculative target")
    report.add_argument("--plain", metavar="NAME", help="re-analyse with this plain target")
    report.add_argument("--no-plots", dest="plots", action="store_false", help="tables only")
    report.add_argument("--apply", metavar="GATEWAY_URL", help="PUT this run's recommendation to a gateway")
    report.add_argument("--admin-token", help="gateway admin token (default $CROSSOVER_ADMIN_TOKEN)")
    report.set_defaults(run=run_report)


class UsageError(Exception):
    pass


def parse_targets(values: list[str], in_engine: str | None = None) -> list[Target]:
    """`NAME=URL` flags -> targets (the URL itself is checked by the model); `--in-engine` adds its two."""
    from pydantic import ValidationError

    from crossover.loadtest.engine_gate import GATES
    from crossover.loadtest.plan import Target

    targets = []
    if in_engine is not None:
        try:
            targets = [Target(name=name, url=in_engine) for name in GATES]
        except ValidationError:
            raise UsageError(f"--in-engine {in_engine!r}: expected http(s)://HOST:PORT") from None
    for value in values:
        name, sep, url = value.partition("=")
        try:
            if not sep:
                raise ValueError
            targets.append(Target(name=name, url=url))
        except (ValueError, ValidationError):
            raise UsageError(f"--target {value!r}: expected NAME=http(s)://HOST:PORT") from None
    if not targets:
        raise UsageError("give at least one --target NAME=URL (or --in-engine URL)")
    return targets


def plan_error(exc: ValidationError) -> UsageError:
    """The first problem of a plan, named by the flag that sets it."""
    error = exc.errors()[0]
    fields = [part for part in error["loc"] if isinstance(part, str)]
    flag = next((FLAGS[part] for part in reversed(fields) if part in FLAGS), None)
    message = error["msg"].removeprefix("Value error, ")
    return UsageError(f"{flag}: {message}" if flag else message)


def read_key(path: Path | None) -> str | None:
    from crossover.gateway.config import read_key_file

    try:
        return None if path is None else read_key_file(path, "--admin-key-file")
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def _admin_token(args: argparse.Namespace) -> str | None:
    token = args.admin_token or os.environ.get("CROSSOVER_ADMIN_TOKEN")
    if args.apply and not token:
        raise UsageError("--apply needs --admin-token (or $CROSSOVER_ADMIN_TOKEN)")
    return token


def _fail(exc: Exception, code: int) -> int:
    print(f"crossover bench: {exc}", file=sys.stderr)
    return code


def run_bench(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from crossover.loadtest.bench import run
    from crossover.loadtest.engine_gate import GATE_OFF, GATE_ZERO
    from crossover.loadtest.extras import MissingExtra
    from crossover.loadtest.plan import BenchPlan, LoadSettings

    api_key = args.api_key or os.environ.get("OPENAI_API_KEY")
    try:
        speculative, plain = args.speculative, args.plain
        if args.in_engine is not None and (speculative, plain) == (DEFAULT_SPECULATIVE, DEFAULT_PLAIN):
            speculative, plain = GATE_OFF, GATE_ZERO
        plan = BenchPlan(
            targets=parse_targets(args.target, args.in_engine),
            concurrencies=args.concurrency,
            workload_model=args.model,
            output_len=args.output_len,
            input_len=args.input_len,
            ignore_eos=args.ignore_eos,
            extra_body=args.extra_body,
            load=LoadSettings(
                requests=args.requests_per_level,
                duration_s=args.duration_per_level,
                warmup_rounds=args.warmup_rounds,
                passes=args.passes,
                lockstep=args.lockstep,
                request_timeout_s=args.request_timeout,
                headers={"Authorization": f"Bearer {api_key}"} if api_key else {},
                seed=args.seed,
            ),
            speculative=speculative,
            plain=plain,
            out_dir=args.out or Path(f"crossover-bench-{datetime.now():%Y%m%d-%H%M%S}"),
            plots=args.plots,
            apply_url=args.apply,
            admin_token=args.admin_token or os.environ.get("CROSSOVER_ADMIN_TOKEN"),
            in_engine_url=args.in_engine,
            in_engine_admin_key=read_key(args.admin_key_file),
        )
    except UsageError as exc:
        return _fail(exc, 2)
    except ValidationError as exc:
        return _fail(plan_error(exc), 2)
    try:
        return run(plan)
    except MissingExtra as exc:
        return _fail(exc, 2)


def run_report(args: argparse.Namespace) -> int:
    from crossover.loadtest.extras import MissingExtra
    from crossover.loadtest.report import run_report as report

    try:
        token = _admin_token(args)
        return report(args.dirs, args.out, args.speculative, args.plain, args.plots, args.apply, token)
    except UsageError as exc:
        return _fail(exc, 2)
    except MissingExtra as exc:
        return _fail(exc, 2)
