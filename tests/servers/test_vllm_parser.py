"""Every argv a shipped profile generates for a vLLM server is accepted by vLLM 0.32's own argument parser (`vllm
serve`'s: the CLI's serve subcommand and its validation), and reads as the values meant.

vLLM runs in its own CPU venv (`.venv-vllm`, the real-vLLM tests'; the `vllm_python` fixture in conftest.py
skips locally without it and fails in CI).
"""

from __future__ import annotations

import json

import pytest

from crossover.gateway.engines.vllm import DEV_MODE_ENV
from crossover.servers.launch import launch_command
from crossover.servers.profile import (
    LOOPBACK_HOSTS,
    SUPPORTED_VLLM,
    ProfileError,
    load_profile,
    parse_profile,
    shipped_profiles,
)
from crossover.servers.vllm_check import parse, parse_errors
from tests.servers.conftest import SHIPPED, read_by_engine, run_cli


def vllm_servers():
    profiles = [load_profile(name) for name in shipped_profiles()]
    return [(profile, server) for profile in profiles for server in profile.servers if server.engine == "vllm"]


def test_a_llama_8b_vllm_profile_ships_beside_the_sglang_one():
    shipped = {"llama8b-partitioned", "llama8b-vllm-partitioned", "llama8b-vllm-time-shared", "llama8b-vllm-in-engine"}
    assert shipped <= set(shipped_profiles())
    assert len(vllm_servers()) == 5


def test_gpu_profiles_run_vllm_serve_with_the_model_first_pinned_to_a_checked_release():
    for profile, server in vllm_servers():
        command = launch_command(profile, server)
        # `vllm serve MODEL`: the module `vllm.entrypoints.openai.api_server` is deprecated (0.32 and 0.34 warn).
        assert command.argv[:3] == ["vllm", "serve", server.model_path], command.argv
        assert "--model" not in command.server_args
        assert profile.vllm_version in SUPPORTED_VLLM
        assert "--disable-log-stats" not in command.server_args


def test_plan_names_the_pinned_release_and_says_why_dev_mode_stays_on_loopback():
    plan = run_cli("plan", "llama8b-vllm-time-shared", "--no-fit-check")
    assert plan.returncode == 0, plan.stderr
    assert "topology time-shared, vLLM 0.34.0, switch by sleep" in plan.stdout
    assert "--host 127.0.0.1" in plan.stdout and "VLLM_SERVER_DEV_MODE=1" in plan.stdout
    assert "/collective_rpc, /pause, /resume and more with no authentication" in plan.stderr
    assert "these servers listen on loopback only" in plan.stderr and "through the agent" in plan.stderr
    partitioned = run_cli("plan", "llama8b-vllm-partitioned", "--no-fit-check")
    assert "VLLM_SERVER_DEV_MODE" not in partitioned.stdout and "loopback" not in partitioned.stderr


def test_vllm_accepts_every_shipped_argv_and_reads_the_values_meant(vllm_python):
    for profile, server, read in read_by_engine(parse, vllm_python, "vllm"):
        assert (read["model"], read["port"], read["host"]) == (server.model_path, server.port, server.host)
        assert read["served_model_name"] == [server.served_model_name]
        assert (read["tensor_parallel_size"], read["max_num_seqs"]) == (server.tp_size, server.max_running_requests)
        assert read["gpu_memory_utilization"] == server.mem_fraction_static
        assert read["enable_sleep_mode"] == profile.sleeps
        # A full server answers 503 busy (the gateway fails over); the load gauges stay on.
        assert server.max_queued_requests is not None
        assert read["max_num_queued_reqs"] == server.max_queued_requests
        assert read["disable_log_stats"] is False
        # Dev mode (sleep's routes, and /collective_rpc, /pause, ... unauthenticated) only on loopback.
        if launch_command(profile, server).env.get(DEV_MODE_ENV) == "1":
            assert read["host"] in LOOPBACK_HOSTS, (profile.name, server.name)
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
    # The deprecated module's form (what a CPU build runs): flags only, the model as --model.
    module_form = ["--model", "m", "--max-num-queued-reqs", "4", "--bogus"]
    argvs = [good, [*good, "--cuda-graph-max-bs-decode", "8"], unknown_method, unknown_key, module_form]
    errors = parse_errors(vllm_python, [*argvs, module_form[:-1]])
    assert errors[0] is None
    assert "unrecognized arguments" in errors[1] or "--cuda-graph-max-bs-decode" in errors[1]
    assert "eagle9" in errors[2] and "steps" in errors[3]
    assert "--bogus" in errors[4] and errors[5] is None


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
