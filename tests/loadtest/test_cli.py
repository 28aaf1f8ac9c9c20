"""`crossover bench` and `crossover bench report` as a user calls them, against the scripted backend."""

from __future__ import annotations

import json

import jsonschema
import pytest

from crossover.loadtest.results import load_schema
from tests.loadtest.run_cli import crossover


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([], "give at least one --target NAME=URL"),
        (["--target", "nourl"], "expected NAME=http(s)://HOST:PORT"),
        (["--target", "a=ftp://x"], "expected NAME=http(s)://HOST:PORT"),
        (["--target", "a=http://x", "--target", "a=http://y"], "names must be unique"),
        (["--target", "a=http://x", "--concurrency", "1,zero"], "expected comma-separated integers"),
        (["--target", "a=http://x", "--concurrency", "0,2"], "expected positive integers"),
        (["--target", "a=http://x", "--output-len", "0"], "argument --output-len: must be > 0"),
        (["--target", "a=http://x", "--request-timeout", "inf"], "argument --request-timeout: must be a finite"),
        (["--target", "a=http://x", "--warmup-rounds", "-1"], "argument --warmup-rounds: must be >= 0"),
        (["--target", "a=http://x", "--extra-body", "[1]"], "--extra-body: must be a JSON object"),
        (["--target", "a=http://x", "--extra-body", "{"], "--extra-body: not JSON"),
        (["--target", "a=http://x", "--apply", "http://gw"], "--apply needs --admin-token"),
    ],
)
def test_bad_arguments_exit_2_with_a_message(argv, message, capsys, monkeypatch):
    monkeypatch.delenv("CROSSOVER_ADMIN_TOKEN", raising=False)
    assert crossover("bench", *argv) == 2
    assert message in capsys.readouterr().err


def test_requests_and_duration_per_level_exclude_each_other(capsys):
    assert crossover("bench", "--target", "a=http://x", "--requests-per-level", "2", "--duration-per-level", "1") == 2
    assert "not allowed with argument" in capsys.readouterr().err


def test_a_sweep_writes_valid_results_plots_and_counts_failures_as_failures(scripted, tmp_path, capsys):
    url, _ = scripted
    out = tmp_path / "run"
    code = crossover(
        "bench",
        "--target",
        f"speculative={url}",
        "--target",
        f"plain={url}/v1",
        "--model",
        "flaky",
        "--concurrency",
        "3,1",
        "--requests-per-level",
        "6",
        "--output-len",
        "24",
        "--out",
        str(out),
    )
    assert code == 0
    run = json.loads((out / "results.json").read_text())
    jsonschema.validate(run, load_schema())
    assert [(lv["target"], lv["concurrency"]) for lv in run["levels"]] == [
        ("speculative", 1),
        ("plain", 1),
        ("speculative", 3),
        ("plain", 3),
    ]
    for lv in run["levels"]:
        # Every third request succeeds; the HTTP 503s and mid-stream error events are failures, not speed.
        assert lv["completed"] + lv["failed"] == 6 and lv["failed"] >= 3
        assert set(lv["errors"]) <= {
            "HTTP 503: 503: no healthy backend",
            "stream error event: 503: The request queue is full.",
        }
        # Counted by kind, every one, and the first of each kind kept with its message.
        assert sum(lv["error_kinds"].values()) == lv["failed"]
        assert set(lv["error_kinds"]) <= {"HTTP 503", "stream error event"}
        assert {kind: lv["first_errors"][kind] for kind in lv["error_kinds"]} == {
            kind: {"HTTP 503": "HTTP 503: 503: no healthy backend"}.get(
                kind, "stream error event: 503: The request queue is full."
            )
            for kind in lv["error_kinds"]
        }
    assert run["crossover"]["status"] != "not_computed"
    for png in ("throughput.png", "latency.png"):
        assert (out / png).read_bytes().startswith(b"\x89PNG")
    printed, progress = capsys.readouterr()
    assert "crossover evidence: plain vs speculative" in printed and "recommended threshold: switch =" in printed
    # The table and the closing lines count the failures by kind; the log explained the first of each kind.
    assert "errors: plain C=3: " in printed and "  first HTTP 503: HTTP 503: 503: no healthy backend" in printed
    assert "C=1    first HTTP 503: HTTP 503: 503: no healthy backend" in progress
    assert "C=1    first stream error event: stream error event" in progress


def test_a_target_that_fails_its_probe_stops_the_run(backend, tmp_path, capsys):
    code = crossover(
        "bench",
        "--target",
        f"speculative={backend}",
        "--model",
        "http-503",
        "--concurrency",
        "1",
        "--out",
        str(tmp_path / "run"),
        "--no-plots",
    )
    assert code == 1
    assert "probe request to speculative" in capsys.readouterr().err
    assert not (tmp_path / "run" / "results.json").exists()


def test_report_redraws_one_run_and_compares_several(scripted, tmp_path, capsys):
    url, _ = scripted
    for name in ("a", "b"):
        assert (
            crossover(
                "bench",
                "--target",
                f"speculative={url}",
                "--target",
                f"plain={url}",
                "--model",
                "ok",
                "--concurrency",
                "1,2",
                "--requests-per-level",
                "2",
                "--out",
                str(tmp_path / name),
                "--no-plots",
            )
            == 0
        )
    capsys.readouterr()
    assert crossover("bench", "report", str(tmp_path / "a")) == 0
    assert (tmp_path / "a" / "throughput.png").stat().st_size > 0
    assert crossover("bench", "report", str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(tmp_path / "cmp")) == 0
    assert (tmp_path / "cmp" / "latency.png").stat().st_size > 0
    assert "runs compared" in capsys.readouterr().out


def test_report_on_a_directory_without_results_exits_1(tmp_path, capsys):
    assert crossover("bench", "report", str(tmp_path), "--no-plots") == 1
    assert "results.json: no such file" in capsys.readouterr().err
