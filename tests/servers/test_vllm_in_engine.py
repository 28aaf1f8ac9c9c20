"""The gated vLLM profile (llama8b-vllm-in-engine; vLLM's parser reads its argv in test_vllm_parser.py): the start-up
schedule that puts both query lengths in force, dev mode for the gate's route, the gate's key in the environment -
read from its file when the server starts, never printed - and the note that the patch is needed."""

from __future__ import annotations

import json
import re

import pytest

from crossover.servers.launch import gate_schedule, launch_command
from crossover.servers.profile import ProfileError, load_profile, parse_profile
from tests.servers.conftest import SHIPPED, run_cli


def test_the_gated_server_starts_with_both_query_lengths_in_force_and_dev_mode():
    profile = load_profile("llama8b-vllm-in-engine")
    server = profile.servers[0]
    command = launch_command(profile, server)
    config = json.loads(command.server_args[command.server_args.index("--speculative-config") + 1])
    assert config["num_speculative_tokens_per_batch_size"] == [[1, 255, 3], [256, 256, 0]]
    assert gate_schedule(2, 5) == [[1, 1, 5], [2, 2, 0]]
    assert command.env["VLLM_SERVER_DEV_MODE"] == "1"
    assert command.env["VLLM_SPECULATION_GATE_ADMIN_KEY"] == "<from /etc/crossover/vllm-gate.key>"
    assert server.host == "127.0.0.1"  # the dev routes stay off the network
    assert profile.needs_patch == ["vllm"]


def test_the_gate_key_is_read_when_it_starts_and_never_printed(tmp_path):
    key_file = tmp_path / "gate.key"
    key_file.write_text("k-never-printed\n")
    text = (SHIPPED / "llama8b-vllm-in-engine.toml").read_text().replace("/etc/crossover/vllm-gate.key", str(key_file))
    path = tmp_path / "gated.toml"
    path.write_text(text)
    profile = parse_profile(text, name="gated", source="test")
    command = launch_command(profile, profile.servers[0])
    assert command.run_env()["VLLM_SPECULATION_GATE_ADMIN_KEY"] == "k-never-printed"
    assert "k-never-printed" not in " ".join(command.run_argv())
    shown = run_cli("plan", str(path), "--no-fit-check")
    as_json = run_cli("plan", str(path), "--no-fit-check", "--json")
    assert f"VLLM_SPECULATION_GATE_ADMIN_KEY=<from {key_file}>" in shown.stdout
    assert "needs vLLM patched with patches/vllm-0.32.0" in shown.stderr
    assert "k-never-printed" not in shown.stdout + shown.stderr + as_json.stdout + as_json.stderr


def test_a_gated_vllm_server_states_a_running_cap_of_two_or_more():
    text = (SHIPPED / "llama8b-vllm-in-engine.toml").read_text()
    for cap in ("", "max_running_requests = 1"):
        changed = re.sub(r"^max_running_requests = .*$", cap, text, flags=re.MULTILINE)
        with pytest.raises(ProfileError, match="max_running_requests >= 2"):
            parse_profile(changed, name="no-cap", source="test")
