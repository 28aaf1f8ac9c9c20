"""The `crossover` CLI as a user meets its errors: bad paths, a port in use, bad TOML, nothing configured. Each is
one line on stderr that names the problem and what to do, and a non-zero exit - never a traceback."""

from __future__ import annotations

import os
import signal
import socket
import subprocess

import pytest

from crossover.gateway.cli import listen_error
from tests.conftest import crossover_argv
from tests.waiting import WAIT_S, wait_until

POOLS = '[pools.speculative]\nbackends = ["http://127.0.0.1:1"]\n[pools.plain]\nbackends = ["http://127.0.0.1:2"]\n'


@pytest.fixture
def taken():
    """A port something listens on."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        yield listener.getsockname()[1]


def test_listen_error_names_a_port_in_use_and_passes_a_free_one(taken):
    assert listen_error("127.0.0.1", taken) == (
        f"127.0.0.1:{taken} is already in use: stop what listens there, or pass another --port"
    )
    with socket.create_server(("127.0.0.1", 0)) as listener:
        free = listener.getsockname()[1]
    assert listen_error("127.0.0.1", free) is None
    assert listen_error("127.0.0.1", 0) is None  # any port: nothing to check
    assert listen_error("no-such-host.invalid", 8000).startswith("cannot listen on no-such-host.invalid: ")


def run(*argv: str, **env: str) -> subprocess.CompletedProcess:
    # No CROSSOVER_* from the machine running the tests: `serve` with no config must see nothing configured.
    clean = {name: value for name, value in os.environ.items() if not name.upper().startswith("CROSSOVER_")}
    return subprocess.run(
        crossover_argv(*argv), capture_output=True, text=True, timeout=120, check=False, env={**clean, **env}
    )


def one_line(result: subprocess.CompletedProcess) -> str:
    assert result.returncode != 0, result
    assert result.stderr.count("\n") == 1 and result.stderr.endswith("\n"), result.stderr
    assert "Traceback" not in result.stderr
    return result.stderr


def test_a_missing_python_for_the_patches_is_one_line():
    # The README's line on a machine without that interpreter.
    for command in ("check", "apply"):
        error = one_line(run("patches", command, "--python", "/opt/sglang/bin/python"))
        assert error.startswith("error: cannot run --python /opt/sglang/bin/python (No such file or directory): ")
        assert "--sglang PATH" in error


@pytest.mark.parametrize(
    "argv",
    [
        ("demo", "--port", "{port}"),
        ("demo", "--port", "{port}", "--topology", "time-shared", "--mechanism", "restart"),
        ("serve", "--config", "{config}", "--port", "{port}"),
        ("sim", "serve", "--profile", "k25-plain", "--port", "{port}"),
        ("servers", "agent", "standin-time-shared", "--port", "{port}"),
    ],
    ids=lambda argv: " ".join(argv[:2]) + (" time-shared" if "time-shared" in argv else ""),
)
def test_a_port_in_use_is_one_line_before_anything_starts(argv, taken, tmp_path):
    config = tmp_path / "gateway.toml"
    config.write_text(POOLS)
    filled = [part.format(port=taken, config=config) for part in argv]
    error = one_line(run(*filled, CROSSOVER_AGENT_TOKEN="t"))
    assert f"127.0.0.1:{taken} is already in use: stop what listens there, or pass another --port" in error
    assert "crossover sim: SIMULATED" not in error  # the demo refused before it started a stand-in


def test_serve_with_nothing_configured_says_what_to_pass():
    error = one_line(run("serve"))
    assert error.startswith("crossover serve: no --config FILE given (every setting, commented: gateway/example.toml")
    assert error.endswith("the CROSSOVER_* environment alone is not enough: pools: Field required\n")
    assert "in settings" not in error


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (None, "cannot read config file {config}: No such file or directory"),
        ("pools = [", "{config} is not valid TOML: "),
        ('threshold = "x"\nbogus = 1\n' + POOLS, "invalid settings in {config}: threshold: "),
    ],
    ids=["missing", "bad TOML", "two problems"],
)
def test_serve_with_a_bad_config_file_is_one_line(text, expected, tmp_path):
    config = tmp_path / "gateway.toml"
    if text is not None:
        config.write_text(text)
    error = one_line(run("serve", "--config", str(config)))
    assert error.startswith("crossover serve: " + expected.format(config=config)), error
    if text and "bogus" in text:
        assert "; bogus: unknown key" in error


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (("servers", "up", "/no/such/profile.toml"), "crossover servers: error: /no/such/profile.toml: cannot read"),
        (("sim", "serve", "--profile", "no-such", "--port", "0"), "crossover sim: error: no profile named 'no-such'"),
        (("bench", "report", "/no/such/run"), "crossover bench report: /no/such/run"),
        (("bench", "--target", "a=http://127.0.0.1:1", "--out", "/proc/no/such"), "crossover bench: cannot use --out"),
    ],
    ids=lambda value: value[0] if isinstance(value, tuple) else None,
)
def test_bad_paths_are_one_line(argv, expected):
    assert one_line(run(*argv)).startswith(expected)


def test_ctrl_c_in_a_bench_is_one_line_saying_what_was_kept(sim, tmp_path):
    standin = sim("k25-plain", "--time-scale", "20", "--log-level", "warning")
    out = tmp_path / "run"
    # Levels of 4 s: once the first is written, four more are left to interrupt.
    argv = ["bench", "--target", f"plain={standin.url}", "--concurrency", "1,2,3,4,5", "--duration-per-level", "4"]
    bench = subprocess.Popen(
        crossover_argv(*argv, "--no-plots", "--out", str(out)),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_until((out / "results.json").exists, timeout=WAIT_S * 10, what="the first level")
        bench.send_signal(signal.SIGINT)
        _, err = bench.communicate(timeout=60)
    finally:
        bench.kill()
    assert bench.returncode == 130
    assert err.splitlines()[-1] == f"crossover bench: interrupted; the levels done are in {out / 'results.json'}"
    assert "Traceback" not in err
