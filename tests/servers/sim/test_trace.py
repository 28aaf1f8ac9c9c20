"""Load traces (servers/sim/trace.py): CSV and JSON say the same; a bad one says where and why."""

from __future__ import annotations

import pytest

from crossover.servers.sim.trace import (
    TRACES_DIR,
    TraceError,
    TracePhase,
    load_trace,
    parse_trace,
    shifts_acceptance,
    with_accept_drop,
)

SHIPPED_TRACES = sorted(str(path) for path in TRACES_DIR.glob("*.csv"))


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
        ("duration_s,concurrency,accept_length\n60,1,0.5\n", False, "row 2: accept_length: Input should be greater"),
        ("duration_s,concurrency,rate\n60,1,3\n", False, "or 'duration_s,concurrency,accept_length'"),
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


def test_an_accept_length_column_gives_a_phase_its_acceptance_and_an_empty_cell_the_profiles():
    csv_trace = parse_trace("duration_s,concurrency,accept_length\n60,1,2.5\n60,4,\n")
    json_trace = parse_trace('[{"duration_s": 60, "concurrency": 1, "accept_length": 2.5}, '
                             '{"duration_s": 60, "concurrency": 4}]', json_format=True)  # fmt: skip
    expected = [
        TracePhase(duration_s=60, concurrency=1, accept_length=2.5),
        TracePhase(duration_s=60, concurrency=4),
    ]
    assert csv_trace == json_trace == expected
    assert shifts_acceptance(expected)
    assert not shifts_acceptance([TracePhase(duration_s=60, concurrency=4)])


def test_an_accept_drop_splits_the_phase_it_falls_in():
    trace = [TracePhase(duration_s=60, concurrency=1), TracePhase(duration_s=60, concurrency=4)]
    assert with_accept_drop(trace, at_s=90, accept_length=1.5) == [
        TracePhase(duration_s=60, concurrency=1),
        TracePhase(duration_s=30, concurrency=4),
        TracePhase(duration_s=30, concurrency=4, accept_length=1.5),
    ]
    assert with_accept_drop(trace, at_s=60, accept_length=1.5)[1].accept_length == 1.5
    assert with_accept_drop(trace, at_s=500, accept_length=1.5) == trace


def test_a_missing_trace_file_is_a_trace_error(tmp_path):
    with pytest.raises(TraceError, match="cannot read"):
        load_trace(tmp_path / "nope.csv")


def test_traces_are_shipped():
    assert SHIPPED_TRACES


def test_every_shipped_trace_loads():
    for path in SHIPPED_TRACES:
        assert load_trace(path)
