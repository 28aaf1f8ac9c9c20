"""`crossover advise`: what pays on this box - raise the running cap, the in-engine gate, time-shared switching
(restart or sleep), a partitioned split, or nothing - ranked, with predicted tok/s and TTFT and how sure.

    crossover advise --speculative k25-eagle3 --plain k25-plain [--deployment kimi-k25-time-shared] [--write DIR]
    crossover advise --results runs/k25/results.json [--write DIR]

From performance profiles (servers/sim/profiles) every option is replayed on load traces by the project's own
replay (servers/sim/replay.py: the stand-in's engine and the gateway's own `Switcher`, in virtual time); from a
`crossover bench` results file the options are read off the measured curves, each level with its interval.

**Ranking.** Every option is compared with today (speculation at today's running cap), trace by trace (or level
by level): its tokens, TTFT p50 and p99. Tokens differ only beyond the margin (the bench's resolution, 3%, or the
levels' combined intervals); TTFT only by a factor of two and more than a second (p50: half a second). An option
*pays* when it is better somewhere and worse nowhere; a *trade-off* when better somewhere and worse elsewhere;
it *loses* when only worse; *no gain* when within the margin everywhere. Options that pay come first (the one that
improves more traces first, then the smaller change), then today, then the rest. A level where a target completed
nothing is no data: it informs nothing, and with none left nothing is advised.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Literal

from crossover.gateway.cli import positive_float, positive_int
from crossover.gateway.config import MAX_THRESHOLD, SettingsError, load_settings
from crossover.loadtest.advise_live import MIN_REQUESTS, Live, LiveError, LiveLevel, compared, live_lines, read_live
from crossover.loadtest.crossover import analyse, interpolate, no_data_levels, spillover_held, spillover_threshold
from crossover.loadtest.models import Results
from crossover.loadtest.results import ResultsError, load_results
from crossover.loadtest.saturation import find_queueing
from crossover.loadtest.uncertainty import DEFAULT_RESOLUTION, margin
from crossover.servers.profile import Profile as Deployment
from crossover.servers.profile import ProfileError as DeploymentError
from crossover.servers.profile import load_profile as load_deployment
from crossover.servers.profile import parse_profile
from crossover.servers.sim.profile import Profile, ProfileError, load_profile, with_overrides
from crossover.servers.sim.replay import (
    ALWAYS_PLAIN,
    ALWAYS_SPECULATIVE,
    IN_ENGINE,
    RESTART,
    SLEEP,
    InEngineAssumptions,
    ReplayResult,
    ReplaySetup,
    replay_all,
    steady_level,
)
from crossover.servers.sim.trace import TRACES_DIR, TraceError, load_trace

# The cap an EAGLE server is raised to unless --cap says otherwise: the plain server's in the shipped Kimi profiles,
# and the in-engine profile's.
DEFAULT_RAISED_CAP = 256
# A single-stream gain below this is low for what a speculative step costs (the step-cost ratio is printed).
LOW_SINGLE_STREAM_GAIN = 0.10
# Output tokens of the single-stream figure (the reference's benchmark length).
SINGLE_STREAM_OUTPUT_LEN = 2048
# Published mean acceptance (tokens per step, bonus included) of a model's EAGLE-3 draft, where one is known.
PUBLISHED_ACCEPT_LENGTH = {"moonshotai/Kimi-K2.5": 3.1}
# TTFT is told apart only by a factor and an absolute step (seconds): p99 and p50.
TTFT_FACTOR = 2.0
TTFT_P99_STEP_S = 1.0
TTFT_P50_STEP_S = 0.5

Verdict = Literal["pays", "today", "no gain", "trade-off", "loses", "not possible", "no data"]
VERDICT_ORDER: dict[Verdict, int] = {
    "pays": 0,
    "today": 1,
    "no gain": 2,
    "trade-off": 3,
    "loses": 4,
    "not possible": 5,
    "no data": 6,
}
# How big a change each option is, smallest first: among options that pay equally, the smaller change ranks first.
EFFORT = {"nothing": 0, "raise-cap": 1, "in-engine": 2, "always-plain": 3, "switch": 4, "sleep": 4, "restart": 5}
EFFORT_DEFAULT = 6


class AdviseError(ValueError):
    """Inputs advise cannot work from; the message says why."""


@dataclass(frozen=True)
class Outcome:
    """One option on one trace (or at one bench level): output tokens (tok/s for a level) and TTFT."""

    where: str  # the trace's name, or "C=10"
    tokens: float
    ttft_p50_s: float | None
    ttft_p99_s: float | None
    margin: float = 0.0  # tokens: differences within it are ties (the resolution, or the levels' intervals)
    switches: int = 0
    cut: int = 0

    def as_json(self) -> dict:
        return {
            "where": self.where,
            "tokens": round(self.tokens, 1),
            "ttft_p50_s": _round(self.ttft_p50_s),
            "ttft_p99_s": _round(self.ttft_p99_s),
            "margin": round(self.margin, 1),
            "switches": self.switches,
            "cut": self.cut,
        }


@dataclass
class Option:
    key: str  # raise-cap | in-engine | sleep | restart | switch | always-plain | partitioned | nothing
    title: str
    outcomes: list[Outcome] = field(default_factory=list)
    verdict: Verdict = "no gain"
    why: str = ""
    note: str = ""
    improved: int = 0  # traces (levels) where it is better than today
    spillover_share: float = 0.0  # partitioned: the share fitted with its threshold (its config carries it)

    def gains(self, today: Option) -> list[float]:
        """Token change against today, per trace, in percent."""
        return [100 * (o.tokens / t.tokens - 1) for o, t in zip(self.outcomes, today.outcomes, strict=True)]

    def as_json(self, today: Option) -> dict:
        gains = self.gains(today) if self.outcomes and today.outcomes else []
        return {
            "option": self.key,
            "title": self.title,
            "verdict": self.verdict,
            "why": self.why,
            "note": self.note or None,
            "tokens_vs_today_percent": [round(g, 2) for g in gains],
            "outcomes": [o.as_json() for o in self.outcomes],
        }


@dataclass
class Advice:
    """The ranking (first: the advice), what speculation costs here, how sure, what it rests on."""

    source: str
    ranked: list[Option]
    today: Option
    resolution: float
    acceptance: list[str] = field(default_factory=list)
    sure: str = ""
    assumptions: list[str] = field(default_factory=list)
    refused: str | None = None  # nothing to advise (no data), and why
    measured: bool = False  # from a bench of this box (else from a performance model)
    live: list[str] = field(default_factory=list)  # what a running gateway measured (--url)

    @property
    def best(self) -> Option | None:
        return None if self.refused else self.ranked[0]

    def as_json(self) -> dict:
        return {
            "source": self.source,
            "refused": self.refused,
            "advice": None if self.best is None else self.best.key,
            "resolution": self.resolution,
            "ranking": [option.as_json(self.today) for option in self.ranked],
            "acceptance": self.acceptance,
            "live": self.live,
            "sure": self.sure,
            "assumptions": self.assumptions,
        }


# --- judging an option against today ----------------------------------------------------------------------


def judge(option: Option, today: Option) -> None:
    """Set `option.verdict`, `why` and `improved` from its outcomes against today's (see the module's doc)."""
    better: dict[str, list[str]] = {}
    worse: dict[str, list[str]] = {}
    improved = 0
    for o, t in zip(option.outcomes, today.outcomes, strict=True):
        here = {True: False, False: False}  # better, worse
        d = o.tokens - t.tokens
        if abs(d) > o.margin:
            (better if d > 0 else worse).setdefault("tokens", []).append(f"{_pct(o.tokens, t.tokens)} ({o.where})")
            here[d > 0] = True
        for name, new, old, step in (
            ("TTFT p99", o.ttft_p99_s, t.ttft_p99_s, TTFT_P99_STEP_S),
            ("TTFT p50", o.ttft_p50_s, t.ttft_p50_s, TTFT_P50_STEP_S),
        ):
            if new is None or old is None:
                continue
            change = f"{old:.3g} -> {new:.3g} s ({o.where})"
            if new * TTFT_FACTOR <= old and old - new >= step:
                better.setdefault(name, []).append(change)
                here[True] = True
            elif new >= old * TTFT_FACTOR and new - old >= step:
                worse.setdefault(name, []).append(change)
                here[False] = True
        if o.cut > t.cut:
            worse.setdefault("requests cut at a drain deadline", []).append(f"{o.cut - t.cut} ({o.where})")
            here[False] = True
        improved += here[True] and not here[False]
    option.improved = improved

    def said(changes: dict[str, list[str]]) -> str:
        return "; ".join(f"{what} {', '.join(items)}" for what, items in changes.items())

    if better and not worse:
        option.verdict, option.why = "pays", f"better: {said(better)}"
    elif better:
        option.verdict, option.why = "trade-off", f"better: {said(better)} - worse: {said(worse)}"
    elif worse:
        option.verdict, option.why = "loses", f"worse: {said(worse)}"
    else:
        option.verdict, option.why = "no gain", "within the margin everywhere"


def rank(options: Sequence[Option], today: Option, *, judged: bool = False) -> list[Option]:
    """Options that pay first (by how many traces they improve, then the smaller change), then today, then the
    rest. `judged`: the verdicts are set already."""
    today.verdict, today.why = "today", "what runs now"
    for option in options:
        if not judged and option is not today and option.verdict not in ("not possible", "no data"):
            judge(option, today)

    def key(option: Option) -> tuple:
        mean_gain = sum(option.gains(today)) / len(option.outcomes) if option.outcomes and today.outcomes else 0.0
        return (VERDICT_ORDER[option.verdict], -option.improved, EFFORT.get(option.key, EFFORT_DEFAULT), -mean_gain)

    return sorted(options, key=key)


# --- from performance profiles, by the replay ---------------------------------------------------------------


def default_traces(profile: Profile) -> list[str]:
    """The shipped traces made for this model (named for the profile's family: k25-*, llama-*); else all."""
    family = profile.name.split("-")[0]
    shipped = sorted(p.stem for p in TRACES_DIR.glob("*.csv"))
    return [name for name in shipped if name.startswith(family)] or shipped


def advise_profiles(
    speculative: Profile,
    plain: Profile,
    traces: Sequence[str],
    *,
    cap: int | None = None,
    deployment: Deployment | None = None,
    input_len: int = 256,
    output_len: int = 512,
    resolution: float = DEFAULT_RESOLUTION,
) -> Advice:
    """Every option replayed on every trace (replay.py), ranked against today (speculation at its current cap)."""
    if speculative.speculative is None:
        raise AdviseError(f"{speculative.name} is not a speculative profile (no [speculative] section)")
    today_cap = speculative.limits.max_running_requests
    raised_cap = cap or _deployment_plain_cap(deployment) or DEFAULT_RAISED_CAP
    raised = with_overrides(speculative, max_running_requests=raised_cap) if raised_cap > today_cap else None
    options = {
        "nothing": Option("nothing", f"nothing: speculation always, running cap {today_cap} (today)"),
        "raise-cap": Option("raise-cap", f"raise EAGLE's running cap {today_cap} -> {raised_cap}"),
        "in-engine": Option("in-engine", "in-engine gate (patched SGLang), at the raised cap"),
        "sleep": Option("sleep", "time-shared switching by sleep/wake (memory saver)"),
        "restart": Option("restart", "time-shared switching by restart (through the agent)"),
        "always-plain": Option("always-plain", "speculation off (plain always)"),
        "partitioned": Option("partitioned", "partitioned split (both servers at once, disjoint GPUs)"),
    }
    if raised is None:
        options["raise-cap"].verdict = "not possible"
        options["raise-cap"].why = f"the cap is {today_cap} already (>= {raised_cap})"
    assumptions = [
        f"model: {speculative.name} / {plain.name} ({speculative.description or 'no description'}); "
        f"{input_len} input / {output_len} output tokens a request, closed-loop clients per trace phase",
        "figures from one seed of the replay in virtual time (steady stretches fast-forwarded: within 1% of "
        "stepping every token); each token figure is told apart from today's only beyond "
        f"{100 * resolution:g}% (the bench's resolution)",
    ]
    gate_note = ""
    for name in traces:
        trace = load_trace(name)
        where = Path(name).stem
        setup = ReplaySetup.from_profiles(speculative, plain, trace, input_len=input_len, output_len=output_len)
        mechanisms = [ALWAYS_SPECULATIVE, ALWAYS_PLAIN, SLEEP]
        try:
            setup.times.check(RESTART)
            mechanisms.append(RESTART)
        except ValueError as exc:
            options["restart"].verdict, options["restart"].why = "not possible", str(exc)
        known: dict[str, ReplayResult] = {}
        results = {r.mechanism: r for r in replay_all(setup, trace, mechanisms, known)}
        today = results[ALWAYS_SPECULATIVE]
        tie = resolution * today.output_tokens
        for key, mechanism in (("nothing", ALWAYS_SPECULATIVE), ("always-plain", ALWAYS_PLAIN), ("sleep", SLEEP)):
            options[key].outcomes.append(_outcome(where, results[mechanism], tie))
        if RESTART in results:
            options["restart"].outcomes.append(_outcome(where, results[RESTART], tie))
        if raised is not None:
            high = ReplaySetup.from_profiles(
                raised, plain, trace, switch=setup.switch, input_len=input_len, output_len=output_len
            )
            up = {r.mechanism: r for r in replay_all(high, trace, [ALWAYS_SPECULATIVE, IN_ENGINE])}
            options["raise-cap"].outcomes.append(_outcome(where, up[ALWAYS_SPECULATIVE], tie))
            options["in-engine"].outcomes.append(_outcome(where, up[IN_ENGINE], tie))
            gate_note = _gate_note(up[IN_ENGINE].in_engine)
            options["in-engine"].title = f"in-engine gate (patched SGLang), at running cap {raised_cap}"
        else:
            inside = replay_all(setup, trace, [IN_ENGINE])[0]
            options["in-engine"].outcomes.append(_outcome(where, inside, tie))
            gate_note = _gate_note(inside.in_engine)
    options["in-engine"].note = gate_note
    same_as_raise = raised is not None and options["in-engine"].outcomes == options["raise-cap"].outcomes
    for key in ("sleep", "restart"):
        option = options[key]
        switches = sum(o.switches for o in option.outcomes)
        option.note = f"{switches} switch(es) over the traces, {sum(o.cut for o in option.outcomes)} requests cut"
    partitioned = options["partitioned"]
    partitioned.verdict = "not possible"
    if deployment is not None and deployment.topology == "partitioned":
        partitioned.why = "not replayed: bench both servers of the partitioned profile (crossover advise --results)"
    else:
        partitioned.why = (
            "one copy of the model needs the whole GPU set here"
            if deployment is not None
            else "not replayed from profiles: a split needs both servers on their own GPUs (bench them)"
        ) + (f" (profile {deployment.name} is {deployment.topology})" if deployment is not None else "")
    today = options["nothing"]
    ranked = rank(list(options.values()), today)
    if same_as_raise:
        # Judged against today it pays, but only by the cap it runs at: against the cap raise it adds nothing.
        gate = options["in-engine"]
        gate.verdict, gate.why = "no gain", f"the same figures as the cap raise to {raised_cap}, plus a patched SGLang"
        ranked = rank(ranked, today, judged=True)
    advice = Advice(
        source=f"replay of {', '.join(Path(t).stem for t in traces)}",
        ranked=ranked,
        today=today,
        resolution=resolution,
        acceptance=acceptance_lines(speculative, plain, input_len),
        assumptions=assumptions,
    )
    advice.sure = how_sure(advice)
    spec_server = _spec_server(deployment)
    if deployment is not None and spec_server is not None and spec_server.max_running_requests != today_cap:
        advice.assumptions.append(
            f"today = the model's cap {today_cap} (the reference as measured); deployment profile "
            f"{deployment.name} sets {spec_server.max_running_requests} for {spec_server.name}"
        )
    return advice


def _outcome(where: str, result: ReplayResult, tie: float) -> Outcome:
    return Outcome(
        where,
        float(result.output_tokens),
        result.ttft_p50_s,
        result.ttft_p99_s,
        margin=tie,
        switches=result.switches,
        cut=result.requests_cut,
    )


def _gate_note(assumed: InEngineAssumptions | None) -> str:
    if assumed is None:
        return ""
    if assumed.gate is None:
        return (
            f"the gate never engages: speculation out-yields a zero-step step at every batch up to the cap "
            f"{assumed.max_running_requests}"
        )
    return f"gate at batch {assumed.gate} (zero draft steps above it), found at {assumed.gate_context_tokens} tokens"


def acceptance_lines(speculative: Profile, plain: Profile, input_len: int) -> list[str]:
    """One stream on each server, and what the gain implies a speculative step costs (the step-cost ratio)."""
    assert speculative.speculative is not None
    accept = speculative.speculative.accept_length
    spec = steady_level(speculative, 1, input_len, SINGLE_STREAM_OUTPUT_LEN).output_throughput
    base = steady_level(plain, 1, input_len, SINGLE_STREAM_OUTPUT_LEN).output_throughput
    return step_cost_lines(spec, base, accept, speculative.model_name)


def step_cost_lines(spec: float, base: float, accept: float | None, model: str | None) -> list[str]:
    """tok/s = accept / t_spec against 1 / t_plain, so t_spec / t_plain = accept / (spec / plain)."""
    if spec <= 0 or base <= 0:
        return ["single stream: no data (a target completed nothing at C=1): no step-cost ratio"]
    gain = spec / base - 1
    lines = [f"single stream: speculative {spec:.1f} tok/s vs plain {base:.1f} ({100 * gain:+.1f}%)"]
    ratios = []
    if accept:
        ratios.append(f"at accept length {accept:.3g} tokens/step a speculative step costs {accept / (1 + gain):.2f}x")
    published = PUBLISHED_ACCEPT_LENGTH.get(model or "")
    if published and published != accept:
        ratios.append(f"at the published {published:g} it would cost {published / (1 + gain):.2f}x")
    if ratios:
        lines.append("; ".join(ratios) + " a plain one")
    if gain < LOW_SINGLE_STREAM_GAIN:
        lines.append(
            f"acceptance is low for what a step costs here: speculation gains {100 * gain:+.1f}% at one stream "
            f"(< {100 * LOW_SINGLE_STREAM_GAIN:g}%), so it has little to lose before plain wins. Either acceptance on "
            "this traffic is below the published figure or the draft path is slow: measure it "
            "(sglang:spec_accept_length) before tuning thresholds"
        )
    return lines


def how_sure(advice: Advice) -> str:
    best, today = advice.ranked[0], advice.today
    if best is today or best.verdict != "pays":
        return (
            "sure that nothing clearly pays: every other option is within the margin, worse, or a trade-off "
            f"({advice.resolution * 100:g}% resolution)"
        )
    margins = [o.tokens / t.tokens - 1 for o, t in zip(best.outcomes, today.outcomes, strict=True)]
    ttft = [
        (t.ttft_p99_s or 0) / o.ttft_p99_s
        for o, t in zip(best.outcomes, today.outcomes, strict=True)
        if o.ttft_p99_s and t.ttft_p99_s
    ]
    decisive = max(ttft, default=1.0)
    level = "high" if decisive >= 10 or min(margins) > 2 * advice.resolution else "moderate"
    where = "levels" if advice.measured else "traces"
    lower = f", TTFT p99 up to {decisive:.0f}x lower" if decisive >= TTFT_FACTOR else ""
    basis = (
        "measured on this box, switching taken as free"
        if advice.measured
        else "figures rest on the model below, not on a measurement of this box"
    )
    return (
        f"{level}: it improves {best.improved} of {len(best.outcomes)} {where} and loses on none; tokens "
        f"{_range(100 * m for m in margins)}% (a tie within each margin){lower}; {basis}"
    )


# --- from a bench results file --------------------------------------------------------------------------------


def advise_results(
    results: Results,
    *,
    speculative: str | None = None,
    plain: str | None = None,
    deployment: Deployment | None = None,
) -> Advice:
    """Options read off the measured curves, each level with its margin; no-data levels left out."""
    cross = results.crossover
    spec_name = speculative or cross.speculative or "speculative"
    plain_name = plain or cross.plain or "plain"
    levels = [lv for lv in results.levels if lv.target in (spec_name, plain_name)]
    by = {(lv.target, lv.concurrency): lv for lv in levels}
    common = sorted({c for t, c in by if t == spec_name} & {c for t, c in by if t == plain_name})
    if not common:
        raise AdviseError(f"{spec_name} and {plain_name} share no measured level in this results file")
    empty = no_data_levels(levels, spec_name, plain_name)
    usable = [c for c in common if c not in empty]
    section = analyse(levels, spec_name, plain_name)
    today = Option("nothing", f"nothing: speculation always ({spec_name})")
    empty_note = (
        "no data at " + ", ".join(f"C={c} ({' and '.join(n)} completed nothing)" for c, n in sorted(empty.items()))
        if empty
        else ""
    )
    if not usable:
        return Advice(
            source="bench results",
            ranked=[today],
            today=today,
            resolution=DEFAULT_RESOLUTION,
            refused=f"nothing to advise: {empty_note}: no level where both targets completed a request",
        )
    s = {c: by[spec_name, c].output_throughput for c in usable}
    p = {c: by[plain_name, c].output_throughput for c in usable}
    margins = {
        c: margin(s[c], p[c], by[spec_name, c].output_throughput_interval, by[plain_name, c].output_throughput_interval)
        for c in usable
    }

    def served(target: str, c: int, tokens: float | None = None) -> Outcome:
        lv = by[target, c]
        return Outcome(
            f"C={c}",
            lv.output_throughput if tokens is None else tokens,
            _seconds(lv.median_ttft_ms),
            _seconds(lv.p99_ttft_ms),
            margin=margins[c],
        )

    options = [today]
    today.outcomes = [served(spec_name, c) for c in usable]
    off = Option("always-plain", f"speculation off ({plain_name} always)")
    off.outcomes = [served(plain_name, c) for c in usable]
    options.append(off)
    threshold = None if section.recommended_threshold is None else section.recommended_threshold.switch
    note = "switching taken as free: replay a trace for what restart or sleep cost"
    if threshold is None and section.status == "within_noise":
        # No crossover named: the curves tie below the first level where plain is clearly ahead. Speculating
        # through the ties keeps their low TTFT; the threshold sends that level (and above) to plain.
        clear = [e.concurrency for e in section.evidence if e.verdict == "plain"]
        if clear:
            threshold = clear[0] - 1
            note = f"within noise below C={clear[0]} (no crossover named): speculative through the ties; " + note
    if threshold is not None:
        switch = Option("switch", f"switch by load at threshold {threshold} (speculative while in-flight < it)")
        switch.outcomes = [served(spec_name if c <= threshold else plain_name, c) for c in usable]
        switch.note = note
        options.append(switch)
    spill = spillover_threshold(s, p)
    share = f", share {spill.share:g}" if spill.share else ""
    split = Option(
        "partitioned",
        f"partitioned split, spillover at {spill.threshold}{share} (both servers at once)",
        spillover_share=spill.share,
    )
    held = {c: spillover_held(c, spill.threshold, spill.share) for c in usable}
    split.outcomes = [served(spec_name, c, interpolate(s, held[c]) + interpolate(p, c - held[c])) for c in usable]
    split.note = (
        f"predicted worst case {100 * (spill.efficiency or 0):.1f}% of the best split; needs both servers on "
        "disjoint GPUs"
    )
    if deployment is None or deployment.topology != "partitioned":
        # Two servers at once against one: only a box that holds both (a partitioned profile) can choose it.
        split.verdict = "not possible"
        split.why = "not judged: a split serves on both servers at once; give --deployment of a partitioned profile" + (
            f" ({deployment.name} is {deployment.topology})" if deployment is not None else ""
        )
    options.append(split)
    queueing = [q for q in find_queueing(levels) if q.target == spec_name]
    cap = Option("raise-cap", "raise the speculative server's running cap")
    cap.verdict = "not possible"
    if queueing:
        q = queueing[0]
        cap.verdict = "no data"
        cap.why = (
            f"queueing at C={q.from_concurrency}->{q.to_concurrency} (throughput x{q.throughput_gain:.2f}, median "
            f"TTFT x{q.ttft_growth:.1f}): raise --max-running-requests and bench again (a measurement cannot "
            "predict it)"
        )
    else:
        cap.why = "no queueing measured on the speculative target: its cap is not what limits it"
    options.append(cap)
    ranked = rank(options, today)
    spec_c1 = by.get((spec_name, min(common)))
    plain_c1 = by.get((plain_name, min(common)))
    # Tokens per chunk: a speculative stream carries a step's accepted tokens in one chunk; against the plain
    # target's (1 on SGLang, more where the server coalesces chunks) it reads the accept length.
    spec_tpc = spec_c1.mean_tokens_per_chunk if spec_c1 is not None else None
    plain_tpc = plain_c1.mean_tokens_per_chunk if plain_c1 is not None else None
    accept = spec_tpc / plain_tpc if spec_tpc and plain_tpc else None
    acceptance = []
    if min(common) == 1 and spec_c1 is not None and plain_c1 is not None:
        one_empty = 1 in empty
        acceptance = step_cost_lines(
            0.0 if one_empty else spec_c1.output_throughput,
            0.0 if one_empty else plain_c1.output_throughput,
            accept,
            results.metadata.model,
        )
        if accept and not one_empty:
            acceptance.append(
                f"(accept length read from tokens per chunk at C=1: {spec_name} {spec_tpc:.2f} / {plain_name} "
                f"{plain_tpc:.2f})"
            )
    advice = Advice(
        source="bench results",
        ranked=ranked,
        today=today,
        resolution=DEFAULT_RESOLUTION,
        measured=True,
        acceptance=acceptance,
        assumptions=[
            f"measured levels {', '.join(map(str, usable))}; each token figure told apart only beyond its level's "
            "margin (combined 95% intervals, at least the resolution)",
            *([empty_note + ": left out"] if empty_note else []),
        ],
    )
    advice.sure = how_sure(advice)
    return advice


# --- what to write: the gateway config and the profile change ---------------------------------------------------


def gateway_config(option: Option, deployment: Deployment | None, *, threshold: int | None = None) -> str:
    """The gateway TOML for `option`, loadable by gateway/config.py load_settings."""
    spec_url, plain_url, model = "http://127.0.0.1:30001", "http://127.0.0.1:30002", None
    if deployment is not None:
        for server in deployment.servers:
            url = f"http://{server.host}:{server.port}"
            if server.role == "speculative":
                spec_url, model = url, server.served_model_name
            else:
                plain_url = url
    head = [f"# written by `crossover advise`: {option.title} ({option.verdict}; its figures: crossover advise)"]
    models = f"served_model_names = [{_toml_str(model)}]" if model else ""
    if option.key == "in-engine":
        body = [
            'topology = "in-engine"',
            f"threshold = {threshold if threshold is not None else MAX_THRESHOLD}"
            "          # the engines' zero-step gate; the cap when the gate never engages",
            models,
            "[pools.speculative]",
            f"backends = [{_toml_str(spec_url)}]",
        ]
    elif option.key == "partitioned":
        body = [
            'topology = "partitioned"',
            'policy = "spillover"',
            f"threshold = {threshold or 0}",
            f"spillover_share = {option.spillover_share:g}",
            models,
            "[pools.speculative]",
            f"backends = [{_toml_str(spec_url)}]",
            "[pools.plain]",
            f"backends = [{_toml_str(plain_url)}]",
        ]
    else:
        mechanism = option.key if option.key in (RESTART, SLEEP) else "manual"
        manual = "                # only PUT /admin/mode switches (the operator moves the servers)"
        if option.key == "always-plain":
            value, why = 0, "plain at any load"
        elif option.key in ("nothing", "raise-cap"):
            value, why = MAX_THRESHOLD, "speculation at any load: load never switches"
        else:
            value, why = threshold if threshold is not None else MAX_THRESHOLD, "plain from this many in flight"
        body = [
            'topology = "time-shared"',
            'policy = "switch"',
            f"threshold = {value}                 # {why}",
            models,
            "[pools.speculative]",
            f"backends = [{_toml_str(spec_url)}]",
            "[pools.plain]",
            f"backends = [{_toml_str(plain_url)}]",
            "[switching]",
            f'mechanism = "{mechanism}"' + (manual if mechanism == "manual" else ""),
        ]
        if mechanism == RESTART or (mechanism == SLEEP and deployment is not None):
            agents = '{ speculative = "speculative", plain = "plain" }'
            if deployment is not None:
                names = {s.role: s.name for s in deployment.servers}
                agents = f"{{ speculative = {_toml_str(names['speculative'])}, plain = {_toml_str(names['plain'])} }}"
            body += [
                'agent_url = "http://127.0.0.1:8100"   # the GPU-host agent (crossover servers agent)',
                'agent_token = ""                      # empty: $CROSSOVER_AGENT_TOKEN',
                f"agent_servers = {agents}",
            ]
    return "\n".join([*head, *(line for line in body if line)]) + "\n"


def profile_change(deployment_text: str, cap: int) -> str:
    """The deployment profile with its speculative server's running cap (and decode graphs) raised to `cap`."""
    blocks = re.split(r"(?m)^(?=\[\[servers\]\])", deployment_text)
    out = []
    for block in blocks:
        if re.search(r'(?m)^role\s*=\s*"speculative"', block):
            for key in ("max_running_requests", "cuda_graph_max_bs_decode"):
                pattern = rf"(?m)^({key}\s*=\s*)\d+"
                if re.search(pattern, block):
                    block = re.sub(pattern, lambda m: f"{m.group(1)}{cap}", block, count=1)
                else:
                    block = re.sub(r"(?m)^(role\s*=.*)$", lambda m, k=key: f"{m.group(1)}\n{k} = {cap}", block, count=1)
        out.append(block)
    return "".join(out)


def write(advice: Advice, out: Path, deployment: Deployment | None, deployment_text: str | None, **extra) -> list[Path]:
    """The gateway config for the advice (and the profile change where it applies), each checked by its loader."""
    best = advice.best
    if best is None:
        raise AdviseError(f"nothing written: {advice.refused}")
    out.mkdir(parents=True, exist_ok=True)
    written = []
    gateway = out / "gateway.toml"
    gateway.write_text(gateway_config(best, deployment, threshold=extra.get("threshold")))
    try:
        load_settings(gateway)
    except SettingsError as exc:  # a bug here, never the user's: say it plainly
        raise AdviseError(f"the gateway config written to {gateway} does not load: {exc}") from None
    written.append(gateway)
    if best.key == "raise-cap" and deployment is not None and deployment_text is not None:
        cap = extra["cap"]
        path = out / f"{deployment.name}.toml"
        text = profile_change(deployment_text, cap)
        parse_profile(text, name=deployment.name, source=str(path))  # as `crossover servers plan` would read it
        path.write_text(text)
        written.append(path)
    return written


# --- the command ------------------------------------------------------------------------------------------------


def advise_live(live: Live) -> Advice:
    """From a running gateway alone: speculation always, never, or switched at the first level where its live
    rate table has plain ahead beyond the margin (advise_live.py), each at the levels both pools served."""
    pairs = compared(live)
    today = Option("nothing", "nothing: speculation always (the speculative pool)")
    if not pairs:
        return Advice(
            source="live gateway",
            ranked=[today],
            today=today,
            resolution=DEFAULT_RESOLUTION,
            refused=f"nothing to advise from {live.url}: no level where both pools served {MIN_REQUESTS} requests",
            live=live_lines(live),
        )

    def outcome(row: LiveLevel, margin: float) -> Outcome:
        return Outcome(f"level {row.level}", row.tokens_per_s, None, None, margin=margin)

    today.outcomes = [outcome(spec, margin) for spec, _, margin in pairs]
    off = Option("always-plain", "speculation off (the plain pool always)")
    off.outcomes = [outcome(plain, margin) for _, plain, margin in pairs]
    options = [today, off]
    ahead = [spec for spec, plain, margin in pairs if plain.tokens_per_s - spec.tokens_per_s > margin]
    if ahead:
        threshold = math.ceil(ahead[0].load) - 1
        switch = Option("switch", f"switch by load at threshold {threshold} (speculative while in-flight < it)")
        switch.outcomes = [outcome(plain if spec.load > threshold else spec, m) for spec, plain, m in pairs]
        switch.note = f"from level {ahead[0].level}, where plain was first measured ahead beyond the margin"
        options.append(switch)
    advice = Advice(
        source="live gateway",
        ranked=rank(options, today),
        today=today,
        resolution=DEFAULT_RESOLUTION,
        measured=True,
        live=live_lines(live),
        assumptions=[
            f"the live rate table of {live.url} since it started: each level's pool throughput is its per-stream "
            "tok/s times the level's load; a level told apart beyond the resolution widened by 1/sqrt(requests)",
        ],
    )
    advice.sure = how_sure(advice)
    return advice


def format_advice(advice: Advice) -> str:
    if advice.refused:
        live = "".join(f"\n  {line}" for line in advice.live)
        return f"crossover advise: {advice.refused}{live}"
    lines = [f"what pays ({advice.source}), best first; tokens against today, TTFT p50 / p99 seconds:"]
    today = advice.today
    for n, option in enumerate(advice.ranked, 1):
        lines.append(f"{n}. {option.title} - {option.verdict}")
        if option.outcomes and option is not today and today.outcomes:
            gains = option.gains(today)
            lines.append(
                f"   tokens {_range(gains)}% (+-{_margin_pct(option, today)}%), TTFT p50 {_ttft(option, 'p50')}, "
                f"p99 {_ttft(option, 'p99')}"
            )
        elif option.outcomes:
            lines.append(
                f"   tokens {_range([o.tokens for o in option.outcomes], '.0f')} per "
                f"{'level (tok/s)' if advice.measured else 'trace'}, TTFT p50 "
                f"{_ttft(option, 'p50')}, p99 {_ttft(option, 'p99')}"
            )
        if option.why and option is not today:
            lines.append(f"   {option.why}")
        if option.note:
            lines.append(f"   {option.note}")
    if advice.acceptance:
        lines.append("acceptance:")
        lines += [f"  {line}" for line in advice.acceptance]
    if advice.live:
        lines.append("live (the running gateway's rate table):")
        lines += [f"  {line}" for line in advice.live]
    lines.append(f"how sure: {advice.sure}")
    lines.append("rests on:")
    lines += [f"  {line}" for line in advice.assumptions]
    return "\n".join(lines)


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "advise",
        help="what pays on this box: raise the cap, the in-engine gate, switching, a split, or nothing - ranked",
        description="Rank what pays against today (speculation at its running cap): from performance profiles by "
        "replaying load traces (crossover sim replay's model), or from a crossover bench results file. Prints "
        "predicted tokens and TTFT p50/p99 with their margin, what the single-stream gain implies a speculative "
        "step costs, and how sure; --write DIR writes the gateway config (and the profile change) for the advice.",
        epilog="Exit status: 0 advice given; 1 nothing to advise (no data); 2 bad arguments.",
    )
    parser.add_argument("--speculative", help="the speculative server's performance profile (k25-eagle3, a file)")
    parser.add_argument("--plain", help="the plain server's performance profile (k25-plain, a file)")
    parser.add_argument("--results", type=Path, help="a crossover bench results.json (or its run directory)")
    parser.add_argument("--target-speculative", help="--results: the speculative target's name")
    parser.add_argument("--target-plain", help="--results: the plain target's name")
    parser.add_argument(
        "--trace",
        action="append",
        default=[],
        help="a load trace to replay (repeatable; a shipped name or a file); default: the shipped traces for the model",
    )
    parser.add_argument("--deployment", help="the deployment profile (servers/profiles: kimi-k25-time-shared, a file)")
    parser.add_argument("--cap", type=positive_int, help=f"the raised running cap (default {DEFAULT_RAISED_CAP})")
    parser.add_argument("--accept-length", type=positive_float, help="the speculative profile's acceptance instead")
    parser.add_argument("--input-len", type=positive_int, default=256)
    parser.add_argument("--output-len", type=positive_int, default=512)
    parser.add_argument("--write", type=Path, metavar="DIR", help="write gateway.toml (and the profile change) here")
    parser.add_argument(
        "--url",
        help="a running gateway: its live rate table and acceptance beside the advice (alone: advice from them)",
    )
    parser.add_argument("--admin-token", default=os.environ.get("CROSSOVER_ADMIN_TOKEN"), help="--url: its admin token")
    parser.add_argument("--json", action="store_true", help="the ranking as JSON")
    parser.set_defaults(run=run_command)


def run_command(args: argparse.Namespace) -> int:
    deployment = deployment_text = None
    try:
        if args.deployment:
            deployment = load_deployment(args.deployment)
            deployment_text = _deployment_text(args.deployment)
        live = None if args.url is None else read_live(args.url, args.admin_token)
        if args.results is not None:
            advice = advise_results(
                load_results(args.results),
                speculative=args.target_speculative,
                plain=args.target_plain,
                deployment=deployment,
            )
            cap = args.cap or DEFAULT_RAISED_CAP
        elif args.speculative and args.plain:
            speculative = with_overrides(load_profile(args.speculative), accept_length=args.accept_length)
            plain = load_profile(args.plain)
            traces = args.trace or default_traces(speculative)
            cap = args.cap or _deployment_plain_cap(deployment) or DEFAULT_RAISED_CAP
            advice = advise_profiles(
                speculative,
                plain,
                traces,
                cap=cap,
                deployment=deployment,
                input_len=args.input_len,
                output_len=args.output_len,
            )
        elif live is not None:
            advice = advise_live(live)
            cap = args.cap or DEFAULT_RAISED_CAP
        else:
            print(
                "crossover advise: error: give --speculative and --plain (performance profiles), --results, or --url",
                file=sys.stderr,
            )
            return 2
        if live is not None and not advice.live:
            advice.live = live_lines(live)
    except (
        AdviseError,
        ResultsError,
        ProfileError,
        DeploymentError,
        TraceError,
        LiveError,
        ValueError,
        OSError,
    ) as exc:
        print(f"crossover advise: error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        import json

        print(json.dumps(advice.as_json(), indent=2))
    else:
        print(format_advice(advice))
    if advice.refused:
        return 1
    if args.write is not None:
        try:
            written = write(advice, args.write, deployment, deployment_text, cap=cap, threshold=_threshold(advice))
        except (AdviseError, DeploymentError, OSError) as exc:
            print(f"crossover advise: error: {exc}", file=sys.stderr)
            return 1
        print("wrote " + ", ".join(map(str, written)), file=sys.stderr if args.json else sys.stdout)
    return 0


def _threshold(advice: Advice) -> int | None:
    best = advice.best
    if best is None:
        return None
    found = re.search(r"(?:threshold|spillover at) (\d+)", best.title)
    return int(found.group(1)) if found else None


def _deployment_text(name: str) -> str:
    """The deployment profile's file as written (its comments kept in the changed copy)."""
    path = Path(name)
    if path.exists():
        return path.read_text()
    return resources.files("crossover.servers").joinpath("profiles", f"{name}.toml").read_text()


def _spec_server(deployment: Deployment | None):
    if deployment is None:
        return None
    return next((s for s in deployment.servers if s.role == "speculative"), None)


def _deployment_plain_cap(deployment: Deployment | None) -> int | None:
    if deployment is None:
        return None
    plain = next((s for s in deployment.servers if s.role == "plain"), None)
    return None if plain is None else plain.max_running_requests


def _seconds(ms: float | None) -> float | None:
    return None if ms is None else ms / 1000


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


def _pct(new: float, old: float) -> str:
    return f"{100 * (new / old - 1):+.1f}%"


def _range(values, spec: str = "+.1f") -> str:
    values = list(values)
    low, high = min(values), max(values)
    return f"{low:{spec}}" if math.isclose(low, high, abs_tol=0.05) else f"{low:{spec}}..{high:{spec}}"


def _margin_pct(option: Option, today: Option) -> str:
    return f"{max(100 * o.margin / t.tokens for o, t in zip(option.outcomes, today.outcomes, strict=True)):.1f}"


def _ttft(option: Option, which: str) -> str:
    values = [getattr(o, f"ttft_{which}_s") for o in option.outcomes]
    known = [v for v in values if v is not None]
    if not known:
        return "-"
    low, high = min(known), max(known)
    return f"{low:.3g}" if math.isclose(low, high, rel_tol=0.01) else f"{low:.3g}-{high:.3g}"


def _toml_str(value: str | None) -> str:
    return '"' + (value or "").replace("\\", "\\\\").replace('"', '\\"') + '"'
