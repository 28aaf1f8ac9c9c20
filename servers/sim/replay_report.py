"""`crossover sim replay`'s command: settings from a gateway config and the options, the replay, its table or
JSON, with the free-switch bound beside the best of all (replay.py does the replaying)."""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

from crossover.gateway.config import SettingsError, SwitchSettings, load_settings
from crossover.gateway.modes import PLAIN, SPECULATIVE
from crossover.servers.sim.profile import ProfileError, load_profile, with_overrides
from crossover.servers.sim.replay import (
    DEFAULT_STOP_S,
    IN_ENGINE,
    MECHANISMS,
    RESTART,
    SLEEP,
    InEngineAssumptions,
    ReplayResult,
    ReplaySetup,
    SwitchTimes,
    free_switch_bound,
    replay_all,
)
from crossover.servers.sim.trace import TraceError, TracePhase, load_trace


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
        if args.gateway_config is not None:
            # The gateway's own loader, environment overrides included: what `crossover serve` would run.
            switch = SwitchSettings.of(load_settings(Path(args.gateway_config)))
        speculative = with_overrides(
            load_profile(args.speculative),
            accept_length=args.accept_length,
            max_running_requests=args.max_running_requests,
        )
        plain = load_profile(args.plain)
        trace = load_trace(args.trace)
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
            threshold=args.threshold,
            hysteresis=args.hysteresis,
            dwell=args.min_dwell_s,
            window=args.window_s,
            expected_phase=args.expected_phase_s,
            drain_deadline=args.drain_timeout_s,
        )
        setup = replace(setup, fast_forward=not args.exact)
        known: dict[str, ReplayResult] = {}
        results = replay_all(setup, trace, mechanisms, known)
        free = free_switch_bound(setup, trace, known)
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
    return 0


def describe(setup: ReplaySetup, trace: list[TracePhase]) -> str:
    w, t = setup.switch, setup.times
    spec = setup.speculative.speculative
    accept = f" (accept length {spec.accept_length:g})" if spec else ""
    total = sum(p.duration_s for p in trace)
    return (
        f"{setup.speculative.name}{accept} / {setup.plain.name}: {len(trace)} phases, {total:g} s, "
        f"{setup.input_len} input / {setup.output_len} output tokens; virtual time, profile seconds\n"
        f"policy (the gateway's): threshold {w.threshold} hysteresis {w.hysteresis}, a sample every "
        f"{w.interval:g} s, min dwell {w.dwell:g} s, window {w.window:g} s, expected phase "
        f"{f'{w.expected_phase:g} s' if w.expected_phase else 'learned'}, gain {100 * w.advantage:g}% for the "
        f"mode the threshold calls for; switch cost until measured {w.prior_s(RESTART):g} s restart / "
        f"{w.prior_s(SLEEP):g} s sleep; drain deadline {w.drain_deadline:g} s; starts {w.initial_mode}\n"
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
