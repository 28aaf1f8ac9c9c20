"""`crossover sim`: run a simulated SGLang server, or print what a profile predicts.

    crossover sim serve --profile k25-eagle3 --port 30001 --time-scale 50
    crossover sim curve --profile k25-eagle3 --concurrency 1,2,5,10,30,70,100,250 --output-len 512 --json
    crossover sim steps --profile llama8b-h200-plain --batch 1,64,256 --context 1024

Heavy imports (uvicorn, FastAPI) stay inside the run functions so `crossover --help` stays fast.
"""

from __future__ import annotations

import argparse
import json
import sys

from crossover.gateway.cli import (
    LOG_LEVELS,
    json_string_map,
    listen_error,
    non_negative_float,
    non_negative_int,
    port,
    positive_float,
    positive_int,
    positive_int_list,
)
from crossover.gateway.engines import DEFAULT_ENGINE, ENGINE_NAMES, MAX_FENCE_JUMP
from crossover.servers.sim.replay import DEFAULT_MECHANISMS, DEFAULT_STOP_S, MECHANISMS

DEFAULT_HOST = "127.0.0.1"
DEFAULT_INPUT_LEN = 256
DEFAULT_OUTPUT_LEN = 512
DEFAULT_CONTEXT = 1024


def register(subparsers: argparse._SubParsersAction) -> None:
    sim = subparsers.add_parser(
        "sim",
        help="SGLang stand-in: a simulated server, or its predicted curve",
        description="A stand-in for SGLang: its HTTP surface over a continuous-batching performance model.",
    )
    sub = sim.add_subparsers(dest="sim_command", required=True, metavar="SUBCOMMAND")

    serve = sub.add_parser("serve", help="serve SGLang's HTTP API from a profile (no model runs)")
    _profile_options(serve)
    serve.add_argument("--port", type=port, required=True)
    serve.add_argument("--host", default=DEFAULT_HOST)
    serve.add_argument(
        "--time-scale",
        type=positive_float,
        default=1.0,
        metavar="F",
        help="run F times faster than the profile (all of its durations divided by F)",
    )
    for flag, what, key in (
        ("--startup-delay", "weight loading (/health answers 503 until then)", "startup_s"),
        ("--release-delay", "/release_memory_occupation", "release_s"),
        ("--resume-delay", "/resume_memory_occupation", "resume_s"),
    ):
        serve.add_argument(
            flag,
            type=non_negative_float,
            metavar="S",
            help=f"{what} takes S wall-clock seconds (default: the profile's [memory] {key} / --time-scale)",
        )
    serve.add_argument("--seed", type=int, default=0, help="seed of the accepted-token draws")
    serve.add_argument("--model-name", help="served model name (default: the profile's)")
    serve.add_argument(
        "--max-queued-requests",
        type=non_negative_int,
        metavar="N",
        help="reject requests beyond N waiting ones, as SGLang does (default: the profile's)",
    )
    serve.add_argument(
        "--extra-metric-labels",
        type=json_string_map,
        default={},
        metavar="JSON",
        help='extra labels on every metric, e.g. \'{"variant": "eagle3"}\'',
    )
    serve.add_argument(
        "--speculation-gate",
        action="store_true",
        help="serve the run-time speculation gate as a patched engine does: GET/POST /speculative/adaptive "
        "(patches/sglang-0.5.23), with --engine vllm GET/POST /speculation_gate (patches/vllm-0.32.0)",
    )
    serve.add_argument(
        "--speculation-gate-wire",
        choices=("0.5.23", "main"),
        default="0.5.23",
        help="with --speculation-gate: the wire of patches/sglang-0.5.23 (/speculative/adaptive, the default) or of "
        "patches/sglang-main (speculative_adaptive_* keys of /set_internal_state, read back in /server_info)",
    )
    admin_key = serve.add_mutually_exclusive_group()
    admin_key.add_argument(
        "--admin-api-key",
        metavar="KEY",
        help="as SGLang's (vLLM's VLLM_SPECULATION_GATE_ADMIN_KEY): the gate's POST then needs this bearer token",
    )
    admin_key.add_argument(
        "--admin-api-key-file", metavar="PATH", help="the same key, read from a file (it stays off the command line)"
    )
    serve.add_argument(
        "--fence-max-jump",
        type=non_negative_int,
        default=MAX_FENCE_JUMP,
        metavar="N",
        help="with --speculation-gate: refuse (403 fence_jump) a fencing token more than N above the highest "
        f"accepted (default {MAX_FENCE_JUMP}; 0: no limit)",
    )
    serve.add_argument(
        "--engine",
        choices=list(ENGINE_NAMES),
        default=DEFAULT_ENGINE,
        help="the engine whose HTTP surface it plays: endpoints, metric names, error shapes (default: sglang)",
    )
    serve.add_argument(
        "--enable-sleep-mode",
        action="store_true",
        help="with --engine vllm: serve /sleep, /wake_up and /is_sleeping (vLLM's --enable-sleep-mode)",
    )
    serve.add_argument("--log-level", default="warning", choices=LOG_LEVELS)
    serve.set_defaults(run=_serve)

    curve = sub.add_parser("curve", help="print the profile's closed-loop curve, computed in virtual time")
    _profile_options(curve)
    curve.add_argument(
        "--concurrency", type=positive_int_list, default=[1, 2, 5, 10, 30, 70, 100, 250], metavar="C1,C2,..."
    )
    curve.add_argument("--input-len", type=positive_int, default=DEFAULT_INPUT_LEN)
    curve.add_argument("--output-len", type=positive_int, default=DEFAULT_OUTPUT_LEN)
    curve.add_argument("--seed", type=int, default=0)
    curve.add_argument("--json", action="store_true", help="print JSON (tok/s and seconds, profile time)")
    curve.set_defaults(run=_curve)

    steps = sub.add_parser("steps", help="print one decode step at fixed batch sizes (no prefill, no caps)")
    _profile_options(steps)
    steps.add_argument("--batch", type=positive_int_list, default=[1, 8, 32, 64, 128, 256], metavar="B1,B2,...")
    steps.add_argument("--context", type=positive_int, default=DEFAULT_CONTEXT, help="tokens held by each request")
    steps.add_argument("--json", action="store_true")
    steps.set_defaults(run=_steps)

    # `crossover sim replay` (servers/sim/replay.py): would time-sharing pay on this traffic?
    replay = sub.add_parser(
        "replay", help="replay a load trace through both profiles and the switching policy, in virtual time"
    )
    replay.add_argument("--speculative", required=True, metavar="PROFILE", help="the speculative server's profile")
    replay.add_argument("--plain", required=True, metavar="PROFILE", help="the plain server's profile")
    replay.add_argument(
        "--trace",
        required=True,
        metavar="FILE",
        help="CSV 'duration_s,concurrency', a JSON list of phases, or a shipped trace's name (k25-bursts)",
    )
    replay.add_argument(
        "--mechanism",
        default=",".join(DEFAULT_MECHANISMS),
        metavar="M1,M2,...",
        help=f"any of {', '.join(MECHANISMS)} (default: all but adaptive). adaptive: partitioned pools, the threshold "
        "moved every window by the gateway's adaptive controller at the trace's acceptance, beside the best fixed "
        "threshold and the per-window oracle",
    )
    replay.add_argument(
        "--gateway-config",
        metavar="FILE",
        help="a gateway TOML (`crossover serve --config`): replay its threshold, hysteresis and [switching] as it "
        "would run them (default: the gateway's defaults, the threshold at the profiles' crossover); the options "
        "below override it",
    )
    replay.add_argument("--json", action="store_true", help="print JSON, one object per mechanism")
    replay.add_argument(
        "--exact",
        action="store_true",
        help="step every token of steady phases too (default: measure a steady stretch and repeat it; within ~1%%)",
    )
    replay.add_argument("--accept-length", type=positive_float, help="override the speculative accept length")
    replay.add_argument(
        "--max-running-requests",
        type=positive_int,
        metavar="N",
        help="the speculative server's running cap, the one in-engine serves under (default: its profile's; "
        "servers/profiles/kimi-k25-in-engine.toml starts the engine at 256)",
    )
    for name, what in (
        ("--startup-s", "weight loading of the new server in a restart"),
        ("--release-s", "/release_memory_occupation in a sleep switch"),
        ("--resume-s", "/resume_memory_occupation in a sleep switch"),
    ):
        replay.add_argument(name, type=non_negative_float, metavar="S", help=f"{what} (default: the profiles')")
    replay.add_argument(
        "--stop-s",
        type=non_negative_float,
        metavar="S",
        help=f"stopping a server in a restart (default: {DEFAULT_STOP_S:g})",
    )
    # The gateway's own switch settings (gateway/config.py SwitchSettings), named as the replay always named them.
    for name, kind, field in (
        ("--drain-timeout-s", non_negative_float, "switching.drain_deadline"),
        ("--threshold", non_negative_int, "threshold (default: the profiles' crossover)"),
        ("--hysteresis", non_negative_int, "hysteresis"),
        ("--min-dwell-s", non_negative_float, "switching.dwell"),
        ("--window-s", positive_float, "switching.window"),
    ):
        replay.add_argument(name, type=kind, help=f"the gateway's {field}")
    replay.add_argument(
        "--initial-cost",
        type=non_negative_float,
        metavar="S",
        help="the gateway's switching.initial_cost: what the policy believes a switch costs until it has measured "
        "one (default: the gateway config's; without one, a restart's is the replayed restart's duration and a "
        "sleep's the gateway's default)",
    )
    replay.add_argument(
        "--expected-phase-s", type=positive_float, metavar="S", help="the gateway's switching.expected_phase"
    )
    replay.add_argument(
        "--accept-drop",
        type=accept_drop,
        metavar="T:A",
        help="the speculative accept length is A from T seconds into the trace on (adaptive only)",
    )
    # The gateway's own [adaptive] settings (gateway/config.py AdaptiveSettings), for --mechanism adaptive.
    adaptive_options = (
        ("--adaptive-window-s", positive_float, "window"),
        ("--adaptive-max-step", positive_int, "max_step"),
        ("--adaptive-min", non_negative_int, "min"),
        ("--adaptive-max", non_negative_int, "max"),
        ("--adaptive-deadband", non_negative_int, "deadband"),
        ("--adaptive-max-levels", non_negative_int, "max_levels"),
        ("--adaptive-react", positive_float, "react"),
    )
    for name, kind, field in adaptive_options:
        replay.add_argument(name, type=kind, dest=f"adaptive_{field}", help=f"the gateway's adaptive.{field}")
    # replay_report.adaptive_overrides reads them by field and names the option in its errors.
    replay.set_defaults(adaptive_options={field: name for name, _, field in adaptive_options})
    replay.add_argument("--input-len", type=positive_int, default=DEFAULT_INPUT_LEN, help="(default: %(default)s)")
    replay.add_argument("--output-len", type=positive_int, default=DEFAULT_OUTPUT_LEN, help="(default: %(default)s)")
    replay.add_argument("--seed", type=int, default=0, help="(default: %(default)s)")
    replay.set_defaults(run=_replay)


def _profile_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--profile",
        required=True,
        metavar="NAME_OR_PATH",
        help="a shipped profile (k25-eagle3, k25-plain, llama8b-h200-eagle3, llama8b-h200-plain), "
        "a TOML file, or a load tester's results.json",
    )
    parser.add_argument("--target", help="which target of a results.json to replay")
    parser.add_argument("--accept-length", type=positive_float, help="override the speculative accept length")
    parser.add_argument(
        "--max-running-requests", type=positive_int, metavar="N", help="override the running-request cap"
    )


def _load(args: argparse.Namespace):
    from crossover.servers.sim.profile import load_profile, with_overrides

    profile = load_profile(args.profile, target=args.target)
    return with_overrides(
        profile,
        accept_length=args.accept_length,
        max_running_requests=args.max_running_requests,
        max_queued_requests=getattr(args, "max_queued_requests", None),
        model_name=getattr(args, "model_name", None),
    )


def accept_drop(text: str) -> tuple[float, float]:
    """`T:A` (--accept-drop): seconds into the trace, and the accept length from then on."""
    at, sep, value = text.partition(":")
    if not sep:
        raise argparse.ArgumentTypeError(f"must be SECONDS:ACCEPT_LENGTH, e.g. 3600:1.6, got {text!r}")
    accept = positive_float(value)
    if accept < 1:
        raise argparse.ArgumentTypeError(f"the accept length must be >= 1 (the bonus token included), got {value}")
    return non_negative_float(at), accept


def _replay(args: argparse.Namespace) -> int:
    from crossover.servers.sim.replay_report import run_command

    return run_command(args)


def _fail(message: str) -> int:
    print(f"crossover sim: error: {message}", file=sys.stderr)
    return 2


def _serve(args: argparse.Namespace) -> int:
    from crossover.servers.profile import ENGINE_TITLES, SIM_SLEEP_ARGS
    from crossover.servers.sim.app import SimSettings, run
    from crossover.servers.sim.profile import ProfileError

    try:
        profile = _load(args)
    except ProfileError as exc:
        return _fail(str(exc))
    admin_api_key = args.admin_api_key
    if args.admin_api_key_file is not None:
        from crossover.servers.launch import LaunchError, read_admin_key

        try:
            admin_api_key = read_admin_key(args.admin_api_key_file)
        except LaunchError as exc:
            return _fail(str(exc))
    if (error := listen_error(args.host, args.port)) is not None:
        return _fail(error)
    engine = ENGINE_TITLES[args.engine]
    if args.enable_sleep_mode and not SIM_SLEEP_ARGS[args.engine]:
        return _fail(f"--enable-sleep-mode is vLLM's (with --engine vllm); the {engine} stand-in has its memory saver")
    spec = profile.speculative
    print(
        f"crossover sim: SIMULATED {engine} server - no model runs, text is filler. profile {profile.name} "
        f"({profile.kind}{f', {spec.algorithm} accept length {spec.accept_length}' if spec else ''}), "
        f"model {profile.model_name}, time scale {args.time_scale:g}x, on http://{args.host}:{args.port}",
        file=sys.stderr,
        flush=True,
    )
    run(
        SimSettings(
            profile=profile,
            host=args.host,
            port=args.port,
            time_scale=args.time_scale,
            startup_delay_s=args.startup_delay,
            release_delay_s=args.release_delay,
            resume_delay_s=args.resume_delay,
            seed=args.seed,
            extra_metric_labels=args.extra_metric_labels,
            speculation_gate=args.speculation_gate,
            admin_api_key=admin_api_key,
            fence_max_jump=args.fence_max_jump,
            speculation_gate_wire=args.speculation_gate_wire,
            engine=args.engine,
            sleep_mode=args.enable_sleep_mode,
        ),
        log_level=args.log_level,
    )
    return 0


def _curve(args: argparse.Namespace) -> int:
    from crossover.servers.sim.curve import sweep
    from crossover.servers.sim.profile import ProfileError

    try:
        profile = _load(args)
        points = sweep(profile, args.concurrency, input_len=args.input_len, output_len=args.output_len, seed=args.seed)
    except (ProfileError, ValueError) as exc:
        return _fail(str(exc))
    if args.json:
        print(
            json.dumps(
                [
                    {
                        "concurrency": p.concurrency,
                        "output_throughput": round(p.output_throughput, 3),
                        "per_request_throughput": round(p.per_request_throughput, 3),
                        "mean_ttft_s": round(p.mean_ttft_s, 4),
                        "running": round(p.running, 2),
                        "queued": round(p.queued, 2),
                    }
                    for p in points
                ],
                indent=2,
            )
        )
        return 0
    limits = profile.limits
    print(
        f"{profile.name}: {profile.description}\n{args.input_len} input / {args.output_len} output tokens, "
        f"max_running_requests {limits.max_running_requests}, KV pool {limits.max_total_num_tokens} tokens; "
        "virtual time, profile units"
    )
    print(f"{'C':>6} {'output tok/s':>13} {'per-request tok/s':>18} {'mean TTFT s':>12} {'running':>8} {'queued':>7}")
    for p in points:
        print(
            f"{p.concurrency:>6} {p.output_throughput:>13.1f} {p.per_request_throughput:>18.2f} "
            f"{p.mean_ttft_s:>12.3f} {p.running:>8.1f} {p.queued:>7.1f}"
        )
    return 0


def _steps(args: argparse.Namespace) -> int:
    from crossover.servers.sim.curve import batch_table
    from crossover.servers.sim.profile import ProfileError

    try:
        points = batch_table(_load(args), args.batch, context=args.context)
    except ProfileError as exc:
        return _fail(str(exc))
    if args.json:
        print(json.dumps([vars(p) for p in points], indent=2))
        return 0
    print(f"{'batch':>6} {'step ms':>9} {'tokens/step':>12} {'output tok/s':>13} {'per-request tok/s':>18}")
    for p in points:
        print(
            f"{p.batch:>6} {p.step_ms:>9.2f} {p.tokens_per_step:>12.2f} {p.output_throughput:>13.0f} "
            f"{p.per_request_throughput:>18.1f}"
        )
    return 0
