"""The `crossover` command. Each package registers its own subcommands through the `crossover.commands`
entry points (pyproject.toml), so this dispatcher depends on none of them; heavy imports wait until a
subcommand runs."""

from __future__ import annotations

import argparse
import sys
from importlib.metadata import entry_points

COMMAND_GROUP = "crossover.commands"


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
