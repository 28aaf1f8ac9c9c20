"""The exact argv and environment each server of a profile is started with.

    for command in launch_commands(profile):
        print(command.name, command.argv, command.env)

`server_args` is the part after the engine's command (`sglang serve`, `vllm serve`): what the engine's own parser
must accept (tests/servers/test_sglang_parser.py feeds SGLang's to 0.5.23's `prepare_server_args`,
tests/servers/test_vllm_parser.py vLLM's to 0.32's `vllm serve` parser). `env` holds only what the profile sets;
the process gets it on top of the caller's environment.

A server's admin key (`admin_api_key_file`) is never in `argv`: it shows as `<from /path>` there (what `plan`
prints, the log and the state file record), and `run_argv()` reads the file - on the host that starts it, when
it starts.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from crossover.gateway.engines import DEFAULT_ENGINE, EngineName, vllm
from crossover.servers.profile import SIM_SLEEP_ARGS, Profile, Server, ServerEngine


class LaunchError(ValueError):
    """A server cannot be started as its profile says (its admin key file); one line naming the file."""


@dataclass(frozen=True)
class LaunchCommand:
    name: str
    role: str
    argv: list[str]  # safe to print: an admin key is its placeholder
    env: dict[str, str]
    server_args: list[str]  # argv without the launcher and the engine command
    admin_api_key_file: str | None = None

    def as_json(self) -> dict:
        return {"name": self.name, "role": self.role, "argv": self.argv, "env": self.env}

    def run_argv(self) -> list[str]:
        """The argv to exec: the admin key read from its file now (LaunchError when it cannot be)."""
        if self.admin_api_key_file is None:
            return list(self.argv)
        key = read_admin_key(self.admin_api_key_file)
        shown = admin_key_placeholder(self.admin_api_key_file)
        return [key if arg == shown else arg for arg in self.argv]

    def run_env(self) -> dict[str, str]:
        """The environment to start it with: an admin key given there (vLLM's gate key) read from its file now."""
        if self.admin_api_key_file is None:
            return dict(self.env)
        shown = admin_key_placeholder(self.admin_api_key_file)
        if shown not in self.env.values():
            return dict(self.env)
        key = read_admin_key(self.admin_api_key_file)
        return {name: key if value == shown else value for name, value in self.env.items()}


def admin_key_placeholder(path: str) -> str:
    return f"<from {path}>"


def read_admin_key(path: str) -> str:
    """The one-line key in `path`; LaunchError (one line) when it is missing, unreadable or empty."""
    try:
        key = Path(path).read_text().strip()
    except OSError as exc:
        raise LaunchError(f"admin_api_key_file {path} cannot be read: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise LaunchError(f"admin_api_key_file {path} is not text") from None
    if not key or any(c.isspace() for c in key):
        raise LaunchError(f"admin_api_key_file {path} must hold one key (one line, no spaces)")
    return key


# SGLang on CPU from the registry's wheel: its CPU attention backend (intel_amx) needs the CPU kernel build, so
# the torch one (which also turns CUDA graphs off); SGLANG_USE_CPU_ENGINE keeps it off CUDA-only ops (sglang.md).
CPU_ARGS = ["--device", "cpu", "--attention-backend", "torch_native"]


def launch_commands(profile: Profile) -> list[LaunchCommand]:
    return [launch_command(profile, server) for server in profile.servers]


def launch_command(profile: Profile, server: Server) -> LaunchCommand:
    env = dict(server.env)
    command, args, defaults = LAUNCHES[server.engine](profile, server)
    for key, value in defaults.items():
        env.setdefault(key, value)
    if server.gpus and server.engine != "sim":
        env.setdefault("CUDA_VISIBLE_DEVICES", ",".join(str(g) for g in server.gpus))
    return LaunchCommand(
        name=server.name,
        role=server.role,
        argv=[*server.launcher, *command, *args],
        env=env,
        server_args=args,
        admin_api_key_file=server.admin_api_key_file,
    )


# (engine command, its flags, environment the profile's `env` may override) of one server.
Launch = tuple[list[str], list[str], dict[str, str]]


def _sglang_launch(profile: Profile, server: Server) -> Launch:
    env = {"SGLANG_USE_CPU_ENGINE": "1"} if server.device == "cpu" else {}
    return list(profile.sglang_command), sglang_args(profile, server), env


def _vllm_launch(profile: Profile, server: Server) -> Launch:
    # vLLM serves /sleep, /wake_up and /is_sleeping - and the patched /speculation_gate - only in its dev mode, which
    # opens unauthenticated routes besides: the profile keeps such a server on loopback (VLLM_DEV_MODE_RISK in
    # profile.py), reached by the agent and the gateway on its host.
    gated = profile.topology == "in-engine"
    env = {vllm.DEV_MODE_ENV: "1"} if profile.sleeps or gated else {}
    if gated and server.admin_api_key_file:
        # The gate's own key (patches/vllm-0.32.0): in the environment, off the command line; run_env() reads it.
        env[vllm.GATE_KEY_ENV] = admin_key_placeholder(server.admin_api_key_file)
    return list(profile.vllm_command), vllm_args(profile, server), env


def gate_schedule(max_num_seqs: int, num_steps: int) -> list[list[int]]:
    """The start-up `num_speculative_tokens_per_batch_size` of a gated vLLM: K below the running cap, K=0 at it - both
    query lengths (1 + K and 1) in force at start-up, so vLLM captures CUDA graphs for both at every batch size and
    the patch's gate may send any batch to K=0 - speculating everywhere but at a full batch until the gate moves."""
    return [[1, max_num_seqs - 1, num_steps], [max_num_seqs, max_num_seqs, 0]]


def _sim_launch(profile: Profile, server: Server) -> Launch:
    return sim_command(), sim_args(profile, server), {}


# How a server of each engine is started.
LAUNCHES: dict[ServerEngine, Callable[[Profile, Server], Launch]] = {
    "sglang": _sglang_launch,
    "vllm": _vllm_launch,
    "sim": _sim_launch,
}


def metric_labels(server: Server) -> str:
    return json.dumps({"role": server.role, "server": server.name}, separators=(",", ":"))


def sglang_args(profile: Profile, server: Server) -> list[str]:
    assert server.model_path is not None  # the profile validator guarantees it for engine "sglang"
    args = ["--model-path", server.model_path]
    if server.served_model_name:
        args += ["--served-model-name", server.served_model_name]
    args += ["--host", server.host, "--port", str(server.port), "--tp-size", str(server.tp_size)]
    if server.device == "cpu":
        args += CPU_ARGS
    spec = server.speculative
    if spec is not None:
        args += [
            "--speculative-algorithm",
            spec.algorithm,
            "--speculative-draft-model-path",
            spec.draft_model_path,
            "--speculative-num-steps",
            str(spec.num_steps),
            "--speculative-eagle-topk",
            str(spec.eagle_topk),
            "--speculative-num-draft-tokens",
            str(spec.num_draft_tokens),
        ]
        if spec.adaptive:
            args.append("--speculative-adaptive")
            if spec.adaptive_config:
                args += ["--speculative-adaptive-config", spec.adaptive_config]
    if server.max_running_requests is not None:
        args += ["--max-running-requests", str(server.max_running_requests)]
    if server.cuda_graph_max_bs_decode is not None:
        args += ["--cuda-graph-max-bs-decode", str(server.cuda_graph_max_bs_decode)]
    if server.mem_fraction_static is not None:
        args += ["--mem-fraction-static", f"{server.mem_fraction_static:g}"]
    if server.admin_api_key_file:
        # SGLang 0.5.23 takes its admin key only as this flag (no environment variable; its --config YAML is
        # opened at parse time, so a plan could not be checked off the GPU host): the key is in the engine's
        # command line, visible to `ps` on that host. run_argv() puts it in; everything printed shows the file.
        args += ["--admin-api-key", admin_key_placeholder(server.admin_api_key_file)]
    if profile.sleeps:
        # Sleep/wake keeps the released server's weights in host memory; without the backup they come back
        # as garbage (sglang.md).
        args += ["--enable-memory-saver", "--enable-weights-cpu-backup"]
    args += ["--enable-metrics", "--extra-metric-labels", metric_labels(server)]
    return [*args, *server.extra_args]


def vllm_args(profile: Profile, server: Server) -> list[str]:
    """vLLM's OpenAI server flags, as vLLM documents them (what tests/servers/test_vllm_parser.py feeds to its
    own parser): `vllm serve MODEL --flags`, or `--model MODEL` after the deprecated module command (which
    ignores a positional model). No admin key (the gate's is in the environment) and no extra metric labels; its
    CPU build needs no device flag. In-engine, the start-up schedule the gate moves within (`gate_schedule`)."""
    assert server.model_path is not None  # the profile validator guarantees it for engine "vllm"
    args = [server.model_path] if profile.vllm_command[-1:] == ["serve"] else ["--model", server.model_path]
    if server.served_model_name:
        args += ["--served-model-name", server.served_model_name]
    args += ["--host", server.host, "--port", str(server.port), "--tensor-parallel-size", str(server.tp_size)]
    spec = server.speculative
    if spec is not None:
        config = {
            "method": "eagle3",
            "model": spec.draft_model_path,
            "num_speculative_tokens": spec.num_steps,
            **spec.vllm_config,
        }
        if profile.topology == "in-engine":
            assert server.max_running_requests is not None  # the profile validator guarantees it in-engine
            config["num_speculative_tokens_per_batch_size"] = gate_schedule(server.max_running_requests, spec.num_steps)
        args += ["--speculative-config", json.dumps(config, separators=(",", ":"))]
    if server.max_running_requests is not None:
        args += ["--max-num-seqs", str(server.max_running_requests)]
    if server.max_queued_requests is not None:
        args += ["--max-num-queued-reqs", str(server.max_queued_requests)]
    if server.mem_fraction_static is not None:
        # SGLang's fraction for weights + KV cache; vLLM's is of the whole GPU, for everything the engine holds.
        args += ["--gpu-memory-utilization", f"{server.mem_fraction_static:g}"]
    if profile.sleeps:
        args.append("--enable-sleep-mode")
    return [*args, *server.extra_args]


def sim_command() -> list[str]:
    return [sys.executable, "-m", "crossover.gateway.cli", "sim", "serve"]


def sim_engine_args(engine: EngineName, *, sleeps: bool) -> list[str]:
    """`crossover sim serve`'s flags to play `engine` (SGLang unless told), and to sleep and wake when `sleeps`."""
    args = [] if engine == DEFAULT_ENGINE else ["--engine", engine]
    return args + (SIM_SLEEP_ARGS[engine] if sleeps else [])


def sim_args(profile: Profile, server: Server) -> list[str]:
    assert server.sim is not None
    args = ["--profile", server.sim.profile, "--host", server.host, "--port", str(server.port)]
    args += ["--time-scale", f"{server.sim.time_scale:g}", "--startup-delay", f"{server.sim.startup_delay_s:g}"]
    if server.served_model_name:
        args += ["--model-name", server.served_model_name]
    if server.max_running_requests is not None:
        args += ["--max-running-requests", str(server.max_running_requests)]
    args += ["--extra-metric-labels", metric_labels(server)]
    if server.admin_api_key_file:
        args += ["--admin-api-key-file", server.admin_api_key_file]  # the stand-in reads it: the key stays off ps
    if profile.topology == "in-engine":
        args.append("--speculation-gate")  # the stand-in plays a patched server
    args += sim_engine_args(server.sim.engine, sleeps=profile.sleeps)
    return [*args, *server.extra_args]
