"""Deployment profiles: the shipped ones load and say what they must; a wrong one is refused with a message
that names the field; the argv and environment each server gets (`plan`)."""

from __future__ import annotations

import json
import re

import pytest

from crossover.servers.launch import launch_commands
from crossover.servers.profile import ProfileError, load_profile, parse_profile, shipped_profiles
from tests.servers.conftest import SHIPPED, run_cli


def argv_of(profile_name: str, server: str) -> list[str]:
    return next(c.argv for c in launch_commands(load_profile(profile_name)) if c.name == server)


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_shipped_profiles():
    assert shipped_profiles() == [
        "kimi-k25-adaptive",
        "kimi-k25-in-engine",
        "kimi-k25-time-shared",
        "llama8b-partitioned",
        "llama8b-vllm-in-engine",
        "llama8b-vllm-partitioned",
        "llama8b-vllm-time-shared",
        "standin-in-engine",
        "standin-partitioned",
        "standin-time-shared",
        "standin-vllm-partitioned",
    ]
    for name in shipped_profiles():
        profile = load_profile(name)
        # Only a profile of vLLM servers (or stand-ins of them) leaves the SGLang release out.
        plays_sglang = any(server.plays == "sglang" for server in profile.servers)
        assert profile.sglang_version == ("0.5.23" if plays_sglang else None)
        # A profile of real vLLM servers pins the release it was checked against.
        runs_vllm = any(server.engine == "vllm" for server in profile.servers)
        # In-engine, the release patches/vllm-0.32.0 is made for.
        checked = "0.32.0" if profile.topology == "in-engine" else "0.34.0"
        assert profile.vllm_version == (checked if runs_vllm else None)
        assert profile.warnings() == [], f"{name}: {profile.warnings()}"


@pytest.mark.parametrize("name", [p.stem for p in SHIPPED.glob("*.toml")])
def test_every_field_of_a_shipped_profile_is_commented(name):
    """An operator edits these files: each top-level and first-server setting says what it is."""
    lines = (SHIPPED / f"{name}.toml").read_text().splitlines()
    first_server_end = [i for i, line in enumerate(lines) if line == "[[servers]]"][1:2] or [len(lines)]
    for before, line in zip(["", *lines], lines[: first_server_end[0]], strict=False):
        if re.match(r"^[a-z_]+ = ", line) and not line.endswith("["):
            assert "#" in line or before.startswith("#"), f"{name}: uncommented setting {line!r}"


def test_reference_deployment_argv():
    spec = argv_of("kimi-k25-time-shared", "speculative")
    assert spec[:2] == ["sglang", "serve"]
    assert flag(spec, "--tp-size") == "8"
    assert flag(spec, "--speculative-algorithm") == "EAGLE3"
    assert flag(spec, "--max-running-requests") == "128"
    assert flag(spec, "--cuda-graph-max-bs-decode") == "128"
    assert "--cuda-graph-max-bs" not in spec  # the pre-0.5.23 name
    assert "--mem-fraction-static" not in spec  # let SGLang size it (kimi-k25-figures.md)
    assert "--enable-metrics" in spec
    assert json.loads(flag(spec, "--extra-metric-labels")) == {"role": "speculative", "server": "speculative"}
    plain = argv_of("kimi-k25-time-shared", "plain")
    assert "--speculative-algorithm" not in plain
    assert json.loads(flag(plain, "--extra-metric-labels"))["role"] == "plain"
    env = launch_commands(load_profile("kimi-k25-time-shared"))[0].env
    assert env["CUDA_VISIBLE_DEVICES"] == "0,1,2,3,4,5,6,7"
    assert env["NCCL_IB_DISABLE"] == "1"


def test_sleep_starts_both_servers_with_the_memory_saver_and_weight_backup():
    text = (SHIPPED / "kimi-k25-time-shared.toml").read_text().replace('mechanism = "restart"', 'mechanism = "sleep"')
    for command in launch_commands(parse_profile(text, name="k25-sleep", source="test")):
        assert "--enable-memory-saver" in command.argv and "--enable-weights-cpu-backup" in command.argv
    assert "--enable-memory-saver" not in argv_of("kimi-k25-time-shared", "speculative")


def test_adaptive_and_partitioned_argv():
    adaptive = argv_of("kimi-k25-adaptive", "adaptive")
    assert "--speculative-adaptive" in adaptive
    assert flag(adaptive, "--speculative-adaptive-config").endswith(".json")
    assert flag(adaptive, "--speculative-eagle-topk") == "1"
    llama = {c.name: c for c in launch_commands(load_profile("llama8b-partitioned"))}
    assert flag(llama["speculative"].argv, "--speculative-draft-model-path") == (
        "jamesliu1/sglang-EAGLE3-Llama-3.1-Instruct-8B"
    )
    assert llama["speculative"].env["CUDA_VISIBLE_DEVICES"] == "0,1,2,3"
    assert llama["plain"].env["CUDA_VISIBLE_DEVICES"] == "4,5,6,7"


def test_standin_servers_run_the_sim_with_its_profile_and_time_scale():
    argv = argv_of("standin-time-shared", "speculative")
    assert argv[-len(argv) + 1 :][2:4] == ["sim", "serve"]
    assert flag(argv, "--profile") == "k25-eagle3"
    assert float(flag(argv, "--time-scale")) > 1
    assert float(flag(argv, "--startup-delay")) > 0
    assert flag(argv_of("standin-time-shared", "plain"), "--profile") == "k25-plain"


def test_plan_json_is_exactly_the_launch_commands():
    result = run_cli("plan", "llama8b-partitioned", "--json")
    assert result.returncode == 0, result.stderr
    plan = json.loads(result.stdout)
    assert [set(entry) for entry in plan] == [{"name", "role", "argv", "env"}] * 2
    assert plan == [c.as_json() for c in launch_commands(load_profile("llama8b-partitioned"))]
    unchecked = run_cli("plan", "kimi-k25-adaptive", "--json", "--no-fit-check")
    assert unchecked.returncode == 0 and "does not fit" not in unchecked.stderr, unchecked.stderr
    assert json.loads(unchecked.stdout)[0]["name"] == "adaptive"
    human = run_cli("plan", "llama8b-partitioned")
    assert "CUDA_VISIBLE_DEVICES=0,1,2,3" in human.stdout and "--speculative-num-steps 3" in human.stdout


def good() -> str:
    return (SHIPPED / "llama8b-partitioned.toml").read_text()


def no_eagle(text: str) -> str:
    """The profile without its [servers.speculative] table."""
    return re.sub(r"\[servers\.speculative\]\n(.+\n)+", "", text)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            lambda t: t.replace('sglang_version = "0.5.23"', 'sglang_version = "0.4.6"'),
            "sglang_version: this crossover",
        ),
        (lambda t: t.replace('topology = "partitioned"', 'topology = "mirrored"'), "topology: Input should be"),
        (lambda t: t.replace("num_draft_tokens = 4", "num_draft_tokens = 8"), "num_draft_tokens to num_steps + 1 = 4"),
        (lambda t: t.replace("tp_size = 4", "tp_size = 2", 1), "tp_size 2 needs exactly 2 GPUs, got 4"),
        (lambda t: t.replace("port = 30002", "port = 30001"), "two servers listen on the same host and port"),
        (lambda t: no_eagle(t.replace('role = "speculative"', 'role = "plain"')), "one 'speculative' and one 'plain'"),
        (lambda t: t.replace("weights_gb = 16", "weights_gb = 16\nwieghts_gb = 1"), "wieghts_gb: Extra inputs"),
        (lambda t: t.replace("gpus = [4, 5, 6, 7]", "gpus = [4, 4, 6, 7]"), "a GPU id is listed twice"),
        (no_eagle, "server 'speculative': role 'speculative' needs a [servers.speculative] table"),
        (lambda t: t.replace("[servers.speculative]", "[servers.eagle]"), "servers.0.eagle: Extra inputs"),
        (lambda t: t + "\n[time_shared]\nmechanism = 'sleep'\ninitial = 'plain'\n", "belongs to topology"),
        (lambda t: t.replace("port = 30001", "port = 70000"), "servers.0.port: Input should be less than"),
        (lambda t: t.replace("topology =", "topology == "), "not valid TOML"),
    ],
)
def test_a_wrong_profile_is_refused_with_a_precise_message(change, message):
    with pytest.raises(ProfileError) as refused:
        parse_profile(change(good()), name="bad", source="bad.toml")
    assert message in str(refused.value)
    assert str(refused.value).startswith("bad.toml: ")


def test_time_shared_needs_its_table_and_a_known_initial_mode():
    text = (SHIPPED / "standin-time-shared.toml").read_text()
    with pytest.raises(ProfileError, match=r"time_shared.initial 'eagle' is not a server"):
        parse_profile(text.replace('initial = "speculative"', 'initial = "eagle"'), name="x", source="x")
    without = re.sub(r"\[time_shared\]\n(.*\n){2}", "", text.replace("# restart", ""))
    with pytest.raises(ProfileError, match="needs a \\[time_shared\\] table"):
        parse_profile(without, name="x", source="x")


def test_a_speculative_server_without_a_running_cap_is_warned_about():
    text = good().replace("max_running_requests = 128", "")
    profile = parse_profile(text, name="capless", source="x")
    (warning,) = profile.warnings()
    assert "'speculative'" in warning and "48" in warning
    assert "--max-running-requests" not in next(c.argv for c in launch_commands(profile) if c.role == "speculative")


def test_plan_warns_about_the_silent_cap(tmp_path):
    path = tmp_path / "capless.toml"
    path.write_text(good().replace("max_running_requests = 128", ""))
    result = run_cli("plan", str(path))
    assert "silently caps an EAGLE server at 48" in result.stderr


def test_unknown_profile_names_the_shipped_ones():
    with pytest.raises(ProfileError, match="standin-partitioned"):
        load_profile("no-such-profile")
    result = run_cli("plan", "no-such-profile")
    assert result.returncode == 2 and "not a shipped profile" in result.stderr


def on_cpu(text: str) -> str:
    """The reference profile on SGLang's CPU engine: no GPUs, the speculative server without EAGLE-3."""
    text = re.sub(r"gpus = \[[\d, ]*\]", 'device = "cpu"', text)
    return no_eagle(text.replace("tp_size = 4", "tp_size = 1"))


def test_a_cpu_server_runs_sglangs_cpu_engine_and_a_speculative_one_runs_plain():
    profile = parse_profile(on_cpu(good()), name="cpu", source="x")
    for command in launch_commands(profile):
        assert flag(command.argv, "--device") == "cpu"
        assert flag(command.argv, "--attention-backend") == "torch_native"
        assert command.env["SGLANG_USE_CPU_ENGINE"] == "1" and "CUDA_VISIBLE_DEVICES" not in command.env
        assert "--speculative-algorithm" not in command.argv
    assert any("'speculative' on CPU without EAGLE-3: it runs plain" in note for note in profile.warnings())


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda t: t.replace('device = "cpu"', 'device = "cpu"\ngpus = [0]', 1), "device 'cpu' takes no gpus"),
        (lambda t: t.replace('device = "cpu"', 'device = "tpu"', 1), "device: Input should be 'cuda' or 'cpu'"),
    ],
)
def test_a_wrong_cpu_server_is_refused(change, message):
    with pytest.raises(ProfileError, match=re.escape(message)):
        parse_profile(change(on_cpu(good())), name="bad", source="bad.toml")


def test_a_stand_in_takes_no_device():
    text = (
        (SHIPPED / "standin-time-shared.toml")
        .read_text()
        .replace('engine = "sim"', 'engine = "sim"\ndevice = "cpu"', 1)
    )
    with pytest.raises(ProfileError, match="device belongs to a real engine"):
        parse_profile(text, name="x", source="x")


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (("max_running_requests = 128 ", "cuda_graph_max_bs_decode = 8\nmax_running_requests = 128 "), "SGLang's"),
        (("eagle_topk = 1 ", "eagle_topk = 2 "), "eagle_topk must be 1"),
        (("num_draft_tokens = 4 ", "num_draft_tokens = 4\nadaptive = true "), "fixes its draft length at launch"),
        (("sglang | vllm | sim", ""), None),  # a comment: still valid
        (("extra_args = []", 'extra_args = ["--disable-log-stats"]'), "removes vLLM's /metrics load gauges"),
        (("extra_args = []", 'extra_args = ["--disable_log_stats=true"]'), "removes vLLM's /metrics load gauges"),
        (('vllm_version = "0.34.0"', ""), "pins the release it was checked against"),
        (('vllm_version = "0.34.0"', 'vllm_version = "0.35.0"'), "0.35.0 is not one of them"),
    ],
)
def test_a_vllm_server_refuses_what_only_sglang_has(change, message):
    old, new = change
    text = (SHIPPED / "llama8b-vllm-partitioned.toml").read_text()
    assert old in text
    text = text.replace(old, new, 1)
    if message is None:
        parse_profile(text, name="x", source="x")
        return
    with pytest.raises(ProfileError, match=message):
        parse_profile(text, name="x", source="x")


def test_vllm_in_dev_mode_listens_on_loopback_only():
    """Dev mode (which sleep needs) opens /collective_rpc, /pause, ... with no authentication."""
    sleeping = (SHIPPED / "llama8b-vllm-time-shared.toml").read_text()
    profile = parse_profile(sleeping, name="x", source="x")
    assert all(server.host == "127.0.0.1" for server in profile.servers)
    with pytest.raises(ProfileError, match=r"/collective_rpc, /pause, /resume .* host must be loopback"):
        parse_profile(sleeping.replace('host = "127.0.0.1"', 'host = "0.0.0.0"', 1), name="x", source="x")
    # Dev mode set by hand on a server that does not sleep: the same.
    partitioned = (SHIPPED / "llama8b-vllm-partitioned.toml").read_text()
    by_hand = partitioned.replace('NCCL_IB_DISABLE = "1"', 'NCCL_IB_DISABLE = "1"\nVLLM_SERVER_DEV_MODE = "1"', 1)
    parse_profile(by_hand, name="x", source="x")  # on loopback: allowed
    with pytest.raises(ProfileError, match="dev mode opens unauthenticated routes"):
        parse_profile(by_hand.replace('host = "127.0.0.1"', 'host = "10.0.0.5"', 1), name="x", source="x")


def test_a_vllm_server_without_a_queue_cap_is_warned_of_and_only_vllm_takes_one():
    text = (SHIPPED / "llama8b-vllm-partitioned.toml").read_text()
    uncapped = parse_profile(text.replace("max_queued_requests = 256", "", 1), name="x", source="x")
    assert uncapped.warnings() == [
        "server 'speculative': no max_queued_requests - vLLM's queue is then unbounded and the pool never answers "
        "busy (503), so the gateway cannot fail over from it; set --max-num-queued-reqs"
    ]
    sglang = (SHIPPED / "llama8b-partitioned.toml").read_text()
    capped = sglang.replace("max_running_requests = 128", "max_running_requests = 128\nmax_queued_requests = 9", 1)
    with pytest.raises(ProfileError, match="max_queued_requests is vLLM's --max-num-queued-reqs"):
        parse_profile(capped, name="x", source="x")


def test_in_engine_takes_no_vllm_server():
    """Its servers speculate adaptively, which a vLLM server (or a stand-in playing one) cannot."""
    text = (
        (SHIPPED / "standin-in-engine.toml")
        .read_text()
        .replace('profile = "k25-eagle3"', 'profile = "k25-eagle3"\nengine = "vllm"')
    )
    with pytest.raises(ProfileError, match="vLLM fixes its draft length at launch"):
        parse_profile(text, name="x", source="x")
