"""`crossover sim replay`'s command: settings from a gateway config and the options, the replay, its table or
JSON, with the free-switch bound beside the best of all (replay.py does the replaying)."""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

from pydantic import ValidationError

from crossover.gateway.config import AdaptiveSettings, SettingsError, SwitchSettings, load_settings
from crossover.gateway.modes import PLAIN, SPECULATIVE
from crossover.servers.sim.profile import ProfileError, load_profile, with_overrides
from crossover.servers.sim.replay import (
    DEFAULT_STOP_S,
    IN_ENGINE,
    MECHANISMS,
    MODEL_VERSION,
    RESTART,
    SLEEP,
    InEngineAssumptions,
    ReplayResult,
    ReplaySetup,
    SwitchTimes,
    free_switch_bound,
    replay_all,
)
from crossover.servers.sim.replay_adaptive import AdaptiveReplay
from crossover.servers.sim.trace import TraceError, TracePhase, load_trace, shifts_acceptance, with_accept_drop


def run_command(args) -> int:
    """`crossover sim replay` (its arguments are declared in cli.py)."""
    mechanisms = [m.strip() for m in args.mechanism.split(",") if m.strip()]
    unknown = [m for m in mechanisms if m not in MECHANISMS]
    if unknown or not mechanisms:
        print(
            f"crossover sim replay: error: --mechanism takes a comma-separated list of {', '.join(MECHANISMS)}; "
            f"got {args.mechanism!r}",
            file=sys.stderr,
        )
        return 2
    try:
        switch = None
        adaptive = AdaptiveSettings()
        if args.gateway_config is not None:
            # The gateway's own loader, environment overrides included: what `crossover serve` would run.
            settings = load_settings(Path(args.gateway_config))
            switch, adaptive = SwitchSettings.of(settings), settings.adaptive
        adaptive = adaptive_overrides(adaptive, args)
        speculative = with_overrides(
            load_profile(args.speculative),
            accept_length=args.accept_length,
            max_running_requests=args.max_running_requests,
        )
        plain = load_profile(args.plain)
        trace = load_trace(args.trace)
        if args.accept_drop is not None:
            at_s, accept_length = args.accept_drop
            trace = with_accept_drop(trace, at_s=at_s, accept_length=accept_length)
        times = SwitchTimes.from_profiles(
            speculative,
            plain,
            stop_s=DEFAULT_STOP_S if args.stop_s is None else args.stop_s,
            startup_s=args.startup_s,
            release_s=args.release_s,
            resume_s=args.resume_s,
        )
        setup = ReplaySetup.from_profiles(
            speculative,
            plain,
            trace,
            switch=switch,
            times=times,
            input_len=args.input_len,
            output_len=args.output_len,
            seed=args.seed,
            adaptive=adaptive,
            threshold=args.threshold,
            hysteresis=args.hysteresis,
            dwell=args.min_dwell_s,
            window=args.window_s,
            expected_phase=args.expected_phase_s,
            drain_deadline=args.drain_timeout_s,
            initial_cost=args.initial_cost,
        )
        setup = replace(setup, fast_forward=not args.exact)
        known: dict[str, ReplayResult] = {}
        results = replay_all(setup, trace, mechanisms, known)
        # The bound replays the fixed modes, which run at the profile's acceptance only.
        free = None if shifts_acceptance(trace) else free_switch_bound(setup, trace, known)
    except (ProfileError, TraceError, SettingsError, ValueError) as exc:
        print(f"crossover sim replay: error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        best = max(r.output_tokens for r in results)
        print(json.dumps([r.as_json(best, free) for r in results], indent=2))
        return 0
    print(describe(setup, trace))
    if IN_ENGINE in mechanisms:
        print(describe_in_engine(InEngineAssumptions.of(setup)))
    print(format_table(results, free))
    for result in results:
        if result.adaptive is not None:
            print(describe_adaptive(result.output_tokens, result.adaptive))
    return 0


def adaptive_overrides(adaptive: AdaptiveSettings, args) -> AdaptiveSettings:
    """`[adaptive]` with the --adaptive-* options that were given (checked as the gateway checks its file)."""
    options: dict[str, str] = args.adaptive_options  # field -> option (cli.py)
    given = {field: value for field in options if (value := getattr(args, f"adaptive_{field}")) is not None}
    if not given:
        return adaptive
    try:
        return AdaptiveSettings.model_validate({**adaptive.model_dump(), **given})
    except ValidationError as exc:
        problems = (
            f"{options.get(str(error['loc'][0]), '--adaptive') if error['loc'] else '--adaptive'}: {error['msg']}"
            for error in exc.errors()
        )
        raise ValueError("; ".join(problems)) from None


def describe_adaptive(output_tokens: int, report: AdaptiveReplay) -> str:
    """Adaptive beside the best fixed threshold and the per-window oracle, its moves and how fast it settled."""
    limits = report.limits

    def share(of: float) -> str:
        return f"{100 * output_tokens / of:.2f}%" if of else "-"

    lines = [
        f"adaptive (partitioned, switch policy): {output_tokens} tokens; best fixed threshold "
        f"{report.best_fixed_threshold}: {round(report.best_fixed_tokens)} (adaptive {share(report.best_fixed_tokens)}"
        f"); per-window oracle: {round(report.oracle_tokens)} (adaptive {share(report.oracle_tokens)})",
        f"  window {report.window_s:g} s, max step {limits.max_step}, bounds [{limits.minimum}, {limits.maximum}], "
        f"deadband {limits.deadband}; bench table: the profiles' curves at levels "
        f"{','.join(map(str, report.bench_levels))}, accept length {report.bench_accept_length:g}; threshold "
        f"{report.initial_threshold} -> {report.thresholds[-1] if report.thresholds else report.initial_threshold}, "
        f"{len(report.moves)} moves",
    ]
    for settling in report.settled:
        crossover = "above the top level (plain never wins)" if settling.crossover is None else settling.crossover
        took = "not by the end" if settling.windows is None else f"{settling.windows} windows"
        lines.append(
            f"  acceptance {settling.accept_length:g} from {settling.t:g} s: crossover {crossover}; within one bench "
            f"level (+-{settling.level_width:g}) after {took}"
        )
    return "\n".join(lines)


def describe(setup: ReplaySetup, trace: list[TracePhase]) -> str:
    w, t = setup.switch, setup.times
    spec = setup.speculative.speculative
    accept = f" (accept length {spec.accept_length:g})" if spec else ""
    total = sum(p.duration_s for p in trace)
    return (
        f"{setup.speculative.name}{accept} / {setup.plain.name}: {len(trace)} phases, {total:g} s, "
        f"{setup.input_len} input / {setup.output_len} output tokens; virtual time, profile seconds; replay model "
        f"{MODEL_VERSION} (servers/sim/CHANGELOG.md)\n"
        f"policy (the gateway's): threshold {w.threshold} hysteresis {w.hysteresis}, a sample every "
        f"{w.interval:g} s, min dwell {w.dwell:g} s, window {w.window:g} s, expected phase "
        f"{f'{w.expected_phase:g} s' if w.expected_phase else 'learned'}, gain {100 * w.advantage:g}% for the "
        f"mode the threshold calls for; switch cost until measured {setup.prior_s(RESTART):g} s restart / "
        f"{setup.prior_s(SLEEP):g} s sleep; drain deadline {w.drain_deadline:g} s; starts {w.initial_mode}\n"
        f"switch: restart {t.seconds(RESTART, SPECULATIVE, PLAIN):g} s to plain / "
        f"{t.seconds(RESTART, PLAIN, SPECULATIVE):g} s back, sleep {t.seconds(SLEEP, SPECULATIVE, PLAIN):g} s / "
        f"{t.seconds(SLEEP, PLAIN, SPECULATIVE):g} s (without the drain)"
    )


def describe_in_engine(assumed: InEngineAssumptions) -> str:
    """What the in-engine replay assumed, in words (the JSON's `in_engine`)."""
    gate = (
        f"gate {assumed.gate} (zero draft steps above a batch of {assumed.gate})"
        if assumed.gate is not None
        else "gate none (speculation out-yields a zero-step step at every batch up to the cap: it never engages)"
    )
    return (
        f"in-engine: {gate}, found at {assumed.gate_context_tokens} context tokens a request; zero-step cost "
        f"model: {assumed.zero_step_model}; pool {assumed.pool} (KV {assumed.kv_pool_tokens} tokens), running cap "
        f"{assumed.max_running_requests}"
    )


def format_table(results: list[ReplayResult], free_switch_tokens: float | None = None) -> str:
    """One row a mechanism: `vs best` against the best of them (the oracle's), `vs free sw.` against
    `free_switch_tokens` (free_switch_bound), which closes the table."""
    best = max((r.output_tokens for r in results), default=0) or 1
    free = free_switch_tokens or 0

    def seconds(value: float | None) -> str:
        return "-" if value is None else f"{value:.3f}"

    names = [r.mechanism if r.follows is None else f"{r.mechanism} (= {r.follows})" for r in results]
    width = max([20, *map(len, names)])
    lines = [
        f"{'mechanism':<{width}} {'output tokens':>14} {'vs best':>8} {'vs free sw.':>12} {'completed':>10} "
        f"{'cut':>5} {'switches':>9} {'switching s':>12} {'TTFT p50 s':>11} {'TTFT p99 s':>11} {'peak running':>13}"
    ]
    for name, r in zip(names, results, strict=True):
        vs_free = f"{100 * r.output_tokens / free:>11.1f}%" if free else f"{'-':>12}"
        lines.append(
            f"{name:<{width}} {r.output_tokens:>14} {100 * r.output_tokens / best:>7.1f}% {vs_free} "
            f"{r.requests_completed:>10} {r.requests_cut:>5} {r.switches:>9} {r.switching_s:>12.1f} "
            f"{seconds(r.ttft_p50_s):>11} {seconds(r.ttft_p99_s):>11} {r.running_peak:>13}"
        )
    if free:
        lines.append(
            f"{'free-switch bound':<{width}} {round(free):>14} {'':>8} {100.0:>11.1f}%  "
            "(the better fixed mode in each phase, switched for nothing)"
        )
    return "\n".join(lines)
