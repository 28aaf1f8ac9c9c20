"""SGLang's `--speculative-adaptive-config` from a measurement: speculate where it measured ahead, stop at the
measured crossover.

    config, notes = adaptive_config(read_results(Path("runs/k25/results.json")))
    crossover servers adaptive-config runs/k25/results.json -o k25-adaptive.json   # the command (register())

It reads a `crossover bench` run, so it lives with loadtest; its command stays under `crossover servers`
(registered through the `crossover.servers_commands` entry points).

SGLang 0.5.23 (`speculative/adaptive_spec_params.py`) routes each decode batch to the slot with the largest
integer key <= the batch size (padded to a captured CUDA-graph size) and moves the draft steps within that
slot's `candidate_steps` by acceptance. Its default config moves on acceptance, not on cost, so it never
turns speculation off under load at the default running cap of 48. This writes two slots from a `crossover
bench` run of a speculative and a plain server: `"1"` with draft steps (speculation measured ahead there) and
`"<ceil(crossover)>"` with `[0]` (from the measured crossover on, the plain configuration measured ahead).
Keys that are not integers are ignored by SGLang's loader; `"_crossover"` records where the numbers came from.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from crossover.loadtest.crossover import find_crossover
from crossover.loadtest.uncertainty import margin

DEFAULT_STEPS = [1, 2, 3]
# SGLang's own defaults for a slot (DEFAULT_ADAPTIVE_CONFIG in 0.5.23), written out so the file says them.
SLOT_DEFAULTS = {"up_hysteresis": 0.0, "down_hysteresis": -0.25, "ceiling_coeff": 0}
LIMITS = [
    "it cannot raise the running-request cap: an EAGLE server started without --max-running-requests runs at "
    "most 48, so a zero-step slot above 48 is never reached",
    "at zero steps each decode step is still a 1-token verify pass, plus the draft-extend pass unless "
    "SGLANG_SPEC_SKIP_ZERO_STEP_DRAFT_EXTEND=1 is set: not the cost of a plain server",
    "adaptive speculation runs with --speculative-eagle-topk 1 only, and not with DP attention, multi-layer "
    "EAGLE or two-batch overlap",
    "slots route on the CUDA-graph batch size a batch is padded to, so the zero-step slot takes effect at the "
    "first captured size >= its key",
]


class AdaptiveConfigError(ValueError):
    """The results file cannot give a config (unreadable, or no speculative/plain pair measured)."""


class _Loose(BaseModel):
    model_config = ConfigDict(extra="ignore")


class _Level(_Loose):
    target: str
    concurrency: int = Field(ge=1)
    output_throughput: float
    output_throughput_interval: tuple[float, float] | None = None
    failed: int = 0
    completed: int | None = None  # 0: no data at this level (None: a writer that did not say)


class _Target(_Loose):
    server_info: dict | None = None


class _Metadata(_Loose):
    targets: dict[str, _Target] = Field(default_factory=dict)


class _Crossover(_Loose):
    speculative: str | None = None
    plain: str | None = None
    status: str | None = None
    reason: str | None = None


class BenchResults(_Loose):
    """The part of a `crossover bench` results.json (loadtest/results.schema.json) this needs."""

    schema_version: int
    metadata: _Metadata = Field(default_factory=_Metadata)
    levels: list[_Level]
    crossover: _Crossover = Field(default_factory=_Crossover)


def read_results(path: Path) -> BenchResults:
    file = path / "results.json" if path.is_dir() else path
    try:
        return BenchResults.model_validate_json(file.read_text())
    except OSError as exc:
        raise AdaptiveConfigError(f"{file}: cannot read ({exc.strerror})") from None
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise AdaptiveConfigError(f"{file}: not a crossover bench results file ({where}: {first['msg']})") from None


def adaptive_config(
    results: BenchResults,
    *,
    speculative: str | None = None,
    plain: str | None = None,
    steps: list[int] | None = None,
) -> tuple[dict, list[str]]:
    """(config for --speculative-adaptive-config, notes for the operator)."""
    speculative = speculative or results.crossover.speculative or "speculative"
    plain = plain or results.crossover.plain or "plain"
    curves: dict[str, dict[int, float]] = {speculative: {}, plain: {}}
    intervals: dict[tuple[str, int], tuple[float, float] | None] = {}
    for level in results.levels:
        if level.target in curves and level.completed != 0 and level.output_throughput > 0:  # no data is no point
            curves[level.target][level.concurrency] = level.output_throughput
            intervals[level.target, level.concurrency] = level.output_throughput_interval
    missing = [name for name, curve in curves.items() if not curve]
    if missing:
        found = sorted({lv.target for lv in results.levels})
        raise AdaptiveConfigError(
            f"no measured levels for target(s) {', '.join(missing)} (the run has {', '.join(found) or 'none'}); "
            "name the pair with --speculative and --plain"
        )
    # The same call on the curves as `crossover bench` made (crossover.analyse): told apart only beyond the
    # levels' intervals, so the zero-step slot goes where the bench said, or nowhere when it was too close to call.
    margins = {
        c: margin(curves[speculative][c], curves[plain][c], intervals[speculative, c], intervals[plain, c])
        for c in curves[speculative].keys() & curves[plain].keys()
    }
    found = _plain(find_crossover(curves[speculative], curves[plain], margins))
    if found["status"] == "no_common_levels":
        raise AdaptiveConfigError(f"{speculative} and {plain} share no concurrency level: nothing to compare")
    info = results.metadata.targets.get(speculative, _Target()).server_info or {}
    measured_steps = info.get("speculative_num_steps")
    if steps is None:
        steps = list(range(1, measured_steps + 1)) if isinstance(measured_steps, int) and measured_steps > 0 else None
    steps = steps or DEFAULT_STEPS
    notes = []
    if results.crossover.status == "refused":
        notes.append(
            f"the bench refused to name a crossover ({results.crossover.reason or 'see its results'}): this config "
            "comes from curves it did not trust; measure again before using it"
        )
    crossover = found["concurrency"]
    if found["status"] == "at_or_below_lowest_level":
        config = {"1": {"candidate_steps": [0], **SLOT_DEFAULTS}}
        zero_at: int | None = 1
        notes.append(
            f"plain measured ahead already at the lowest level (C = {found['bracket'][0]}): speculation is off at "
            "every batch size; a plain server would serve this load better"
        )
    elif found["status"] == "within_noise":
        config = {"1": {"candidate_steps": steps, **SLOT_DEFAULTS}}
        zero_at = None
        low, high = found["bracket"]
        notes.append(
            f"no clear crossover between C = {low} and C = {high} (the curves are within noise there): no "
            "zero-step slot; measure longer or repeat the levels to tell them apart"
        )
    elif crossover is None:
        config = {"1": {"candidate_steps": steps, **SLOT_DEFAULTS}}
        zero_at = None
        notes.append(
            f"speculation measured ahead at every level up to C = {max(curves[speculative])}: no zero-step slot; "
            "measure higher concurrencies to find where it stops paying"
        )
    else:
        zero_at = max(2, math.ceil(crossover))
        config = {
            "1": {"candidate_steps": steps, **SLOT_DEFAULTS},
            str(zero_at): {"candidate_steps": [0], **SLOT_DEFAULTS},
        }
        notes.append(
            f"crossover measured at C = {crossover:.1f} (between {found['bracket'][0]} and {found['bracket'][1]}): "
            f"draft steps {steps} below batch {zero_at}, none from {zero_at} on"
        )
    cap = info.get("max_running_requests")
    if zero_at is not None and isinstance(cap, int) and cap < zero_at:
        notes.append(
            f"the measured speculative server ran with max_running_requests {cap} < {zero_at}: its batches never "
            f"reach the zero-step slot; start it with --max-running-requests >= {zero_at}"
        )
    config["_crossover"] = {
        "note": "written by `crossover servers adaptive-config`; SGLang ignores keys that are not integers",
        "speculative": speculative,
        "plain": plain,
        "crossover_concurrency": crossover,
        "status": found["status"],
        "evidence": found["evidence"],
        "cannot_change": LIMITS,
    }
    notes.extend(f"cannot change: {limit}" for limit in LIMITS)
    return config, notes


def _plain(found) -> dict:
    """find_crossover's answer as a dict (it is a dict or a dataclass of pydantic models, by loadtest version)."""
    if isinstance(found, dict):
        return found
    return {
        "concurrency": found.concurrency,
        "bracket": list(found.bracket) if found.bracket else None,
        "status": found.status,
        "evidence": [e.model_dump() if hasattr(e, "model_dump") else dict(e) for e in found.evidence],
    }


def register(sub: argparse._SubParsersAction) -> None:
    """`crossover servers adaptive-config`, added to the `servers` subcommands."""
    adaptive = sub.add_parser(
        "adaptive-config",
        help="SGLang --speculative-adaptive-config JSON from a `crossover bench` run (speculative vs plain)",
    )
    adaptive.add_argument("results", type=Path, metavar="RESULTS_JSON", help="results.json or its run directory")
    adaptive.add_argument("-o", "--output", type=Path, help="write the config here (default: stdout)")
    adaptive.add_argument("--speculative", help="the speculative target's name (default: the run's)")
    adaptive.add_argument("--plain", help="the plain target's name (default: the run's)")
    adaptive.add_argument(
        "--steps",
        type=_steps_list,
        metavar="S1,S2,...",
        help="candidate draft steps below the crossover (default: 1..the measured server's num_steps, or 1,2,3)",
    )
    adaptive.set_defaults(run=_run)


def _steps_list(text: str) -> list[int]:
    try:
        steps = sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not steps or steps[0] < 1:
        raise argparse.ArgumentTypeError(f"expected draft steps >= 1, got {text!r}")
    return steps


def _say(message: str) -> None:
    print(f"crossover servers: {message}", file=sys.stderr, flush=True)


def _run(args: argparse.Namespace) -> int:
    try:
        results = read_results(args.results)
        config, notes = adaptive_config(results, speculative=args.speculative, plain=args.plain, steps=args.steps)
    except AdaptiveConfigError as exc:
        _say(f"error: {exc}")
        return 2
    text = json.dumps(config, indent=2) + "\n"
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(text)
        _say(f"wrote {args.output}")
    else:
        sys.stdout.write(text)
    for note in notes:
        _say(note)
    return 0
