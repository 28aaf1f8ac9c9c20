"""`crossover bench`: sweep the targets, write the results, show the crossover, optionally apply it.

    crossover bench --target speculative=http://127.0.0.1:30001 --target plain=http://127.0.0.1:30002 \\
        --concurrency 1,2,5,10,30,70,100,250 --output-len 512 --out runs/k25 \\
        [--apply http://127.0.0.1:8000 --admin-token T]
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import platform
import sys
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import TYPE_CHECKING

import httpx

from crossover.loadtest import plots, results
from crossover.loadtest.apply import ApplyError, apply_threshold
from crossover.loadtest.engine_gate import GATES, EngineGate, EngineGateError
from crossover.loadtest.models import Crossover, Level, LevelSchedule, Metadata, Results, Simulation, TargetInfo
from crossover.loadtest.plan import BenchPlan, Target
from crossover.loadtest.ratetable import pass_acceptance, read_metrics, write_rate_table
from crossover.loadtest.runner import probe, run_sweep
from crossover.loadtest.standin import judge_shares, read_pass, read_simulation, schedule_share
from crossover.loadtest.stats import Window, summarize_passes
from crossover.loadtest.workload import Workload

if TYPE_CHECKING:
    from rich.console import Console

    from crossover.loadtest.display import SweepDisplay

DISCOVERY_TIMEOUT_S = 10.0
# /server_info fields worth keeping with a run (SGLang names); the rest is large and mostly irrelevant.
SERVER_INFO_FIELDS = (
    "version",
    "model_path",
    "served_model_name",
    "tp_size",
    "max_running_requests",
    "max_queued_requests",
    "speculative_algorithm",
    "speculative_num_steps",
    "speculative_eagle_topk",
    "speculative_num_draft_tokens",
    "cuda_graph_max_bs",
    "mem_fraction_static",
    "simulated",
    "simulator",
    "profile",
)


class BenchError(Exception):
    """A run that cannot go on (unreachable target, failed probe, no model); the message says why."""


def _event_loop_runner() -> asyncio.Runner:
    # uvloop (installed with uvicorn[standard]) makes the load generator cheaper per chunk; fall back quietly.
    try:
        import uvloop
    except ImportError:
        return asyncio.Runner()
    return asyncio.Runner(loop_factory=uvloop.new_event_loop)


async def discover_model(target: Target, headers: dict[str, str]) -> str:
    async with httpx.AsyncClient(timeout=DISCOVERY_TIMEOUT_S) as client:
        try:
            response = await client.get(f"{target.base_url}/v1/models", headers=headers)
            models = response.json()["data"]
            return models[0]["id"]
        except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as exc:
            raise BenchError(
                f"cannot learn the model name from {target.base_url}/v1/models ({exc!r}); pass --model"
            ) from None


async def server_info(target: Target, headers: dict[str, str]) -> dict | None:
    """SGLang's /server_info (or the older /get_server_info), whole; None if neither answers."""
    async with httpx.AsyncClient(timeout=DISCOVERY_TIMEOUT_S) as client:
        for path in ("/server_info", "/get_server_info"):
            with contextlib.suppress(httpx.HTTPError, ValueError):
                response = await client.get(f"{target.base_url}{path}", headers=headers)
                if response.status_code == 200 and isinstance(info := response.json(), dict):
                    return info
    return None


def selected(info: dict | None) -> dict | None:
    """The /server_info fields worth keeping with a run."""
    return None if info is None else {k: info[k] for k in SERVER_INFO_FIELDS if k in info}


def metadata(
    plan: BenchPlan,
    workload: Workload,
    infos: dict[str, dict | None],
    simulations: dict[str, Simulation | None],
    started: datetime,
) -> Metadata:
    from importlib.metadata import PackageNotFoundError, version

    try:
        tool = f"crossover {version('crossover')}"
    except PackageNotFoundError:
        tool = "crossover"
    return Metadata(
        tool=tool,
        started_at=started.isoformat(),
        finished_at=datetime.now(UTC).isoformat(),
        command=sys.argv,
        targets={
            t.name: TargetInfo(url=t.url, server_info=infos[t.name], simulation=simulations[t.name])
            for t in plan.targets
        },
        model=workload.model,
        concurrency=plan.concurrencies,
        output_len=workload.output_len,
        input_len=workload.input_len,
        ignore_eos=workload.ignore_eos,
        requests_per_level=plan.load.requests,
        duration_per_level_s=plan.load.duration_s,
        warmup_rounds=plan.load.warmup_rounds,
        passes_per_level=plan.load.passes,
        lockstep=plan.load.lockstep,
        extra_body=workload.extra_body,
        host={"python": platform.python_version(), "platform": platform.platform(), "cpus": os.cpu_count()},
    )


async def _collect(plan: BenchPlan, display: SweepDisplay) -> Results:
    started = datetime.now(UTC)
    headers = plan.load.headers
    model = plan.workload_model or await discover_model(plan.targets[0], headers)
    workload = Workload(
        model=model,
        output_len=plan.output_len,
        input_len=plan.input_len,
        ignore_eos=plan.ignore_eos,
        extra_body=plan.extra_body,
    )
    full = {t.name: await server_info(t, headers) for t in plan.targets}
    infos = {name: selected(info) for name, info in full.items()}
    simulations = {name: read_simulation(info) for name, info in full.items()}
    display.out.print(
        f"crossover bench: {model}, {plan.input_len} in / {plan.output_len} out tokens, "
        f"C = {','.join(map(str, plan.concurrencies))}, targets {', '.join(t.name for t in plan.targets)} "
        f"-> {plan.out_dir}"
    )
    for name, simulation in simulations.items():
        if simulation is not None:
            display.simulated(name, simulation)
    for target in plan.targets:
        check = await probe(target, workload, plan.load)
        if not check.success:
            raise BenchError(f"probe request to {target.name} ({target.chat_url}) failed: {check.error}")
    levels: list[Level] = []
    this_pass: dict[str, LevelSchedule] = {}  # the pass just run, per simulated target
    kept: dict[str, list[LevelSchedule]] = {}  # the level's passes that count, per simulated target

    gate = None if plan.in_engine_url is None else EngineGate(plan.in_engine_url, plan.in_engine_admin_key)
    original = None if gate is None else await gate.read()

    accepts: dict[str, list[float]] = {}  # the level's passes' acceptance, per target

    async def pass_begins(target: Target, concurrency: int) -> Callable[[Window], Awaitable[None]] | None:
        if gate is not None and target.name in GATES:
            await gate.set(GATES[target.name])
        simulation = simulations[target.name]
        metrics_before = await read_metrics(metrics_client, target, headers)
        before = None if simulation is None else await server_info(target, headers)
        began = time.monotonic()

        async def pass_ends(window: Window) -> None:
            # Right after the pass; with the read right before it, the stand-in's speed over the whole pass.
            if simulation is not None:
                info = await server_info(target, headers)
                entry = read_pass(simulation, concurrency, info, before, time.monotonic() - began)
                if entry.held_ratio is not None:
                    below = {lv.concurrency: lv.output_throughput for lv in levels if lv.target == target.name}
                    throughput = summarize_passes(target.name, concurrency, [window]).output_throughput
                    entry.schedule_share = schedule_share(entry.held_ratio, concurrency, throughput, below)
                this_pass[target.name] = entry
            accept = pass_acceptance(metrics_before, await read_metrics(metrics_client, target, headers))
            if accept is not None:
                accepts.setdefault(target.name, []).append(accept)

        return pass_ends

    async def pass_done(concurrency: int, index: int, may_rerun: bool) -> bool:
        entries = dict(this_pass)
        this_pass.clear()
        judge_shares(entries)
        behind = {name: entry for name, entry in entries.items() if entry.lagging}
        rerun = bool(behind) and may_rerun
        for name, entry in entries.items():
            entry.pass_index, entry.rerun = index, rerun
            simulations[name].levels.append(entry)
            if not rerun:
                kept.setdefault(name, []).append(entry)
        if rerun:
            display.pass_rerun(concurrency, index, behind)
        return not rerun

    async def level_done(level: Level) -> None:
        passes = accepts.pop(level.target, [])
        level.accept_length = round(sum(passes) / len(passes), 4) if passes else None
        levels.append(level)
        display.level_done(level, kept.pop(level.target, None))
        # Rewritten after every level, so an interrupted sweep keeps what it measured.
        meta = metadata(plan, workload, infos, simulations, started)
        results.write_results(plan.out_dir, results.build_results(meta, levels, plan.speculative, plan.plain))

    metrics_client = httpx.AsyncClient(trust_env=False)
    try:
        await run_sweep(
            plan.targets,
            plan.concurrencies,
            workload,
            plan.load,
            on_level_start=display.level_started,
            on_level_begin=pass_begins,
            on_level_done=level_done,
            on_pass_done=pass_done,
        )
    finally:
        await metrics_client.aclose()
        # Also on Ctrl-C (the runner cancels this task) and a failed level: the engine serves on as it was.
        if gate is not None:
            await gate.set(original)
            display.out.print(f"{plan.in_engine_url}: gate restored to {original}")
    meta = metadata(plan, workload, infos, simulations, started)
    return results.build_results(meta, levels, plan.speculative, plan.plain)


def run(plan: BenchPlan) -> int:
    """Run the sweep and everything after it; returns the process exit code."""
    from crossover.loadtest.display import SweepDisplay, print_crossover, print_errors, print_summary

    if plan.plots:
        plots.require_matplotlib()
    try:
        plan.out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        print(f"crossover bench: cannot use --out {plan.out_dir}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    display = SweepDisplay()
    try:
        with display, _event_loop_runner() as runner:
            run_results = runner.run(_collect(plan, display))
    except (BenchError, EngineGateError) as exc:
        print(f"crossover bench: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        kept = plan.out_dir / results.RESULTS_JSON
        where = f"the levels done are in {kept}" if kept.exists() else "no level was done"
        print(f"crossover bench: interrupted; {where}", file=sys.stderr)
        return 130  # 128 + SIGINT, as a shell reports Ctrl-C
    written = [*results.write_results(plan.out_dir, run_results), write_rate_table(plan.out_dir, run_results)]
    if plan.plots:
        series, markers = plots.series_of(run_results)
        meta = run_results.metadata
        title = f"{meta.model}: {meta.input_len} in / {meta.output_len} out tokens"
        notice = plots.refusal_notice(run_results)
        written += plots.draw(plan.out_dir, series, markers, title=title, notices=[notice] if notice else [])
    console = display.out
    print_summary(console, run_results.levels)
    print_errors(console, run_results.levels)
    print_crossover(console, run_results.crossover, run_results.queueing)
    if plan.in_engine_url is not None:
        # gate-0 against gate-off is the run's crossover; against any other target (a plain server), both
        # settings, so the report says where zero-step stops paying against plain too.
        others = [t.name for t in plan.targets if t.name not in GATES]
        for setting, other in ((s, o) for o in others for s in GATES):
            section = results.crossover_section(run_results.levels, setting, other, run_results.metadata.targets)
            print_crossover(console, section, [])
    console.print("wrote " + ", ".join(str(p) for p in written))
    applied = apply_recommendation(console, run_results.crossover, plan.apply_url, plan.admin_token)
    return max(applied, results.exit_status(run_results))


def apply_recommendation(console: Console, crossover: Crossover, url: str | None, token: str | None) -> int:
    if url is None:
        return 0
    recommended = crossover.recommended_threshold
    if recommended is None:
        why = crossover.reason or f"crossover {crossover.status.replace('_', ' ')}"
        print(f"crossover bench: --apply: no recommendation to apply ({why})", file=sys.stderr)
        return 1
    try:
        applied = apply_threshold(url, token or "", recommended.model_dump(), spillover_share=crossover.spillover_share)
    except ApplyError as exc:
        print(f"crossover bench: --apply: {exc}", file=sys.stderr)
        return 1
    other = {name: value for name, value in recommended.model_dump().items() if name != applied.policy}
    console.print(
        f"applied the {applied.policy} recommendation to {url} (the gateway's policy; not "
        + ", ".join(f"{name} = {value}" for name, value in other.items())
        + f"): threshold {applied.old_threshold} -> {applied.new_threshold}"
        + (
            f", hysteresis {applied.old_hysteresis} -> {applied.new_hysteresis}"
            if applied.new_hysteresis != applied.old_hysteresis
            else ""
        )
        + (f", spillover share {applied.old_share} -> {applied.new_share}" if applied.new_share is not None else "")
    )
    return 0
