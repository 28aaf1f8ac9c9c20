"""A stand-in that falls behind its schedule: bench records its time scale and lag per level and names no
crossover from it. Against real servers: a scripted backend on uvicorn playing a stand-in's `/server_info`,
and the real stand-in at an absurd time scale (once it reports its schedule)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable

import httpx
import jsonschema
import pytest

from crossover.loadtest.config import MAX_RERUNS_PER_LEVEL
from crossover.loadtest.models import LevelSchedule, Schedule, Simulation, TargetInfo
from crossover.loadtest.results import load_results, load_schema
from crossover.loadtest.standin import judge_shares, read_simulation, record_level, refusal, schedule_share
from tests.loadtest.run_cli import crossover
from tests.loadtest.scripted_backend import ScriptedBackend

TIME_SCALE = 100.0
KEEPING_UP = {"time_scale": TIME_SCALE, "lag_s": 0.01, "max_lag_s": 0.02, "speed_ratio": 1.0, "lagging": False}
ABSURD_TIME_SCALE = "1000"
LEVEL_S = 4.0  # the real stand-in judges its speed over its last 5 s
LAGGING = {"time_scale": TIME_SCALE, "lag_s": 2.5, "max_lag_s": 2.5, "speed_ratio": 0.5, "lagging": True}


def stand_in_info(schedule: dict | None) -> dict:
    info = {"version": "0.5.23", "simulated": True, "simulator": {"profile": "fake", "time_scale": TIME_SCALE}}
    return info if schedule is None else {**info, "schedule": schedule}


def png_text(path) -> dict[str, str]:
    """The tEXt chunks of a PNG (matplotlib writes savefig's metadata there)."""
    data, chunks, at = path.read_bytes(), {}, 8
    while at < len(data):
        length = int.from_bytes(data[at : at + 4], "big")
        kind, body = data[at + 4 : at + 8], data[at + 8 : at + 8 + length]
        if kind == b"tEXt":
            key, _, value = body.partition(b"\0")
            chunks[key.decode("latin-1")] = value.decode("latin-1")
        at += 12 + length
    return chunks


def bench(out, speculative: str, plain: str, *extra: str) -> int:
    return crossover(
        "bench",
        "--target",
        f"speculative={speculative}",
        "--target",
        f"plain={plain}",
        "--model",
        "ok",
        "--concurrency",
        "1,2,4",
        "--requests-per-level",
        "4",
        "--out",
        str(out),
        "--no-plots",
        *extra,
    )


def test_server_info_is_read_tolerantly():
    assert read_simulation({"version": "0.5.23"}) is None  # a real SGLang server
    assert read_simulation({"simulated": "yes"}) is None
    old = read_simulation(stand_in_info(None))  # a stand-in from before the schedule block
    assert old == Simulation(time_scale=TIME_SCALE, schedule=None)
    odd = read_simulation(stand_in_info({"lag_s": "a lot", "lagging": 1, "speed_ratio": 0.9}))
    assert odd.schedule == Schedule(speed_ratio=0.9)  # wrong types are unknown, never guessed
    entry = record_level(odd, 4, None)  # /server_info did not answer after the level
    assert (entry.concurrency, entry.lagging, entry.lag_s) == (4, None, None)


def test_only_a_lagging_level_of_the_pair_refuses_the_crossover():
    simulation = read_simulation(stand_in_info(KEEPING_UP))
    record_level(simulation, 1, stand_in_info(KEEPING_UP))
    targets = {"plain": TargetInfo(url="http://p", simulation=simulation), "other": TargetInfo(url="http://o")}
    assert refusal(targets, "speculative", "plain") is None
    record_level(simulation, 8, stand_in_info(LAGGING))
    reason = refusal(targets, "speculative", "plain")
    assert reason.startswith("plain (a stand-in at time scale 100) fell behind its schedule at C = 8")
    assert "lag 2.50 s" in reason and "speed 0.50" in reason
    assert refusal(targets, "speculative", "other") is None


@pytest.fixture
def stand_ins(serve):
    """Two scripted backends playing stand-ins: speculative keeps up; plain lags from its 5th read on (the
    reads are: before the sweep, then before and after each of its levels - so from level C=2)."""
    speculative = serve(ScriptedBackend(lambda n: stand_in_info(KEEPING_UP))).url
    plain = serve(ScriptedBackend(lambda n: stand_in_info(LAGGING if n >= 4 else KEEPING_UP))).url
    return speculative, plain


def test_a_lagging_stand_in_is_recorded_and_no_crossover_is_named(stand_ins, tmp_path, capsys):
    speculative, plain = stand_ins
    # One pass a level: the plain stand-in's reads are before the sweep, then before and after each level.
    assert bench(tmp_path / "run", speculative, plain, "--passes", "1") == 1  # results written, not trusted
    printed, progress = capsys.readouterr()
    data = json.loads((tmp_path / "run" / "results.json").read_text())
    jsonschema.validate(data, load_schema())
    run = load_results(tmp_path / "run")

    plain_sim = run.metadata.targets["plain"].simulation
    assert plain_sim.time_scale == TIME_SCALE
    # A level it lags in is measured again while reruns are left, and kept (lagging) once they are spent.
    reruns = [
        entry for c in (2, 4) for entry in [(c, True, 2.5, True)] * MAX_RERUNS_PER_LEVEL + [(c, True, 2.5, False)]
    ]
    assert [(lv.concurrency, lv.lagging, lv.lag_s, lv.rerun) for lv in plain_sim.levels] == [
        (1, False, 0.01, False),
        *reruns,
    ]
    assert plain_sim.schedule.lagging is True
    assert [lv.lagging for lv in run.metadata.targets["speculative"].simulation.levels] == [False] * len(
        plain_sim.levels
    )

    crossing = run.crossover
    assert crossing.status == "refused"
    assert crossing.concurrency is None and crossing.recommended_threshold is None
    assert "plain (a stand-in at time scale 100) fell behind its schedule at C = 2, 4" in crossing.reason
    assert [row.concurrency for row in crossing.evidence] == [1, 2, 4]  # the evidence is kept
    assert "crossover: REFUSED: plain (a stand-in" in printed
    assert "LAGGING stand-in (lag 2.50 s" in progress

    # Re-analysed later, the same file still refuses and exits as its bench did, and --apply has nothing to send.
    assert crossover("bench", "report", str(tmp_path / "run"), "--no-plots") == 1
    printed, said = capsys.readouterr()
    assert "crossover: REFUSED" in printed and "REFUSED: run" in said
    # Its plots say so too, in the title and across the axes (read back from the PNGs' text chunks).
    assert crossover("bench", "report", str(tmp_path / "run"), "--out", str(tmp_path / "plots")) == 1
    for png in ("throughput.png", "latency.png"):
        text = png_text(tmp_path / "plots" / png)
        assert text["Title"].startswith("REFUSED - ")
        assert text["Description"].startswith("REFUSED: plain (a stand-in at time scale 100) fell behind")
    code = crossover(
        "bench", "report", str(tmp_path / "run"), "--no-plots", "--apply", "http://127.0.0.1:1", "--admin-token", "t"
    )
    assert code == 1
    assert "no recommendation to apply (plain (a stand-in" in capsys.readouterr().err


def test_a_stand_in_that_fell_behind_during_a_level_lags_there_though_it_caught_up_by_its_end(serve, tmp_path):
    # Each read says "keeping up", but the clock advanced by only 1 profile second a read: over a level that
    # took ~0.1 wall s at time scale 100 it should have advanced ~10.
    def fell_behind(n: int) -> dict:
        return stand_in_info({**KEEPING_UP, "clock_s": float(n), "generated_tokens": 0})

    speculative = serve(ScriptedBackend(lambda n: stand_in_info(KEEPING_UP))).url
    plain = serve(ScriptedBackend(fell_behind)).url
    assert bench(tmp_path / "run", speculative, plain) == 1
    levels = load_results(tmp_path / "run").metadata.targets["plain"].simulation.levels
    assert all(lv.lagging and lv.level_speed_ratio < 0.9 for lv in levels), levels
    assert "over the level" in load_results(tmp_path / "run").crossover.reason


def test_stand_ins_that_keep_up_get_their_crossover(serve, tmp_path):
    speculative = serve(ScriptedBackend(lambda n: stand_in_info(KEEPING_UP))).url
    plain = serve(ScriptedBackend(lambda n: stand_in_info(None))).url  # lag unknown: said, not refused
    assert bench(tmp_path / "run", speculative, plain) == 0
    run = load_results(tmp_path / "run")
    assert run.crossover.status != "refused" and run.crossover.recommended_threshold is not None
    levels = run.metadata.targets["plain"].simulation.levels
    assert [(lv.concurrency, lv.pass_index, lv.lagging) for lv in levels] == [
        (c, index, None) for c in (1, 2, 4) for index in (0, 1)
    ]


def test_a_stand_in_that_fell_behind_for_one_pass_costs_that_pass_a_rerun_not_the_run(serve, tmp_path, capsys):
    # The plain stand-in's reads (from 0): before the sweep, then before and after each pass; it says it lags
    # only right after C=2's first pass (read 6) - a few slow seconds on a shared machine.
    speculative = serve(ScriptedBackend(lambda n: stand_in_info(KEEPING_UP))).url
    plain = serve(ScriptedBackend(lambda n: stand_in_info(LAGGING if n == 6 else KEEPING_UP))).url
    assert bench(tmp_path / "run", speculative, plain) == 0
    _, progress = capsys.readouterr()
    run = load_results(tmp_path / "run")
    assert run.crossover.status != "refused" and run.crossover.recommended_threshold is not None
    levels = run.metadata.targets["plain"].simulation.levels
    assert [(lv.concurrency, lv.pass_index, lv.lagging, lv.rerun) for lv in levels] == [
        (1, 0, False, False),
        (1, 1, False, False),
        (2, 0, True, True),  # measured again...
        (2, 0, False, False),  # ...and kept
        (2, 1, False, False),
        (4, 0, False, False),
        (4, 1, False, False),
    ]
    # The speculative stand-in ran that pass again too: the targets stay interleaved.
    assert [lv.rerun for lv in run.metadata.targets["speculative"].simulation.levels].count(True) == 1
    assert "C=2    pass 1: a stand-in fell behind its schedule, plain (lag 2.50 s" in progress
    assert "measuring the pass again" in progress


def test_a_shortfall_both_stand_ins_share_moves_no_verdict_and_one_alone_does():
    curve = {1: 100.0, 4: 300.0}
    assert schedule_share(0.9, 1, 100.0, {}) == 0.9  # at the lowest level: in proportion
    # Held 12 of 16: the curve between 4 and 16 read at 12 (linear in log C), over its value at 16.
    assert schedule_share(0.75, 16, 500.0, curve) == pytest.approx((300 + 200 * 0.7925) / 500, abs=1e-4)
    assert schedule_share(1.2, 16, 500.0, curve) == 1.0  # aborted streams counted late: never above a full share
    assert schedule_share(0.5, 16, 0.0, curve) is None  # nothing delivered: nothing to read

    def judged(*shares: float | None) -> list[bool | None]:
        entries = {str(i): LevelSchedule(concurrency=8, schedule_share=share) for i, share in enumerate(shares)}
        judge_shares(entries)
        return [entry.lagging for entry in entries.values()]

    assert judged(0.85, 0.84) == [None, None]  # the HTTP exchange's own cost, shared
    assert judged(0.95, 0.84) == [None, True]  # one stand-in's HTTP side behind the other's
    assert judged(0.5) == [None]  # alone: nothing to tell the exchange's own cost from a lag (its clock judges)
    assert judged(0.5, None) == [None, None]  # beside a server that does not count (a real engine, a gateway)
    assert judged(None, None) == [None, None]


def holding(share: float) -> Callable[[int], dict]:
    """/server_info of a stand-in whose clock keeps time while its engine holds `share` of one request: the
    load waits outside it (an HTTP side that lags)."""

    def info(_: int) -> dict:
        wall = time.monotonic()
        counts = {"clock_s": wall * TIME_SCALE, "generated_tokens": 0, "wall_s": wall, "held_request_s": share * wall}
        return stand_in_info({**KEEPING_UP, **counts})

    return info


def test_a_stand_in_whose_clock_keeps_time_while_the_load_waits_outside_it_is_re_run_then_refused(serve, tmp_path):
    # Both clocks keep time; the plain stand-in's engine holds half a request where the speculative one's holds one.
    # At one stream the share is the held ratio itself (the scripted servers' curves above it are noise).
    speculative = serve(ScriptedBackend(holding(1.0))).url
    plain = serve(ScriptedBackend(holding(0.5))).url
    assert bench(tmp_path / "run", speculative, plain, "--passes", "1", "--concurrency", "1") == 1
    run = load_results(tmp_path / "run")
    levels = run.metadata.targets["plain"].simulation.levels
    print(levels)
    assert all(lv.level_speed_ratio >= 0.9 for lv in levels)  # its clock kept time...
    assert all(lv.lagging and lv.schedule_share == pytest.approx(0.5, abs=0.05) for lv in levels)  # ...its load not
    assert [lv.rerun for lv in levels] == [True] * MAX_RERUNS_PER_LEVEL + [False]
    speculative_levels = run.metadata.targets["speculative"].simulation.levels
    assert not any(lv.lagging for lv in speculative_levels)  # the best share is no lag
    assert run.crossover.status == "refused"
    assert "plain (a stand-in at time scale 100) fell behind its schedule at C = 1" in run.crossover.reason
    assert "its engine held 0.5" in run.crossover.reason and "requests kept open" in run.crossover.reason


def test_the_real_stand_in_at_an_absurd_time_scale_is_refused(sim, tmp_path, capsys):
    # At 1000x, 64 streams need a step every few tens of microseconds: no two-core machine keeps that up
    # (measured speed ratios 0.4-0.7; it counts as lagging below 0.9). Higher scales lag less visibly: the
    # engine then idles waiting for the load generator, and idle time counts as keeping up.
    speculative = sim("k25-eagle3", "--time-scale", ABSURD_TIME_SCALE, "--log-level", "warning")
    plain = sim("k25-plain", "--time-scale", ABSURD_TIME_SCALE, "--log-level", "warning")
    info = httpx.get(f"{plain.url}/server_info", timeout=10).json()
    if "schedule" not in info:
        pytest.skip("this stand-in does not report its schedule yet (servers/sim)")
    code = crossover(
        "bench",
        "--target",
        f"speculative={speculative.url}",
        "--target",
        f"plain={plain.url}",
        "--concurrency",
        "64",
        "--output-len",
        "256",
        "--input-len",
        "16",
        # Long enough for the stand-in to judge its speed over its recent window (5 s).
        "--duration-per-level",
        str(LEVEL_S),
        "--out",
        str(tmp_path / "run"),
        "--no-plots",
    )
    run = load_results(tmp_path / "run")
    simulations = {name: t.simulation for name, t in run.metadata.targets.items()}
    assert {name: s.time_scale for name, s in simulations.items()} == {"speculative": 1000.0, "plain": 1000.0}
    print({name: s.levels for name, s in simulations.items()})  # the evidence, shown when a check fails
    assert any(s.lagging_levels() == {64} for s in simulations.values())
    assert (run.crossover.status, code) == ("refused", 1)
    assert "fell behind its schedule at C = 64" in capsys.readouterr().out


STARVED_TIME_SCALE = "100"  # the starved stand-in needs most of a core at this scale
# The starved stand-in's niceness beside a burner at 0 on the same core: the kernel then gives it about 1/70 of
# that core (CFS weights 15 and 1024), whatever else the machine runs. Pinning beside a burner alone gave it half
# a core, which it sometimes kept up with: the test then had nothing to judge and skipped (CI did, too).
STARVED_NICE = 19


def starve(pid: int, core: int) -> None:
    """Every thread of `pid` onto `core`, at the lowest priority (both are per thread on Linux)."""
    for task in os.listdir(f"/proc/{pid}/task"):
        os.sched_setaffinity(int(task), {core})
        os.setpriority(os.PRIO_PROCESS, int(task), STARVED_NICE)


def test_a_stand_in_starved_by_a_burner_pinned_beside_it_is_re_run_or_refused_never_a_verdict(sim, tmp_path):
    # The plain stand-in and a busy loop share one core, the stand-in at the lowest priority; the speculative
    # stand-in runs where it likes: every level where the starved one fell behind its own clock is measured again
    # or refused, never judged.
    speculative = sim("k25-eagle3", "--time-scale", STARVED_TIME_SCALE, "--log-level", "warning")
    plain = sim("k25-plain", "--time-scale", STARVED_TIME_SCALE, "--log-level", "warning")
    core = min(os.sched_getaffinity(0))
    burner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        os.sched_setaffinity(burner.pid, {core})
        starve(plain.proc.pid, core)
        code = crossover(
            "bench",
            "--target",
            f"speculative={speculative.url}",
            "--target",
            f"plain={plain.url}",
            "--concurrency",
            "32",
            "--output-len",
            "128",
            "--input-len",
            "16",
            "--duration-per-level",
            "2",
            "--passes",
            "1",
            "--out",
            str(tmp_path / "run"),
            "--no-plots",
        )
    finally:
        burner.kill()
        burner.wait()
    run = load_results(tmp_path / "run")
    passes = run.metadata.targets["plain"].simulation.levels
    print(passes)  # the evidence, shown when a check fails
    lagged = [entry for entry in passes if entry.lagging]
    assert lagged, f"the starved stand-in kept its schedule: {passes}"
    # Every pass it lagged in was measured again, or (reruns spent) the level refuses the crossover.
    assert all(entry.rerun for entry in lagged) or (run.crossover.status, code) == ("refused", 1)
    if run.crossover.status != "refused":
        assert passes[-1].lagging is False and not passes[-1].rerun  # the pass that counts kept up
