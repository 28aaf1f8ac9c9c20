"""`crossover demo`: SGLang stand-ins and the gateway in front of them on 127.0.0.1, in one command.

    crossover demo                                            # partitioned: both pools serve, spillover
    crossover demo --topology time-shared                     # one GPU set; sleep/wake between the modes
    crossover demo --topology time-shared --mechanism restart # ... restart through a local GPU-host agent
    crossover demo --topology in-engine                       # two patched EAGLE-3 servers; the threshold is their gate
    crossover demo --engine vllm                              # the stand-ins play vLLM (partitioned, time-shared)

Partitioned: a k25-eagle3 and a k25-plain stand-in, and the gateway. Time-shared: the stand-in set of
servers/profiles/standin-time-shared.toml and the gateway of servers/gateway_configs/standin-time-shared.toml
(its switch policy tuned to switch within seconds; the file says why), on ports of the demo's own:
- sleep: both stand-ins start, the plain one's memory is released (as `servers up` leaves a sleep set), and
  the gateway releases and resumes them through SGLang's endpoints;
- restart: the GPU-host agent (`crossover servers agent`) starts the speculative server, and the gateway
  stops one and starts the other through it.
In-engine: two k25-eagle3 stand-ins playing the patched SGLang server (patches/sglang-0.5.23), with an admin key of
the demo's own; the gateway sets the threshold as their zero-step gate, and a PUT /admin/threshold moves it live.

Processes the demo starts itself run in their own process group and ask the kernel to SIGTERM them if the demo
dies (PR_SET_PDEATHSIG). Servers the agent starts outlive it, as on a GPU host; the demo stops them on its way
out (`servers down`). Ctrl-C or SIGTERM stops the gateway, then everything else.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import tomllib
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import get_args

from crossover.gateway.cli import listen_error, non_negative_int, port, positive_float
from crossover.gateway.config import TopologyName
from crossover.gateway.engines import DEFAULT_ENGINE, ENGINE_NAMES, TOKEN_ENV, EngineName, adapter
from crossover.gateway.policies import POLICIES, PolicyName
from crossover.servers.profile import ENGINE_TITLES, ServerMechanism

HOST = "127.0.0.1"
TOPOLOGIES: tuple[TopologyName, ...] = get_args(TopologyName)
# In-engine: how many gated stand-ins, and the gate a banner's command moves to (the demo's threshold is 32).
IN_ENGINE_SERVERS = 2
GATE_EXAMPLE = 16
MODEL = "moonshotai/Kimi-K2.5"  # the stand-in profiles' served name, and k25-eagle3's / k25-plain's
PROFILES = {"speculative": "k25-eagle3", "plain": "k25-plain"}
TIME_SHARED_PROFILE = "standin-time-shared"
TIME_SHARED_TIME_SCALE = 20.0  # the profile's: a k25 restart of minutes takes seconds
STANDIN_READY_TIMEOUT_S = 60.0
STANDIN_STOP_TIMEOUT_S = 10.0
CONTROL_TIMEOUT_S = 10.0
READY_POLL_S = 0.05
LOAD_STEP_CLIENTS = 60  # well above the shipped config's threshold of 32
LOAD_STEP_TOKENS = 1024
LOAD_STEP_S = 30


def gateway_config_path(profile: str = TIME_SHARED_PROFILE) -> Path:
    """The shipped gateway config for a stand-in profile (servers/gateway_configs/PROFILE.toml)."""
    return Path(str(resources.files("crossover.servers").joinpath("gateway_configs", f"{profile}.toml")))


def register(subparsers: argparse._SubParsersAction) -> None:
    demo = subparsers.add_parser(
        "demo",
        help="simulated SGLang pools and the gateway on 127.0.0.1",
        description="Start SGLang stand-ins and the gateway in front of them; Ctrl-C or SIGTERM stops all of it. "
        "Partitioned (default): a k25-eagle3 and a k25-plain stand-in, routed per request. Time-shared: one "
        f"simulated GPU set ({TIME_SHARED_PROFILE}) switched between the modes by the load.",
    )
    demo.add_argument("--port", type=port, default=8000, help="gateway port (default: 8000)")
    demo.add_argument(
        "--topology",
        choices=list(TOPOLOGIES),
        default="partitioned",
        help="partitioned: both pools serve at once; time-shared: one at a time; in-engine: one pool of patched "
        "EAGLE-3 servers whose zero-step gate is the threshold (default: partitioned)",
    )
    demo.add_argument(
        "--mechanism",
        choices=list(get_args(ServerMechanism)),
        default="sleep",
        help="time-shared: how a switch happens - sleep/wake, or restart through a local agent (default: sleep)",
    )
    demo.add_argument(
        "--engine",
        choices=list(ENGINE_NAMES),
        default=DEFAULT_ENGINE,
        help="whose HTTP surface the stand-ins play, and the pools' engine (default: sglang)",
    )
    demo.add_argument("--admin-token", help="admin API token (default: a random one, printed)")
    demo.add_argument(
        "--policy",
        choices=list(POLICIES),
        default="spillover",
        help="partitioned routing policy (default: spillover; time-shared always switches)",
    )
    demo.add_argument(
        "--threshold",
        type=non_negative_int,
        default=None,
        help="routing threshold (default: 32, the gateway's and the time-shared config's)",
    )
    demo.add_argument(
        "--time-scale",
        type=positive_float,
        default=None,
        help=f"run the stand-ins F times faster (default: 1 partitioned, {TIME_SHARED_TIME_SCALE:g} time-shared)",
    )
    demo.set_defaults(run=run_command)


def run_command(args: argparse.Namespace) -> int:
    return run(
        port=args.port,
        admin_token=args.admin_token,
        policy=args.policy,
        threshold=args.threshold,
        time_scale=args.time_scale,
        topology=args.topology,
        mechanism=args.mechanism,
        engine=args.engine,
    )


def _crossover(*argv: str) -> list[str]:
    return [sys.executable, "-m", "crossover.gateway.cli", *argv]


def start_standin(
    profile: str,
    port: int,
    time_scale: float,
    engine: EngineName = DEFAULT_ENGINE,
    *,
    sleeps: bool = True,
    extra: tuple[str, ...] = (),
) -> subprocess.Popen:
    from crossover.servers import process
    from crossover.servers.launch import sim_engine_args

    argv = _crossover("sim", "serve", "--profile", profile, "--host", HOST, "--port", str(port), *extra)
    # Playing vLLM, as vLLM with --enable-sleep-mode (and its dev mode): the time-shared demo sleeps and wakes it.
    argv += sim_engine_args(engine, sleeps=sleeps)
    # The demo shows routing, not the minutes of weight loading the k25 profiles model.
    argv += ["--time-scale", str(time_scale), "--startup-delay", "0"]
    # The demo starts its stand-ins before it runs any thread, so they can die with it.
    return process.spawn(argv)


def _python() -> str:
    """How the user's shell runs this interpreter: `python` where that is the one on PATH, else its path."""
    found = shutil.which("python")
    same = found is not None and Path(found).absolute().parent == Path(sys.executable).absolute().parent
    return "python" if same else sys.executable


# Every command a banner prints runs with `pip install -e .` alone (curl, and crossover's base dependencies):
# the first thing a user tries must not start with a missing package. The SDK line is a pointer, not a command.
def banner(url: str, token: str, lines: list[str]) -> str:
    chat = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 16})
    return "\n".join(
        [
            *lines,
            f"  admin token: {token}",
            f"  try:         curl -s {url}/v1/chat/completions -H 'Content-Type: application/json' -d '{chat}'",
            f"  OpenAI SDK:  base_url='{url}/v1', api_key='none', model='{MODEL}'   (pip install openai)",
            f"  threshold:   curl -s -H 'Authorization: Bearer {token}' {url}/admin/threshold",
            f"  metrics:     curl -s {url}/metrics",
            "  Ctrl-C stops everything.",
        ]
    )


def time_shared_lines(url: str, token: str, mechanism: ServerMechanism, threshold: int) -> list[str]:
    # A closed loop of long non-streamed answers: LOAD_STEP_CLIENTS in flight at little CPU of the machine's.
    step = (
        f"{_python()} -m crossover.loadtest.proxybench.loadgen --url {url} --model {MODEL} "
        f"--concurrency {LOAD_STEP_CLIENTS} --max-tokens {LOAD_STEP_TOKENS} --duration {LOAD_STEP_S} --warmup 0"
    )
    return [
        f"crossover demo: gateway on {url} (one simulated GPU set, {TIME_SHARED_PROFILE}: speculative and plain "
        f"in turn, switched by {mechanism})",
        f"  load step:   {step}",
        f"               ({LOAD_STEP_CLIENTS} clients for {LOAD_STEP_S} s: above the threshold of {threshold}, so it "
        "switches to plain within seconds, and back to speculative once the step ends)",
        f"  mode:        curl -s -H 'Authorization: Bearer {token}' {url}/admin/mode   (under watch -n1 to follow "
        "it; and this log: each switch and why)",
    ]


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


async def _serve(settings, text: str) -> None:
    from crossover.gateway.serve import make_server

    server = make_server(settings)
    serving = asyncio.create_task(server.serve())
    while not server.started and not serving.done():
        await asyncio.sleep(READY_POLL_S)
    if server.started:
        print(text, flush=True)
    await serving


@dataclass
class _Started:
    """What the demo started, for the way out."""

    procs: list[subprocess.Popen] = field(default_factory=list)
    down: list[list[str]] = field(default_factory=list)  # commands that stop what an agent started


def _partitioned(
    started: _Started, policy: PolicyName, threshold: int, time_scale: float, engine: EngineName
) -> tuple[dict, list[str]]:
    from crossover.servers import process

    urls = {}
    for pool, profile in PROFILES.items():
        standin_port = process.free_port(HOST)
        started.procs.append(start_standin(profile, standin_port, time_scale, engine))
        urls[pool] = f"http://{HOST}:{standin_port}"
    for proc, url in zip(started.procs, urls.values(), strict=False):
        process.wait_ready(url + "/health", proc, STANDIN_READY_TIMEOUT_S)
    pools = {p: {"backends": [u], "engine": engine} for p, u in urls.items()}
    settings = {"policy": policy, "threshold": threshold, "pools": pools}
    return settings, [f"two simulated {ENGINE_TITLES[engine]} pools: {', '.join(PROFILES.values())}"]


def _in_engine(started: _Started, threshold: int, time_scale: float, folder: Path) -> tuple[dict, list[str]]:
    from crossover.servers import process

    # The engines' admin key (their --admin-api-key): the gate's POST demands it; the gateway reads it from a file.
    key_file = folder / "engines.admin.key"
    key_file.write_text(secrets.token_urlsafe(18))
    key_file.chmod(0o600)
    urls = []
    gated = ("--speculation-gate", "--admin-api-key-file", str(key_file))  # playing the patched SGLang server
    for _ in range(IN_ENGINE_SERVERS):
        standin_port = process.free_port(HOST)
        started.procs.append(
            start_standin(PROFILES["speculative"], standin_port, time_scale, sleeps=False, extra=gated)
        )
        urls.append(f"http://{HOST}:{standin_port}")
    for proc, url in zip(started.procs, urls, strict=True):
        process.wait_ready(url + "/health", proc, STANDIN_READY_TIMEOUT_S)
    pools = {"speculative": {"backends": urls, "admin_api_key_file": str(key_file)}}
    settings = {"topology": "in-engine", "threshold": threshold, "pools": pools}
    return settings, urls


def in_engine_lines(url: str, token: str, engines: list[str], threshold: int) -> list[str]:
    put = (
        f"curl -s -X PUT -H 'Authorization: Bearer {token}' -H 'Content-Type: application/json' "
        f"-d '{{\"threshold\": {GATE_EXAMPLE}}}' {url}/admin/threshold"
    )
    return [
        f"crossover demo: gateway on {url} ({len(engines)} simulated patched EAGLE-3 servers, "
        f"{PROFILES['speculative']}: one pool; the threshold is their zero-step gate, now {threshold})",
        f"  gate:        {put}   (moves every engine's gate live)",
        f"  engine gate: curl -s {engines[0]}/speculative/adaptive   (what the first engine holds now)",
    ]


def _time_shared_profile(ports: dict[str, int], time_scale: float, folder: Path, engine: EngineName) -> Path:
    """The stand-in time-shared profile on the demo's own ports, time scale and engine, as a file the agent reads."""
    from crossover.servers.profile import load_profile

    shipped = load_profile(TIME_SHARED_PROFILE)
    text = resources.files("crossover.servers").joinpath("profiles", f"{TIME_SHARED_PROFILE}.toml").read_text()
    for server in shipped.servers:
        old = f"port = {server.port}"
        assert text.count(old) == 1, f"{TIME_SHARED_PROFILE}: expected one '{old}'"
        text = text.replace(old, f"port = {ports[server.name]}")
    text = text.replace("time_scale = 20", f"time_scale = {time_scale:g}\nengine = {json.dumps(engine)}")
    path = folder / f"{TIME_SHARED_PROFILE}.toml"
    path.write_text(text)
    return path


def _time_shared(
    started: _Started,
    mechanism: ServerMechanism,
    threshold: int | None,
    time_scale: float,
    folder: Path,
    engine: EngineName,
) -> tuple[dict, list[str]]:
    import httpx

    from crossover.servers import process

    settings = tomllib.loads(gateway_config_path().read_text())
    if threshold is not None:
        settings["threshold"] = threshold
    switching = settings["switching"]
    switching["mechanism"] = mechanism
    ports = {"speculative": process.free_port(HOST), "plain": process.free_port(HOST)}
    urls = {mode: f"http://{HOST}:{p}" for mode, p in ports.items()}
    settings["pools"] = {mode: {"backends": [url], "engine": engine} for mode, url in urls.items()}
    if mechanism == "sleep":
        for mode, profile in PROFILES.items():
            started.procs.append(start_standin(profile, ports[mode], time_scale, engine))
        for proc, url in zip(started.procs, urls.values(), strict=False):
            process.wait_ready(url + "/health", proc, STANDIN_READY_TIMEOUT_S)
        # One GPU set: the mode not serving holds no GPU memory (the gateway resumes it when it switches).
        release = adapter(engine).release
        httpx.post(urls["plain"] + release.path, json=release.body, timeout=CONTROL_TIMEOUT_S).raise_for_status()
        switching["initial_cost"] = 1.5  # release + resume of the k25 stand-ins at time scale 20
        for key in ("agent_url", "agent_token", "agent_servers"):
            switching.pop(key, None)
        return settings, []

    profile = _time_shared_profile(ports, time_scale, folder, engine)
    agent_port, agent_token = process.free_port(HOST), secrets.token_urlsafe(18)
    state_dir = folder / "state"
    agent = _crossover("servers", "agent", str(profile), "--port", str(agent_port), "--state-dir", str(state_dir))
    # The token through the environment, not argv (where `ps` shows it); the agent keeps it from its servers.
    started.procs.append(process.spawn(agent, env={**os.environ, TOKEN_ENV: agent_token}))
    started.down.append(_crossover("servers", "down", str(profile), "--state-dir", str(state_dir)))
    agent_url = f"http://{HOST}:{agent_port}"
    process.wait_ready(agent_url + "/health", started.procs[-1], STANDIN_READY_TIMEOUT_S)
    headers = {"Authorization": f"Bearer {agent_token}"}
    httpx.post(f"{agent_url}/servers/speculative/start", headers=headers, timeout=CONTROL_TIMEOUT_S).raise_for_status()
    process.wait_ready(urls["speculative"] + "/health", None, STANDIN_READY_TIMEOUT_S)
    # Ready as the agent says it (after its own 1-token generation), not only answering /health: a gateway that
    # starts while the agent still says `starting` adopts that start as a switch under way.
    status = f"{agent_url}/servers/speculative"
    deadline = time.monotonic() + STANDIN_READY_TIMEOUT_S
    while httpx.get(status, headers=headers, timeout=CONTROL_TIMEOUT_S).json().get("state") != "ready":
        if time.monotonic() > deadline:
            raise process.NotReady(
                f"the agent did not say the speculative server is ready within {STANDIN_READY_TIMEOUT_S:g} s"
            )
        time.sleep(READY_POLL_S)
    switching.update(agent_url=agent_url, agent_token=agent_token)
    return settings, [f"  agent:       {agent_url} (restarts the stand-ins; servers of {profile})"]


def run(
    port: int,
    admin_token: str | None,
    policy: PolicyName,
    threshold: int | None,
    time_scale: float | None,
    topology: TopologyName = "partitioned",
    mechanism: ServerMechanism = "sleep",
    engine: EngineName = DEFAULT_ENGINE,
) -> int:
    import httpx

    from crossover.gateway.config import DEFAULT_THRESHOLD, Settings, SettingsError
    from crossover.servers import process

    if topology == "in-engine" and engine != DEFAULT_ENGINE:
        print(
            "crossover demo: the in-engine demo plays patched SGLang stand-ins only; for vLLM in-engine see "
            "servers/profiles/llama8b-vllm-in-engine.toml (patches/vllm-0.32.0)",
            file=sys.stderr,
        )
        return 2
    # Before any stand-in starts: a port in use is one line, not stand-ins started for nothing.
    if (error := listen_error(HOST, port)) is not None:
        print(f"crossover demo: {error}", file=sys.stderr)
        return 2
    # SIGTERM behaves like Ctrl-C; while uvicorn serves it takes both, shuts down, then re-raises them here.
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGINT, _interrupt)
    token = admin_token or secrets.token_urlsafe(18)
    url = f"http://{HOST}:{port}"
    started = _Started()
    with tempfile.TemporaryDirectory(prefix="crossover-demo-") as folder:
        try:
            if topology == "in-engine":
                chosen = DEFAULT_THRESHOLD if threshold is None else threshold
                scale = TIME_SHARED_TIME_SCALE if time_scale is None else time_scale
                values, engines = _in_engine(started, chosen, scale, Path(folder))
                lines = in_engine_lines(url, token, engines, chosen)
            elif topology == "time-shared":
                scale = TIME_SHARED_TIME_SCALE if time_scale is None else time_scale
                values, extra = _time_shared(started, mechanism, threshold, scale, Path(folder), engine)
                lines = time_shared_lines(url, token, mechanism, values.get("threshold", DEFAULT_THRESHOLD)) + extra
            else:
                chosen = DEFAULT_THRESHOLD if threshold is None else threshold
                scale = 1.0 if time_scale is None else time_scale
                values, described = _partitioned(started, policy, chosen, scale, engine)
                lines = [f"crossover demo: gateway on {url} ({described[0]})"]
            try:
                settings = Settings(
                    **{
                        **values,
                        "host": HOST,
                        "port": port,
                        "admin_token": token,
                        # No load balancer in front of a demo to warn before it stops: Ctrl-C stops at once.
                        "timeouts": {"shutdown_delay": 0},
                    }
                )
            except (SettingsError, ValueError) as exc:
                print(f"crossover demo: {exc}", file=sys.stderr)
                return 2
            import uvloop

            with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
                runner.run(_serve(settings, banner(url, token, lines)))
        except KeyboardInterrupt:
            pass
        except (process.NotReady, httpx.HTTPError) as exc:
            print(f"crossover demo: {exc}", file=sys.stderr)
            return 1
        except SystemExit:
            # uvicorn's exit when it cannot start (the port taken since the check): it logged why just above.
            print(f"crossover demo: the gateway did not start on {url} (see the error above)", file=sys.stderr)
            return 1
        finally:
            for command in started.down:
                subprocess.run(command, capture_output=True, timeout=STANDIN_STOP_TIMEOUT_S * 3, check=False)
            process.stop(started.procs, STANDIN_STOP_TIMEOUT_S)
    return 0
