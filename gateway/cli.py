"""The `crossover` command. Each package registers its own subcommands through the `crossover.commands`
entry points (pyproject.toml), so this dispatcher depends on none of them; heavy imports wait until a
subcommand runs. The argument types every subcommand shares live here too, so a port or a list of
concurrencies is checked, and explained, the same way everywhere:

    parser.add_argument("--port", type=port)
    parser.add_argument("--concurrency", type=positive_int_list)
"""

from __future__ import annotations

import argparse
import errno
import json
import socket
import sys
from importlib.metadata import entry_points
from typing import Literal, get_args

COMMAND_GROUP = "crossover.commands"
# Uvicorn's log levels: the gateway's `log_level` and every server command's --log-level.
LogLevel = Literal["critical", "error", "warning", "info", "debug"]
LOG_LEVELS: tuple[LogLevel, ...] = get_args(LogLevel)


def port(text: str) -> int:
    value = _number(int, text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{text} is not a TCP port (0-65535)")
    return value


def positive_int(text: str) -> int:
    value = _number(int, text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def non_negative_int(text: str) -> int:
    value = _number(int, text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def positive_float(text: str) -> float:
    value = _number(float, text)
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def non_negative_float(text: str) -> float:
    value = _number(float, text)
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return value


def positive_int_list(text: str) -> list[int]:
    """`1,2,5,10` -> [1, 2, 5, 10]."""
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or any(value <= 0 for value in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def json_string_map(text: str) -> dict[str, str]:
    """`{"variant": "eagle3"}` -> a dict of strings."""
    try:
        value = json.loads(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}") from None
    if not isinstance(value, dict) or not all(isinstance(item, str) for item in value.values()):
        raise argparse.ArgumentTypeError('expected a JSON object of strings, e.g. {"variant": "eagle3"}')
    return value


def listen_error(host: str, port: int) -> str | None:
    """Why a server could not listen on host:port now, or None. Asked before anything starts: a port in use
    is then one line that says what to do, not a server's start-up failure (uvicorn exits 3 after its
    lifespan ran, and under asyncio.run a traceback of that exit follows)."""
    if port == 0:
        return None
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
    except socket.gaierror as exc:
        return f"cannot listen on {host}: {exc.strerror}"
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(
            socket.SOL_SOCKET, socket.SO_REUSEADDR, 1
        )  # as uvicorn binds: a closed port's TIME_WAIT is no use
        try:
            probe.bind(address)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return f"{host}:{port} is already in use: stop what listens there, or pass another --port"
            return f"cannot listen on {host}:{port}: {exc.strerror}"
    return None


def _number(kind: type, text: str):
    try:
        return kind(text)
    except ValueError:
        name = "an integer" if kind is int else "a number"
        raise argparse.ArgumentTypeError(f"expected {name}, got {text!r}") from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="crossover",
        description="Serve one model with and without speculative decoding behind one OpenAI-compatible URL.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for entry in sorted(entry_points(group=COMMAND_GROUP), key=lambda entry: entry.name):
        entry.load()(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.run(args) or 0


if __name__ == "__main__":
    sys.exit(main())
