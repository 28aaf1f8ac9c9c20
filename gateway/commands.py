"""`crossover serve` and `crossover demo`. Heavy imports wait until a command runs."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from crossover.gateway.cli import non_negative_int, port, positive_float


def register(subparsers: argparse._SubParsersAction) -> None:
    serve = subparsers.add_parser(
        "serve",
        help="run the gateway in front of SGLang pools",
        description="Run the gateway. Settings come from --config (TOML, see gateway/example.toml) and "
        "CROSSOVER_* environment variables (nested with __), which override the file.",
    )
    serve.add_argument("--config", type=Path, help="TOML settings file")
    serve.add_argument("--host", help="listen address (default: the settings' host)")
    serve.add_argument("--port", type=port, help="listen port (default: the settings' port)")
    serve.set_defaults(run=run_serve)

    demo = subparsers.add_parser(
        "demo",
        help="two simulated SGLang pools and the gateway on 127.0.0.1",
        description="Start a k25-eagle3 and a k25-plain stand-in and the gateway in front of them; "
        "Ctrl-C or SIGTERM stops all of it.",
    )
    demo.add_argument("--port", type=port, default=8000, help="gateway port (default 8000)")
    demo.add_argument("--admin-token", help="admin API token (default: a random one, printed)")
    demo.add_argument("--policy", choices=["switch", "spillover"], default="spillover")
    demo.add_argument("--threshold", type=non_negative_int, default=None, help="routing threshold (default 32)")
    demo.add_argument("--time-scale", type=positive_float, default=1.0, help="run the stand-ins F times faster")
    demo.set_defaults(run=run_demo)


def run_serve(args: argparse.Namespace) -> int:
    from crossover.gateway.config import SettingsError, load_settings
    from crossover.gateway.server import make_server

    try:
        settings = load_settings(args.config)
        server = make_server(settings, args.host, args.port)
    except (SettingsError, ValueError) as exc:
        print(f"crossover serve: {exc}", file=sys.stderr)
        return 2
    server.run()
    return 130 if server.interrupted else 0  # 128 + SIGINT, as a shell reports Ctrl-C


def run_demo(args: argparse.Namespace) -> int:
    from crossover.gateway.demo import run

    return run(
        port=args.port,
        admin_token=args.admin_token,
        policy=args.policy,
        threshold=args.threshold,
        time_scale=args.time_scale,
    )
