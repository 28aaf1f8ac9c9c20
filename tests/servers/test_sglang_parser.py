"""Every argv a shipped profile generates is accepted by SGLang 0.5.23's own argument parser, and the
adaptive config `crossover servers adaptive-config` writes loads with SGLang's own loader.

SGLang runs in a separate CPU-only venv (`.venv-sglang`, built by .ci/run; the
`sglang_python` fixture in conftest.py skips locally without it and fails in CI).
"""

from __future__ import annotations

import argparse

import pytest

from crossover.gateway.cli import build_parser
from crossover.servers.launch import admin_key_placeholder, launch_commands, sim_command
from crossover.servers.profile import load_profile, parse_profile, shipped_profiles
from crossover.servers.sglang_check import parse, parse_errors
from tests.servers.conftest import SHIPPED, read_by_engine


def sglang_commands():
    return [
        pytest.param(command, id=f"{name}:{command.name}")
        for name in shipped_profiles()
        for command in launch_commands(load_profile(name))
        if load_profile(name).server(command.name).engine == "sglang"
    ]


def test_every_real_profile_has_sglang_servers():
    assert {"kimi-k25-time-shared", "kimi-k25-adaptive", "llama8b-partitioned"} <= set(shipped_profiles())
    assert len(sglang_commands()) == 6


def test_sglang_accepts_every_shipped_argv_and_reads_the_values_meant(sglang_python):
    for profile, server, read in read_by_engine(parse, sglang_python, "sglang"):
        spec = server.speculative
        assert read["model_path"] == server.model_path
        assert (read["port"], read["tp_size"]) == (server.port, server.tp_size)
        assert read["max_running_requests"] == server.max_running_requests
        assert read["cuda_graph_max_bs_decode"] == server.cuda_graph_max_bs_decode
        assert read["enable_metrics"] and read["extra_metric_labels"] == {"role": server.role, "server": server.name}
        assert read["enable_memory_saver"] == read["enable_weights_cpu_backup"] == profile.sleeps
        # The admin key is its placeholder here (the file is read only at launch, on the GPU host).
        key_file = server.admin_api_key_file
        assert read["admin_api_key"] == (admin_key_placeholder(key_file) if key_file else None)
        if spec is None:
            assert read["speculative_algorithm"] is None
        else:
            assert read["speculative_algorithm"] == spec.algorithm
            assert read["speculative_num_steps"] == spec.num_steps
            assert read["speculative_eagle_topk"] == spec.eagle_topk
            assert read["speculative_num_draft_tokens"] == spec.num_draft_tokens
            assert bool(read["speculative_adaptive"]) == spec.adaptive


def test_sleep_flags_parse_too(sglang_python):
    text = (SHIPPED / "kimi-k25-time-shared.toml").read_text().replace('mechanism = "restart"', 'mechanism = "sleep"')
    commands = launch_commands(parse_profile(text, name="k25-sleep", source="test"))
    for answer in parse(sglang_python, [c.server_args for c in commands]):
        assert answer["error"] is None
        assert answer["values"]["enable_memory_saver"] and answer["values"]["enable_weights_cpu_backup"]


def test_sglang_rejects_an_unknown_flag_and_an_old_flag_name(sglang_python):
    args = next(c for c in launch_commands(load_profile("llama8b-partitioned")) if c.role == "speculative").server_args
    unknown, old, bad_algorithm = parse_errors(
        sglang_python,
        [
            [*args, "--no-such-flag"],
            [*args, "--cuda-graph-max-bs", "64"],  # the pre-0.5.23 name: ambiguous in 0.5.23
            [a if a != "EAGLE3" else "EAGLE9" for a in args],
        ],
    )
    assert "unrecognized arguments: --no-such-flag" in unknown
    assert "ambiguous option: --cuda-graph-max-bs" in old
    assert "EAGLE9" in bad_algorithm


def test_sglang_refuses_adaptive_speculation_with_topk_above_one(sglang_python):
    args = launch_commands(load_profile("kimi-k25-adaptive"))[0].server_args
    topk = args.index("--speculative-eagle-topk")
    (error,) = parse_errors(sglang_python, [[*args[: topk + 1], "4", *args[topk + 2 :]]])
    assert error and "topk" in error


def test_standin_argvs_parse_with_the_sim_parser():
    """Stand-in servers run `crossover sim serve`: their argv must parse with that parser."""
    parser = build_parser()
    count = 0
    for name in shipped_profiles():
        for command in launch_commands(load_profile(name)):
            if load_profile(name).server(command.name).engine != "sim":
                continue
            assert command.argv[: len(sim_command())] == sim_command()
            args = parser.parse_args(command.argv[len(sim_command()) - 2 :])
            assert isinstance(args, argparse.Namespace) and args.port == load_profile(name).server(command.name).port
            count += 1
    assert count == 8
