"""`crossover sim ...` as a user runs it (subprocesses of the real CLI)."""

import json
import os
import signal
import subprocess
import sys

import httpx
import pytest

CLI_TIMEOUT_S = 60


def crossover(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "crossover.gateway.cli", *args],
        capture_output=True,
        text=True,
        timeout=CLI_TIMEOUT_S,
        check=False,
    )


def test_curve_json_is_the_documented_list():
    done = crossover(
        "sim", "curve", "--profile", "k25-eagle3", "--output-len", "512", "--concurrency", "1,70,250", "--json"
    )
    assert done.returncode == 0, done.stderr
    points = json.loads(done.stdout)
    assert [p["concurrency"] for p in points] == [1, 70, 250]
    for p in points:
        assert {"concurrency", "output_throughput", "per_request_throughput", "mean_ttft_s"} <= set(p)
    one, seventy, many = (p["output_throughput"] for p in points)
    assert one == pytest.approx(96.1, rel=0.10)
    assert seventy == pytest.approx(340, rel=0.10) and many == pytest.approx(340, rel=0.10)


def test_curve_table_and_steps():
    table = crossover("sim", "curve", "--profile", "k25-plain", "--concurrency", "1,2", "--output-len", "64")
    assert table.returncode == 0 and "per-request tok/s" in table.stdout and "mean TTFT s" in table.stdout
    steps = crossover("sim", "steps", "--profile", "llama8b-h200-plain", "--batch", "1,64,256", "--json")
    assert steps.returncode == 0, steps.stderr
    assert [round(p["output_throughput"]) for p in json.loads(steps.stdout)] == [183, 8333, 14066]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["sim", "curve", "--profile", "nope"], "no profile named 'nope'"),
        (["sim", "curve", "--profile", "k25-plain", "--accept-length", "2"], "not speculative"),
        (["sim", "curve", "--profile", "k25-plain", "--output-len", "1"], "output_len >= 2"),
        (["sim", "curve", "--profile", "k25-plain", "--concurrency", "0,2"], "positive integers"),
        (["sim", "serve", "--profile", "k25-plain", "--port", "1", "--time-scale", "0"], "must be a finite number > 0"),
        (["sim", "serve", "--profile", "k25-plain", "--port", "1", "--extra-metric-labels", "[1]"], "JSON object"),
        (
            ["sim", "serve", "--profile", "k25-plain", "--port", "1", "--release-delay", "-1"],
            "must be a finite number >= 0",
        ),
        (["sim", "serve", "--profile", "k25-plain", "--port", "70000"], "not a TCP port"),
        (
            ["sim", "serve", "--profile", "k25-plain", "--port", "1", "--admin-api-key-file", "/nonexistent/k"],
            "admin_api_key_file /nonexistent/k cannot be read: No such file or directory",
        ),
    ],
)
def test_bad_arguments_fail_clearly(args, message):
    done = crossover(*args)
    assert done.returncode == 2 and message in done.stderr


def results_file(tmp_path, concurrencies: tuple[int, ...]):
    """A `crossover bench` results.json of one plain target, TPOT growing with concurrency."""
    levels = [
        {"target": "plain", "concurrency": c, "completed": 5, "mean_ttft_ms": 200.0, "mean_tpot_ms": 20.0 * c}
        for c in concurrencies
    ]
    path = tmp_path / "results.json"
    path.write_text(json.dumps({"schema_version": 1, "metadata": {"model": "real/model"}, "levels": levels}))
    return path


def test_serve_says_it_is_a_simulator_and_replays_a_results_file(tmp_path):
    results = results_file(tmp_path, (1, 4))
    serve = ["sim", "serve", "--profile", str(results), "--target", "plain", "--port", "0", "--time-scale", "100"]
    with open(os.devnull, "wb") as devnull:
        proc = subprocess.Popen(
            [sys.executable, "-m", "crossover.gateway.cli", *serve],
            stdout=devnull,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
    try:
        banner = proc.stderr.readline()
        assert "SIMULATED SGLang server" in banner and "no model runs" in banner and "results:plain" in banner
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(10)


def test_measured_profile_serves_its_model(sim, tmp_path):
    server = sim(str(results_file(tmp_path, (1,))), "--time-scale", "100")
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 20}
    with httpx.Client(timeout=10.0) as client:
        assert client.get(f"{server.url}/v1/models").json()["data"][0]["id"] == "real/model"
        answer = client.post(f"{server.url}/v1/chat/completions", json=body).json()
        assert answer["usage"]["completion_tokens"] == 20
        assert client.get(f"{server.url}/server_info").json()["simulator"]["kind"] == "measured"


def test_serve_takes_switch_costs_from_the_profile_or_the_flags(sim):
    # The `sim` fixture passes --startup-delay 0; release and resume: one from a flag, one from the profile.
    server = sim("k25-eagle3", "--time-scale", "1000", "--release-delay", "0.01")
    info = httpx.get(server.url + "/server_info", timeout=10.0).json()
    assert info["simulator"]["delays_s"] == {"startup": 0.0, "release": 0.01, "resume": 25.0 / 1000}
    assert info["schedule"]["time_scale"] == 1000.0 and info["memory"]["released"] == []
