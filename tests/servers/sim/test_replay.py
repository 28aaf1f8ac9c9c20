"""`crossover sim replay`: traces, mechanisms and the JSON report, in virtual time (no servers, no sleeping)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from crossover.gateway.cli import main
from crossover.gateway.switch_policy import PLAIN, SPECULATIVE
from crossover.servers.sim.profile import load_profile
from crossover.servers.sim.replay import (
    ALWAYS_PLAIN,
    ALWAYS_SPECULATIVE,
    MECHANISMS,
    ORACLE,
    RESTART,
    SLEEP,
    TRACES_DIR,
    ReplaySetup,
    SwitchTimes,
    TraceError,
    TracePhase,
    load_trace,
    parse_trace,
    replay,
    replay_all,
)

# A pair with a clear crossover (~C 16-32) and short requests, so a replay of a few phases takes a fraction
# of a second: the speculative server is ~2x faster alone and ~0.7x at a batch of 64.
COMMON = """
model_name = "test/model"
[limits]
max_running_requests = 256
max_total_num_tokens = 1000000
[prefill]
fixed_s = 0.01
per_token_s = 0.00001
[memory]
startup_s = 10.0
release_s = 1.0
resume_s = 2.0
"""
SPECULATIVE_TOML = f"""
kind = "parametric"
{COMMON}
[speculative]
num_steps = 3
accept_length = 3.0
[decode]
fixed_s = 0.02
per_request_s = 0.001
per_query_token_s = 0.001
[draft]
fixed_s = 0.001
"""
PLAIN_TOML = f"""
kind = "parametric"
{COMMON}
[decode]
fixed_s = 0.02
per_request_s = 0.001
"""
LOW, HIGH = 2, 64
SHORT = {"input_len": 32, "output_len": 64}


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    folder = tmp_path_factory.mktemp("profiles")
    (folder / "spec.toml").write_text(SPECULATIVE_TOML)
    (folder / "plain.toml").write_text(PLAIN_TOML)
    return load_profile(str(folder / "spec.toml")), load_profile(str(folder / "plain.toml"))


def alternating(phase_s: float, phases: int = 4) -> list[TracePhase]:
    return [TracePhase(duration_s=phase_s, concurrency=LOW if i % 2 == 0 else HIGH) for i in range(phases)]


def setup_for(pair, trace, **kwargs) -> ReplaySetup:
    spec, plain = pair
    kwargs.setdefault("times", SwitchTimes.from_profiles(spec, plain, stop_s=1.0, startup_s=10.0))
    kwargs = {"min_dwell_s": 30, "window_s": 10, **SHORT, **kwargs}
    return ReplaySetup.from_profiles(spec, plain, trace, **kwargs)


@pytest.fixture(scope="module")
def alternating_results(pair):
    trace = alternating(300)
    setup = setup_for(pair, trace)
    return setup, {m: replay(setup, trace, m) for m in MECHANISMS}


# --- traces ---------------------------------------------------------------------------------------------


def test_a_csv_trace_and_a_json_trace_say_the_same(tmp_path):
    (tmp_path / "t.csv").write_text("duration_s,concurrency\n60,1\n\n120.5, 64\n")
    (tmp_path / "t.json").write_text('[{"duration_s": 60, "concurrency": 1}, {"duration_s": 120.5, "concurrency": 64}]')
    expected = [TracePhase(duration_s=60, concurrency=1), TracePhase(duration_s=120.5, concurrency=64)]
    assert load_trace(tmp_path / "t.csv") == expected
    assert load_trace(tmp_path / "t.json") == expected


@pytest.mark.parametrize(
    ("text", "json_format", "message"),
    [
        ("duration,clients\n60,1\n", False, "header must be 'duration_s,concurrency'"),
        ("", False, "header must be"),
        ("duration_s,concurrency\n", False, "no phases"),
        ("duration_s,concurrency\n60,1\n0,4\n", False, "row 3: duration_s: Input should be greater than 0"),
        ("duration_s,concurrency\n60,lots\n", False, "row 2: concurrency"),
        ("duration_s,concurrency\n60,-1\n", False, "row 2: concurrency: Input should be greater than or equal"),
        ("duration_s,concurrency\n60\n", False, "row 2: concurrency: Field required"),
        ("duration_s,concurrency\ninf,1\n", False, "row 2: duration_s"),
        ("[{", True, "not valid JSON"),
        ("{}", True, "list"),
        ("[]", True, "no phases"),
        ('[{"duration_s": 1, "concurrency": 1, "rate": 3}]', True, "item 0: rate: Extra inputs"),
        ('[{"duration_s": 1}]', True, "item 0: concurrency: Field required"),
    ],
)
def test_a_bad_trace_says_where_and_why(text, json_format, message):
    with pytest.raises(TraceError, match="^t: .*" + message.replace("(", r"\(")):
        parse_trace(text, where="t", json_format=json_format)


def test_a_missing_trace_file_is_a_trace_error(tmp_path):
    with pytest.raises(TraceError, match="cannot read"):
        load_trace(tmp_path / "nope.csv")


# --- mechanisms -----------------------------------------------------------------------------------------


def test_the_pair_crosses_between_the_two_loads(alternating_results):
    setup, _ = alternating_results
    assert LOW < setup.settings.threshold <= HIGH
    assert setup.rates.throughput(SPECULATIVE, LOW) > 1.5 * setup.rates.throughput(PLAIN, LOW)
    assert setup.rates.throughput(PLAIN, HIGH) > 1.2 * setup.rates.throughput(SPECULATIVE, HIGH)


def test_fixed_modes_never_switch(alternating_results):
    _, results = alternating_results
    for mechanism in (ALWAYS_SPECULATIVE, ALWAYS_PLAIN):
        assert results[mechanism].switches == 0
        assert results[mechanism].switching_s == 0
        assert results[mechanism].requests_cut == 0
        assert results[mechanism].requests_completed > 0


def test_the_oracle_beats_every_fixed_mode_and_switches_for_free(alternating_results):
    _, results = alternating_results
    oracle = results[ORACLE]
    # Phase 1 starts speculative (the oracle's choice for it), then one switch per boundary.
    assert (oracle.switches, oracle.switching_s) == (3, 0.0)
    for mechanism in (ALWAYS_SPECULATIVE, ALWAYS_PLAIN):
        assert oracle.output_tokens > results[mechanism].output_tokens


def test_sleep_switches_each_way_and_beats_the_worse_fixed_mode(alternating_results):
    _, results = alternating_results
    sleep = results[SLEEP]
    # Starts speculative: to plain in phase 2, back in phase 3, to plain in phase 4.
    assert sleep.switches == 3
    # Each switch: a drain, then release 1 s + resume 2 s.
    assert sleep.switching_s >= 3 * 3.0
    worse = min(results[ALWAYS_SPECULATIVE].output_tokens, results[ALWAYS_PLAIN].output_tokens)
    better = max(results[ALWAYS_SPECULATIVE].output_tokens, results[ALWAYS_PLAIN].output_tokens)
    assert sleep.output_tokens > better > worse
    assert sleep.output_tokens <= results[ORACLE].output_tokens


def test_a_restart_is_slower_than_sleep_and_a_costly_one_is_not_taken_for_short_phases(pair):
    trace = alternating(60)
    spec, plain = pair
    slow = SwitchTimes.from_profiles(spec, plain, stop_s=5.0, startup_s=600.0)
    setup = setup_for(pair, trace, times=slow)
    restart = replay(setup, trace, RESTART)
    assert restart.switches == 0
    assert restart.output_tokens == replay(setup, trace, ALWAYS_SPECULATIVE).output_tokens


def test_a_drain_deadline_of_zero_cuts_what_is_in_flight(pair):
    trace = alternating(120, phases=2)
    setup = setup_for(pair, trace, drain_timeout_s=0.0, expected_phase_s=3600)
    result = replay(setup, trace, SLEEP)
    assert result.switches == 1
    assert result.requests_cut == HIGH  # the 64 clients of phase 2, all in flight when the switch starts


def test_switch_times_come_from_the_profiles_unless_overridden(pair):
    spec, plain = pair
    times = SwitchTimes.from_profiles(spec, plain, stop_s=2.0)
    assert times.seconds(SLEEP, SPECULATIVE, PLAIN) == 3.0  # release 1 + resume 2
    assert times.seconds(RESTART, SPECULATIVE, PLAIN) == 2.0 + getattr(plain.memory, "startup_s", 0.0)
    times = SwitchTimes.from_profiles(spec, plain, stop_s=2.0, startup_s=300.0, release_s=0.5, resume_s=0.25)
    assert times.seconds(RESTART, PLAIN, SPECULATIVE) == 302.0
    assert times.seconds(SLEEP, PLAIN, SPECULATIVE) == 0.75
    assert times.seconds(ORACLE, PLAIN, SPECULATIVE) == 0.0


def test_an_unknown_mechanism_is_refused(alternating_results):
    setup, _ = alternating_results
    with pytest.raises(ValueError, match="mechanism must be one of"):
        replay(setup, alternating(10), "teleport")


# --- the command ----------------------------------------------------------------------------------------


def test_the_command_prints_one_json_object_per_mechanism(pair, tmp_path, capsys):
    spec, plain = pair
    trace = tmp_path / "trace.csv"
    trace.write_text(f"duration_s,concurrency\n120,{LOW}\n120,{HIGH}\n")
    argv = ["sim", "replay", "--speculative", spec.source, "--plain", plain.source, "--trace", str(trace)]
    argv += ["--input-len", "32", "--output-len", "64", "--window-s", "10", "--min-dwell-s", "0", "--json"]
    assert main([*argv, "--mechanism", "sleep,oracle", "--release-s", "0.5"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [entry["mechanism"] for entry in report] == ["sleep", "oracle"]
    for entry in report:
        assert set(entry) == {
            "mechanism",
            "follows",
            "output_tokens",
            "vs_best_percent",
            "requests_completed",
            "requests_cut",
            "switches",
            "switching_s",
            "ttft_p50_s",
            "ttft_p99_s",
        }
        assert isinstance(entry["output_tokens"], int) and entry["output_tokens"] > 0
        assert entry["ttft_p50_s"] <= entry["ttft_p99_s"]


def test_the_command_table_and_its_errors(pair, tmp_path, capsys):
    spec, plain = pair
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps([{"duration_s": 60, "concurrency": LOW}]))
    argv = ["sim", "replay", "--speculative", spec.source, "--plain", plain.source, "--trace", str(trace)]
    assert main([*argv, "--input-len", "32", "--output-len", "64"]) == 0
    out = capsys.readouterr().out
    for mechanism in MECHANISMS:
        assert f"\n{mechanism} " in out
    assert main([*argv, "--mechanism", "sleep,warp"]) == 2
    assert "--mechanism" in capsys.readouterr().err
    trace.write_text("[]")
    assert main(argv) == 2
    assert "no phases" in capsys.readouterr().err
    assert main([*argv[:3], "no-such-profile", *argv[4:]]) == 2
    assert "no profile named" in capsys.readouterr().err


# --- the replay runs the controller's own stepper -------------------------------------------------------


def test_the_replay_and_the_live_controller_decide_the_same_at_the_same_times(pair):
    """One sequence of load samples through the live controller's tick and the replay's: the same decisions."""
    import dataclasses

    from crossover.servers.sim.replay import SERVING, _Replay
    from tests.gateway.ticking import TickingController, time_shared_settings

    ticking = TickingController(time_shared_settings())
    live = ticking.controller
    trace = alternating(60)
    setup = dataclasses.replace(setup_for(pair, trace), settings=live.policy_settings())
    replayed = _Replay(setup, trace, SLEEP)
    replayed.switcher = type(replayed.switcher)(live.switcher.cost)
    replayed.mode_since = 0.0
    decisions: list[tuple[float, str, str]] = []

    loads = [2] * 40 + [40] * 60 + [30] * 20 + [3] * 80 + [12] * 30 + [20] * 40
    for t, load in enumerate(loads, start=1):
        ticking.step(float(t), load)
        replayed.outstanding = load
        replayed._tick(float(t))
        if replayed.state != SERVING:  # the replay starts a switch: record it and have it over at once
            decisions.append((float(t), replayed.target, live.last_decision.reason))
            replayed.mode, replayed.mode_since, replayed.state = replayed.target, float(t), SERVING
    assert ticking.switches == decisions
    assert [target for _, target, _ in decisions] == ["plain", "speculative", "plain"], decisions


def test_json_carries_every_column_of_the_table(pair, tmp_path, capsys):
    spec, plain = pair
    trace = tmp_path / "trace.csv"
    trace.write_text(f"duration_s,concurrency\n60,{LOW}\n")
    argv = ["sim", "replay", "--speculative", spec.source, "--plain", plain.source, "--trace", str(trace)]
    argv += ["--input-len", "32", "--output-len", "64"]
    assert main(argv) == 0
    header = capsys.readouterr().out.splitlines()[-len(MECHANISMS) - 1]
    assert main([*argv, "--json"]) == 0
    entry = json.loads(capsys.readouterr().out)[0]
    columns = {"mechanism": "mechanism", "output tokens": "output_tokens", "vs best": "vs_best_percent"}
    columns |= {"completed": "requests_completed", "cut": "requests_cut", "switches": "switches"}
    columns |= {"switching s": "switching_s", "TTFT p50 s": "ttft_p50_s", "TTFT p99 s": "ttft_p99_s"}
    assert [name for name in columns if name in header] == list(columns)
    assert set(columns.values()) <= set(entry)


# --- the oracle is a bound; restart needs a cost --------------------------------------------------------

SHIPPED_TRACES = sorted(str(path) for path in TRACES_DIR.glob("*.csv"))


def test_traces_are_shipped():
    assert SHIPPED_TRACES


@pytest.mark.parametrize(
    "case",
    [
        "alternating-300",
        "alternating-60",
        "one-step",
        "short-phases",
        *(f"shipped:{path}" for path in SHIPPED_TRACES),
    ],
)
def test_no_mechanism_beats_the_oracle(pair, case):
    if case.startswith("shipped:"):
        profiles = (load_profile("k25-eagle3"), load_profile("k25-plain"))
        trace = load_trace(case.removeprefix("shipped:"))
        setup = ReplaySetup.from_profiles(*profiles, trace, input_len=256, output_len=256)
    else:
        trace = {
            "alternating-300": alternating(300),
            "alternating-60": alternating(60),
            "one-step": [TracePhase(duration_s=120, concurrency=LOW), TracePhase(duration_s=600, concurrency=HIGH)],
            "short-phases": alternating(5, phases=40),
        }[case]
        setup = setup_for(pair, trace, min_dwell_s=0)
    results = {r.mechanism: r for r in replay_all(setup, trace, MECHANISMS)}
    bound = results[ORACLE].output_tokens
    assert all(r.output_tokens <= bound for r in results.values()), {m: r.output_tokens for m, r in results.items()}
    assert results[ORACLE].follows is not None


def test_a_profile_without_startup_s_is_refused_for_restart(pair, tmp_path, capsys):
    spec, _ = pair
    bare = tmp_path / "bare.toml"
    bare.write_text(PLAIN_TOML.replace("startup_s = 10.0\n", ""))
    trace = [TracePhase(duration_s=60, concurrency=LOW)]
    times = SwitchTimes.from_profiles(spec, load_profile(str(bare)))
    setup = ReplaySetup.from_profiles(spec, load_profile(str(bare)), trace, times=times, **SHORT)
    with pytest.raises(ValueError, match="bare gives no \\[memory\\] startup_s"):
        replay(setup, trace, RESTART)
    assert replay(setup, trace, SLEEP).output_tokens > 0  # the other mechanisms need no start-up time
    assert replay(setup, trace, ORACLE).output_tokens > 0  # bounds what it can replay

    trace_file = tmp_path / "trace.csv"
    trace_file.write_text(f"duration_s,concurrency\n60,{LOW}\n")
    argv = ["sim", "replay", "--speculative", spec.source, "--plain", str(bare), "--trace", str(trace_file)]
    argv += ["--input-len", "32", "--output-len", "64"]
    assert main(argv) == 2
    assert "--startup-s" in capsys.readouterr().err
    assert main([*argv, "--startup-s", "30"]) == 0
    assert main([*argv, "--mechanism", "sleep,oracle"]) == 0


def test_fast_forwarded_steady_phases_agree_with_stepping_every_token(pair):
    # Long phases, so most of each is repeated from a measured stretch rather than stepped.
    trace = alternating(900)
    setup = setup_for(pair, trace)
    exact = replace(setup, fast_forward=False)
    for mechanism in (ALWAYS_SPECULATIVE, ALWAYS_PLAIN, SLEEP):
        fast, stepped = replay(setup, trace, mechanism), replay(exact, trace, mechanism)
        assert fast.switches == stepped.switches, mechanism
        assert fast.output_tokens == pytest.approx(stepped.output_tokens, rel=0.01), mechanism
        assert fast.requests_completed == pytest.approx(stepped.requests_completed, rel=0.01), mechanism
