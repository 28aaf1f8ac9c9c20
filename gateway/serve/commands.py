"""`crossover serve`. Heavy imports wait until a command runs. (`crossover demo` starts stand-ins, so it is
the servers package's: servers/demo.py.)"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from crossover.gateway.cli import listen_error, port, positive_float
from crossover.gateway.config import MAX_WORKERS, MIN_WORKER_TIMEOUT_S


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
    serve.add_argument(
        "--workers",
        type=workers,
        help="processes serving the port as one gateway (default: the settings' workers; one per core to use)",
    )
    serve.add_argument(
        "--worker-timeout",
        type=worker_timeout,
        help="seconds a worker may be silent (its event loop hung or stopped) before it is killed and replaced "
        "(default: the settings' worker_timeout, 30)",
    )
    serve.set_defaults(run=run_serve)


def workers(text: str) -> int:
    count = int(text)
    if not 1 <= count <= MAX_WORKERS:
        raise argparse.ArgumentTypeError(f"must be 1 to {MAX_WORKERS}, got {count}")
    return count


def worker_timeout(text: str) -> float:
    seconds = positive_float(text)
    if seconds < MIN_WORKER_TIMEOUT_S:
        raise argparse.ArgumentTypeError(f"must be at least {MIN_WORKER_TIMEOUT_S:g} s, got {text}")
    return seconds


def run_serve(args: argparse.Namespace) -> int:
    from crossover.gateway.config import SettingsError, load_settings
    from crossover.gateway.serve.server import make_server
    from crossover.gateway.serve.workers import check_workers, serve_workers

    try:
        settings = load_settings(args.config)
        if args.workers is not None:
            settings = settings.model_copy(update={"workers": args.workers})
        if args.worker_timeout is not None:
            settings = settings.model_copy(update={"worker_timeout": args.worker_timeout})
        host = args.host or settings.host
        port = settings.port if args.port is None else args.port
        if settings.workers > 1:
            check_workers(settings)
        else:
            server = make_server(settings, host, port)
    except (SettingsError, ValueError) as exc:
        print(f"crossover serve: {_one_line(args.config, exc)}", file=sys.stderr)
        return 2
    if (error := listen_error(host, port)) is not None:
        print(f"crossover serve: {error}", file=sys.stderr)
        return 2
    if settings.workers > 1:
        return serve_workers(settings, host, port)
    server.run()
    return 130 if server.interrupted else 0  # 128 + SIGINT, as a shell reports Ctrl-C


def _one_line(config: Path | None, error: Exception) -> str:
    """A settings error on one line: its problems joined, and with no --config, what to pass."""
    head, *problems = str(error).splitlines()
    listed = "; ".join(line.strip() for line in problems)
    if config is not None:
        return f"{head} {listed}" if listed else head
    return (
        "no --config FILE given (every setting, commented: gateway/example.toml; stand-in examples: "
        f"servers/gateway_configs/) and the CROSSOVER_* environment alone is not enough: {listed or head}"
    )
