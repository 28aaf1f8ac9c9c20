"""The in-engine profiles: kimi-k25-in-engine (its argv is checked by SGLang's parser with every shipped profile in
test_sglang_parser.py; here its slot config with SGLang's own loader) and standin-in-engine, which comes up with
`crossover servers up`, is served by `crossover serve` with the shipped gateway config, and routes."""

from __future__ import annotations

import contextlib
import json
import re
import subprocess
import tomllib
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from crossover.loadtest.models import Results
from crossover.servers.demo import gateway_config_path
from crossover.servers.process import free_port, spawn, stop, wait_ready
from crossover.servers.profile import ProfileError, load_profile, parse_profile
from crossover.servers.sglang_check import load_adaptive_config
from crossover.servers.sim.profile import load_profile as load_sim_profile
from crossover.servers.sim.replay import zero_step_gate
from tests.conftest import crossover_argv
from tests.loadtest.test_bench import crossover_cli
from tests.servers.conftest import ROOT, SHIPPED, recorded_groups, run_cli

READY_S = 60.0


def test_the_kimi_slots_capture_zero_and_the_speculative_steps_at_every_batch_size(sglang_python):
    profile = load_profile("kimi-k25-in-engine")
    server = profile.servers[0]
    slots = load_adaptive_config(sglang_python, SHIPPED / "kimi-k25-in-engine.slots.json")
    # One slot from batch 1 up: every step it lists is captured for every CUDA-graph size up to the cap.
    assert list(slots) == ["1"]
    assert {0, server.speculative.num_steps} <= set(slots["1"])
    assert server.max_running_requests == server.cuda_graph_max_bs_decode == 256
    assert server.speculative.adaptive_config.endswith("kimi-k25-in-engine.slots.json")
    assert profile.needs_patch


def test_an_in_engine_server_states_its_running_cap():
    text = (SHIPPED / "kimi-k25-in-engine.toml").read_text()
    text = re.sub(r"^max_running_requests = .*$", "", text, flags=re.MULTILINE)
    with pytest.raises(ProfileError, match="set max_running_requests"):
        parse_profile(text, name="no-cap", source="test")


def test_plan_says_the_profile_needs_the_patch_and_whether_sglang_has_it(sglang_python):
    result = run_cli("plan", "kimi-k25-in-engine", "--no-fit-check", "--sglang-python", str(sglang_python))
    assert "needs SGLang patched with patches/sglang-0.5.23" in result.stderr
    assert "patches not applied" in result.stderr  # the venv's SGLang is the release
    assert result.returncode == 1
    standin = run_cli("plan", "standin-in-engine", "--no-fit-check")
    assert standin.returncode == 0 and "--speculation-gate" in standin.stdout and "needs SGLang" not in standin.stderr


def test_plan_shows_the_admin_key_file_never_a_key(tmp_path):
    key_file = tmp_path / "admin.key"
    key_file.write_text("k-never-printed\n")
    text = (SHIPPED / "kimi-k25-in-engine.toml").read_text().replace("/etc/crossover/sglang-admin.key", str(key_file))
    profile = tmp_path / "kimi.toml"
    profile.write_text(text)
    shown = run_cli("plan", str(profile), "--no-fit-check")
    as_json = run_cli("plan", str(profile), "--no-fit-check", "--json")
    assert f"--admin-api-key '<from {key_file}>'" in shown.stdout
    assert f"<from {key_file}>" in json.loads(as_json.stdout)[0]["argv"]
    assert "k-never-printed" not in shown.stdout + shown.stderr + as_json.stdout + as_json.stderr
    shipped = run_cli("plan", "kimi-k25-in-engine", "--no-fit-check")
    assert "--admin-api-key '<from /etc/crossover/sglang-admin.key>'" in shipped.stdout


def test_up_with_a_missing_admin_key_file_says_so_in_one_line_and_starts_nothing(standin_profile, state_dir):
    path = standin_profile("standin-in-engine", admin_api_key_file="/nonexistent/admin.key")
    up = run_cli("up", str(path), "--state-dir", str(state_dir))
    assert up.returncode == 1
    errors = [line for line in up.stderr.splitlines() if "error" in line]
    assert errors == [
        "crossover servers: error: gated-a: admin_api_key_file /nonexistent/admin.key cannot be read: "
        "No such file or directory"
    ]
    assert recorded_groups(state_dir) == {}


# The shipped demo key, by absolute path: the shipped files name it relative to the repository root.
KEY_FILE = ROOT / "servers" / "profiles" / "standin-in-engine.admin.key"


def shipped_gateway_config(tmp_path, urls: list[str]) -> tuple[Path, int]:
    """The shipped gateway config of standin-in-engine, in front of `urls` on a free port: (its path, the port)."""
    config = gateway_config_path("standin-in-engine").read_text()
    assert 'admin_api_key_file = "servers/profiles/standin-in-engine.admin.key"' in config
    config = config.replace('"servers/profiles/standin-in-engine.admin.key"', json.dumps(str(KEY_FILE)))
    config = re.sub(r"^backends = .*$", f"backends = {urls!r}".replace("'", '"'), config, flags=re.MULTILINE)
    gateway_port = free_port()
    config = re.sub(r"^port = \d+", f"port = {gateway_port}", config, flags=re.MULTILINE)
    config_path = tmp_path / "gateway.toml"
    config_path.write_text(config)
    return config_path, gateway_port


@contextlib.contextmanager
def shipped_topology(standin_profile, state_dir, tmp_path, *, behind_gateway: int, **changes) -> Iterator[tuple]:
    """standin-in-engine up (with `changes`), the shipped gateway in front of its first `behind_gateway` servers:
    yields (the servers' URLs, the gateway's URL); then everything down."""
    path = standin_profile("standin-in-engine", admin_api_key_file=str(KEY_FILE), **changes)
    urls = [s.url for s in load_profile(path).servers]
    config_path, gateway_port = shipped_gateway_config(tmp_path, urls[:behind_gateway])
    up = run_cli("up", str(path), "--state-dir", str(state_dir))
    assert up.returncode == 0, up.stderr
    gateway = spawn(crossover_argv("serve", "--config", str(config_path)), die_with_parent=False)
    try:
        url = f"http://127.0.0.1:{gateway_port}"
        wait_ready(url + "/health", gateway, READY_S)
        yield urls, url
    finally:
        stop([gateway])
        down = run_cli("down", str(path), "--state-dir", str(state_dir))
    assert down.returncode == 0, down.stderr


def test_the_standin_topology_comes_up_and_routes(standin_profile, state_dir, tmp_path):
    with shipped_topology(standin_profile, state_dir, tmp_path, behind_gateway=2) as (urls, url):
        for backend in urls:
            gate = httpx.get(backend + "/speculative/adaptive", timeout=10).json()["state"]
            assert gate["zero_steps_above_bs"] == 256  # the config's threshold, set by the gateway at start
            # ... with the admin key: the stand-ins refuse the gate's POST without it.
            for headers in ({}, {"Authorization": "Bearer not-the-key"}):
                refused = httpx.post(
                    backend + "/speculative/adaptive", json={"zero_steps_above_bs": 0}, headers=headers, timeout=10
                )
                assert refused.status_code == 401, refused.text
            after = httpx.get(backend + "/speculative/adaptive", timeout=10).json()["state"]
            assert after["zero_steps_above_bs"] == 256
        # The README's snippet, as it stands (but for the port).
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=30)
        reply = client.chat.completions.create(
            model="moonshotai/Kimi-K2.5", messages=[{"role": "user", "content": "Hi"}]
        )
        assert reply.choices[0].message.content


def test_the_gateway_refuses_unpatched_backends_at_start(tmp_path, sim):
    plain_eagle = sim("k25-eagle3")  # no --speculation-gate
    port = free_port()
    config = tmp_path / "gateway.toml"
    config.write_text(f'port = {port}\ntopology = "in-engine"\n[pools.speculative]\nbackends = ["{plain_eagle.url}"]\n')
    result = subprocess.run(
        crossover_argv("serve", "--config", str(config)), capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode != 0
    assert "patches/sglang-0.5.23" in result.stderr and "crossover patches apply" in result.stderr


def test_the_shipped_gate_is_the_one_the_model_says_pays():
    # zero_step_gate(k25-eagle3) is None: speculation out-yields a zero-step step at every batch size, so the
    # shipped configs set no gate that engages - the threshold is the running cap, and no batch is above it.
    assert zero_step_gate(load_sim_profile("k25-eagle3"), 512) is None
    config = tomllib.loads(gateway_config_path("standin-in-engine").read_text())
    for name in ("standin-in-engine", "kimi-k25-in-engine"):
        servers = load_profile(name).servers
        assert all(config["threshold"] >= server.max_running_requests for server in servers), name
        assert {server.served_model_name for server in servers} == {"moonshotai/Kimi-K2.5"}, name
    assert config["served_model_names"] == ["moonshotai/Kimi-K2.5"]
    assert "zero_step_gate(k25-eagle3)" in gateway_config_path("standin-in-engine").read_text()


def test_the_shipped_gate_is_not_slower_than_no_gate(standin_profile, state_dir, tmp_path):
    # The shipped config (gateway + gate 256) against the same stand-in ungated: one stand-in per target, so neither
    # shares an engine; at time scale 1 (k25's steps of tens of milliseconds) a busy machine keeps them on schedule.
    topology = shipped_topology(standin_profile, state_dir, tmp_path, behind_gateway=1, time_scale=1)
    with topology as ((gated, ungated), url):
        admin = {"Authorization": f"Bearer {KEY_FILE.read_text().strip()}"}
        removed = httpx.post(
            ungated + "/speculative/adaptive", json={"zero_steps_above_bs": None}, headers=admin, timeout=10
        )
        assert removed.status_code == 200, removed.text
        assert httpx.get(ungated + "/speculative/adaptive", timeout=10).json()["state"]["zero_steps_above_bs"] is None
        assert httpx.get(gated + "/speculative/adaptive", timeout=10).json()["state"]["zero_steps_above_bs"] == 256

        out = tmp_path / "bench"
        # Speculative (ungated) against plain (the shipped gate): "speculative" ahead at a level is the gate costing.
        done = crossover_cli(
            "bench",
            *("--target", f"ungated={ungated}", "--target", f"shipped={url}"),
            *("--speculative", "ungated", "--plain", "shipped", "--concurrency", "1,8", "--out", str(out)),
            *("--duration-per-level", "3", "--warmup-rounds", "1", "--output-len", "16", "--input-len", "16"),
            "--no-plots",
        )
        assert done.returncode == 0, done.stdout + done.stderr

    run = Results.model_validate_json((out / "results.json").read_text())
    levels = {(lv.target, lv.concurrency): lv for lv in run.levels}
    assert set(levels) == {(t, c) for t in ("ungated", "shipped") for c in (1, 8)}
    assert all(lv.completed > 0 and lv.failed == 0 for lv in run.levels)
    for c in (1, 8):
        shipped, ungated_level = levels["shipped", c], levels["ungated", c]
        assert shipped.output_throughput_interval and ungated_level.output_throughput_interval
        # Not slower: the shipped target's interval reaches the ungated one's (it is not below it as a whole).
        assert shipped.output_throughput_interval[1] >= ungated_level.output_throughput_interval[0], (c, done.stdout)
    # ... and the bench's own verdict (combined intervals) never has the ungated target clearly ahead.
    assert {e.concurrency for e in run.crossover.evidence} == {1, 8}
    assert all(e.verdict != "speculative" for e in run.crossover.evidence), done.stdout
