"""Every argv a shipped profile generates for a vLLM server is accepted by vLLM 0.32's own argument parser
(`make_arg_parser`, `validate_parsed_serve_args`), and reads as the values meant.

vLLM runs in its own CPU venv (`.venv-vllm`, the real-vLLM tests'; the `vllm_python` fixture in conftest.py
skips locally without it and fails in CI).
"""

from __future__ import annotations

import json

import pytest

from crossover.servers.launch import launch_command
from crossover.servers.profile import ProfileError, load_profile, parse_profile, shipped_profiles
from crossover.servers.vllm_check import parse, parse_errors
from tests.servers.conftest import SHIPPED, read_by_engine


def vllm_servers():
    profiles = [load_profile(name) for name in shipped_profiles()]
    return [(profile, server) for profile in profiles for server in profile.servers if server.engine == "vllm"]


def test_a_llama_8b_vllm_profile_ships_beside_the_sglang_one():
    assert {"llama8b-partitioned", "llama8b-vllm-partitioned", "llama8b-vllm-in-engine"} <= set(shipped_profiles())
    assert len(vllm_servers()) == 3


def test_vllm_accepts_every_shipped_argv_and_reads_the_values_meant(vllm_python):
    for profile, server, read in read_by_engine(parse, vllm_python, "vllm"):
        assert (read["model"], read["port"], read["host"]) == (server.model_path, server.port, server.host)
        assert read["served_model_name"] == [server.served_model_name]
        assert (read["tensor_parallel_size"], read["max_num_seqs"]) == (server.tp_size, server.max_running_requests)
        assert read["gpu_memory_utilization"] == server.mem_fraction_static
        assert read["enable_sleep_mode"] == profile.sleeps
        spec = server.speculative
        if spec is None:
            assert read["speculative_config"] is None
        else:
            expected = {"method": "eagle3", "model": spec.draft_model_path, "num_speculative_tokens": spec.num_steps}
            if profile.topology == "in-engine":  # the schedule the gate moves within: K below the cap, 0 at it
                cap = server.max_running_requests
                expected["num_speculative_tokens_per_batch_size"] = [[1, cap - 1, spec.num_steps], [cap, cap, 0]]
            assert read["speculative_config"] == expected


def test_vllm_s_parser_refuses_what_it_does_not_know(vllm_python):
    profile = load_profile("llama8b-vllm-partitioned")
    good = launch_command(profile, profile.server("plain")).server_args
    unknown_method = [*good, "--speculative-config", json.dumps({"method": "eagle9", "model": "d"})]
    unknown_key = [*good, "--speculative-config", json.dumps({"method": "eagle3", "model": "d", "steps": 3})]
    errors = parse_errors(vllm_python, [good, [*good, "--cuda-graph-max-bs-decode", "8"], unknown_method, unknown_key])
    assert errors[0] is None
    assert "unrecognized arguments" in errors[1] or "--cuda-graph-max-bs-decode" in errors[1]
    assert "eagle9" in errors[2] and "steps" in errors[3]


def sleep_profile(device: str) -> str:
    text = (SHIPPED / "llama8b-vllm-partitioned.toml").read_text().replace('"partitioned"', '"time-shared"', 1)
    text += '\n[time_shared]\nmechanism = "sleep"\ninitial = "speculative"\n'
    if device == "cpu":
        text = text.replace("gpus = [0, 1, 2, 3]", 'device = "cpu"').replace("gpus = [4, 5, 6, 7]", 'device = "cpu"')
        text = text.replace("tp_size = 4", "tp_size = 1")
    return text


def test_sleep_on_vllm_turns_on_sleep_mode_and_its_endpoints_and_is_refused_on_a_cpu_build():
    profile = parse_profile(sleep_profile("cuda"), name="vllm-sleep", source="test")
    command = launch_command(profile, profile.server("plain"))
    assert "--enable-sleep-mode" in command.server_args and command.env["VLLM_SERVER_DEV_MODE"] == "1"
    with pytest.raises(ProfileError, match="mechanism 'restart'") as caught:
        parse_profile(sleep_profile("cpu"), name="vllm-sleep-cpu", source="test")
    assert "CPU build" in str(caught.value)
    restart = sleep_profile("cpu").replace('mechanism = "sleep"', 'mechanism = "restart"')
    profile = parse_profile(restart, name="vllm-restart-cpu", source="test")
    assert "--enable-sleep-mode" not in launch_command(profile, profile.server("plain")).server_args
