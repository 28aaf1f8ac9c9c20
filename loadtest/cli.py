"""`crossover bench` and `crossover bench report`: argument parsing only; the work lives in bench.py/report.py."""

from __future__ import annotations

import argparse
import json
import os
import sys
from datetime import datetime
from pathlib import Path
from urllib.parse import urlsplit

DEFAULT_CONCURRENCY = "1,2,5,10,30,70,100,250"  # the levels the Kimi-K2.5 deployment measured
DEFAULT_OUTPUT_LEN = 512
DEFAULT_INPUT_LEN = 256


def register(subparsers: argparse._SubParsersAction) -> None:
    from crossover.loadtest.config import DEFAULT_REQUEST_TIMEOUT_S, DEFAULT_WARMUP_ROUNDS

    bench = subparsers.add_parser(
        "bench",
        help="closed-loop concurrency sweep of OpenAI-compatible targets; finds the crossover",
        description="Sweep each --target with closed-loop streaming chat completions at every concurrency, "
        "write results.json/results.csv/throughput.png/latency.png, find where the plain target's "
        "throughput meets the speculative one's and recommend a gateway threshold.",
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
        default=DEFAULT_CONCURRENCY,
        metavar="C,C,...",
        help=f"levels, run in ascending order (default {DEFAULT_CONCURRENCY})",
    )
    bench.add_argument("--output-len", type=int, default=DEFAULT_OUTPUT_LEN, help="max_tokens per request")
    bench.add_argument("--input-len", type=int, default=DEFAULT_INPUT_LEN, help="approximate prompt tokens")
    amount = bench.add_mutually_exclusive_group()
    amount.add_argument(
        "--requests-per-level",
        type=int,
        metavar="N",
        help="measured requests per target and level (default 3 x C, at least 16)",
    )
    amount.add_argument(
        "--duration-per-level", type=float, metavar="S", help="measure each target and level for S seconds instead"
    )
    bench.add_argument(
        "--warmup-rounds",
        type=int,
        default=DEFAULT_WARMUP_ROUNDS,
        metavar="R",
        help=f"unmeasured requests per level, in rounds of C (default {DEFAULT_WARMUP_ROUNDS})",
    )
    bench.add_argument(
        "--lockstep",
        action="store_true",
        help="start all C workers with full-length requests at once and let them stay in step "
        "(bench_serving's and the stand-in's virtual curves' closed loop); default: out of step",
    )
    bench.add_argument("--model", help="model name to request (default: the first of the first target's /v1/models)")
    bench.add_argument("--speculative", default="speculative", metavar="NAME", help="the speculative target")
    bench.add_argument("--plain", default="plain", metavar="NAME", help="the plain target")
    bench.add_argument("--out", type=Path, help="output directory (default ./crossover-bench-<time>)")
    bench.add_argument("--apply", metavar="GATEWAY_URL", help="PUT the recommended threshold to this gateway")
    bench.add_argument("--admin-token", help="gateway admin token (default $CROSSOVER_ADMIN_TOKEN)")
    bench.add_argument("--api-key", help="bearer token for the targets (default $OPENAI_API_KEY)")
    bench.add_argument("--extra-body", default="{}", metavar="JSON", help="fields merged into every request")
    bench.add_argument(
        "--no-ignore-eos",
        dest="ignore_eos",
        action="store_false",
        help="let requests stop at EOS (default: ignore_eos, exactly --output-len tokens)",
    )
    bench.add_argument(
        "--request-timeout",
        type=float,
        default=DEFAULT_REQUEST_TIMEOUT_S,
        metavar="S",
        help="limit on one whole request",
    )
    bench.add_argument("--seed", type=int, default=0, help="seed for prompt generation")
    bench.add_argument("--no-plots", dest="plots", action="store_false", help="skip the PNGs")
    bench.set_defaults(run=run_bench)

    sub = bench.add_subparsers(dest="bench_command", metavar="{report}")
    report = sub.add_parser(
        "report",
        help="re-draw and compare saved runs",
        description="Print, re-draw and compare results of earlier `crossover bench` runs.",
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


def parse_targets(values: list[str]):
    from crossover.loadtest.config import Target

    if not values:
        raise UsageError("give at least one --target NAME=URL")
    targets = []
    for value in values:
        name, sep, url = value.partition("=")
        parts = urlsplit(url)
        if not sep or not name or parts.scheme not in ("http", "https") or not parts.hostname:
            raise UsageError(f"--target {value!r}: expected NAME=http(s)://HOST:PORT")
        targets.append(Target(name=name, url=url))
    names = [t.name for t in targets]
    if len(set(names)) != len(names):
        raise UsageError(f"--target names must be unique, got {names}")
    return targets


def parse_concurrency(value: str) -> list[int]:
    try:
        levels = sorted({int(part) for part in value.split(",") if part.strip()})
    except ValueError:
        raise UsageError(f"--concurrency {value!r}: expected positive integers like 1,2,5,10") from None
    if not levels or levels[0] < 1:
        raise UsageError(f"--concurrency {value!r}: expected positive integers like 1,2,5,10")
    return levels


def _positive(name: str, value: float | None) -> None:
    if value is not None and value <= 0:
        raise UsageError(f"{name} must be positive, got {value}")


def _admin_token(args: argparse.Namespace) -> str | None:
    token = args.admin_token or os.environ.get("CROSSOVER_ADMIN_TOKEN")
    if args.apply and not token:
        raise UsageError("--apply needs --admin-token (or $CROSSOVER_ADMIN_TOKEN)")
    return token


def _fail(exc: Exception, code: int) -> int:
    print(f"crossover bench: {exc}", file=sys.stderr)
    return code


def run_bench(args: argparse.Namespace) -> int:
    from crossover.loadtest.bench import BenchPlan, run
    from crossover.loadtest.config import LoadSettings
    from crossover.loadtest.extras import MissingExtra

    try:
        targets = parse_targets(args.target)
        concurrencies = parse_concurrency(args.concurrency)
        for name, value in (
            ("--output-len", args.output_len),
            ("--input-len", args.input_len),
            ("--requests-per-level", args.requests_per_level),
            ("--duration-per-level", args.duration_per_level),
            ("--request-timeout", args.request_timeout),
        ):
            _positive(name, value)
        if args.warmup_rounds < 0:
            raise UsageError(f"--warmup-rounds must be 0 or more, got {args.warmup_rounds}")
        try:
            extra_body = json.loads(args.extra_body)
        except ValueError as exc:
            raise UsageError(f"--extra-body is not JSON: {exc}") from None
        if not isinstance(extra_body, dict):
            raise UsageError("--extra-body must be a JSON object")
        token = _admin_token(args)
    except UsageError as exc:
        return _fail(exc, 2)

    api_key = args.api_key or os.environ.get("OPENAI_API_KEY")
    plan = BenchPlan(
        targets=targets,
        concurrencies=concurrencies,
        workload_model=args.model,
        output_len=args.output_len,
        input_len=args.input_len,
        ignore_eos=args.ignore_eos,
        extra_body=extra_body,
        load=LoadSettings(
            requests=args.requests_per_level,
            duration_s=args.duration_per_level,
            warmup_rounds=args.warmup_rounds,
            lockstep=args.lockstep,
            request_timeout_s=args.request_timeout,
            headers={"Authorization": f"Bearer {api_key}"} if api_key else {},
            seed=args.seed,
        ),
        speculative=args.speculative,
        plain=args.plain,
        out_dir=args.out or Path(f"crossover-bench-{datetime.now():%Y%m%d-%H%M%S}"),
        plots=args.plots,
        apply_url=args.apply,
        admin_token=token,
    )
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
