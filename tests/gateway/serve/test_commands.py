"""`crossover serve`: starts from a file, stops on SIGTERM, and refuses bad settings by naming the field."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import httpx
import pytest

from crossover.gateway.cli import build_parser
from tests.gateway.gateway_helpers import chat


def refused_serve(config, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`crossover serve --config CONFIG` that is expected to stop at once (bounded all the same)."""
    argv = [sys.executable, "-m", "crossover.gateway.cli", "serve", "--config", str(config)]
    return subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False, env=env)


def test_serve_runs_a_config_file_and_stops_on_sigterm(sims, gateway_process):
    speculative, plain = sims
    gw = gateway_process(
        f'admin_token = "t"\n[pools.speculative]\nbackends = ["{speculative.url}"]\n'
        f'[pools.plain]\nbackends = ["{plain.url}"]\n'
    )
    response = httpx.post(gw.url + "/v1/chat/completions", json=chat(), timeout=10, trust_env=False)
    assert response.status_code == 200 and response.headers["x-crossover-pool"] == "speculative"
    os.killpg(gw.proc.pid, signal.SIGTERM)
    # uvicorn shuts down gracefully, then re-raises the signal so the exit status tells it was stopped.
    assert gw.proc.wait(30) in (0, -signal.SIGTERM)


def test_serve_refuses_bad_settings_naming_the_field(tmp_path):
    config = tmp_path / "bad.toml"
    config.write_text('threshold = -3\n[pools.speculative]\nbackends = ["ftp://x"]\n[pools.plain]\nbackends = []\n')
    result = refused_serve(config)
    assert result.returncode == 2
    for field in ("threshold", "pools.speculative.backends", "pools.plain.backends"):
        assert f" {field}: " in result.stderr, result.stderr
    assert "Traceback" not in result.stderr


def test_environment_overrides_the_file(sims, gateway_process, tmp_path):
    speculative, plain = sims
    pools = f'[pools.speculative]\nbackends = ["{speculative.url}"]\n[pools.plain]\nbackends = ["{plain.url}"]\n'
    gw = gateway_process("threshold = 10\n" + pools, env={"CROSSOVER_THRESHOLD": "6", "CROSSOVER_ADMIN_TOKEN": "t"})
    state = httpx.get(gw.url + "/admin/threshold", headers={"authorization": "Bearer t"}, timeout=10).json()
    assert state["threshold"] == 6

    config = tmp_path / "ok.toml"
    config.write_text(pools)
    result = refused_serve(config, env={**os.environ, "CROSSOVER_TIMEOUTS__CONNECT": "-1"})
    assert result.returncode == 2 and " timeouts.connect (from $CROSSOVER_TIMEOUTS__CONNECT): " in result.stderr, (
        result.stderr
    )


def test_command_line_shapes():
    parser = build_parser()
    serve = parser.parse_args(["serve", "--config", "c.toml", "--port", "9000"])
    assert serve.port == 9000 and str(serve.config) == "c.toml" and callable(serve.run)
    workers = parser.parse_args(["serve", "--workers", "4", "--worker-timeout", "2.5"])
    assert (workers.workers, workers.worker_timeout) == (4, 2.5)
    for refused in ("0.5", "0", "inf", "x"):  # a timeout below a busy loop's beat would kill healthy workers
        with pytest.raises(SystemExit):
            parser.parse_args(["serve", "--worker-timeout", refused])
    demo = parser.parse_args(["demo", "--policy", "switch", "--threshold", "8", "--time-scale", "5"])
    assert (demo.port, demo.policy, demo.threshold, demo.time_scale, demo.admin_token) == (8000, "switch", 8, 5.0, None)


def test_serve_refuses_credentials_in_a_backend_url_and_blank_tokens(tmp_path):
    """A password in a URL would never be sent (the pool's api_key is) and would be published on /metrics and
    /admin/state; a blank token can match nothing. Both stop the start, naming the field - and no secret."""
    config = tmp_path / "bad.toml"
    config.write_text(
        'admin_token = " "\napi_keys = ["\\t"]\n[pools.speculative]\nbackends = ["http://admin:hunter2@127.0.0.1:1"]\n'
        '[pools.plain]\nbackends = ["http://127.0.0.1:2"]\napi_key = " sk-1"\n'
    )
    result = refused_serve(config)
    assert result.returncode == 2, result.stderr
    assert " pools.speculative.backends: " in result.stderr and "api_key" in result.stderr
    for field in ("admin_token", "api_keys", "pools.plain.api_key"):
        assert f" {field}: " in result.stderr, result.stderr
    assert "hunter2" not in result.stderr and "Traceback" not in result.stderr
