"""The `crossover` command. Each package registers its own subcommands; heavy imports stay inside them."""

from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    from gateway import commands as gateway_commands
    from loadtest import cli as loadtest_cli
    from servers.sim import cli as sim_cli

    parser = argparse.ArgumentParser(
        prog="crossover",
        description="Serve one model with and without speculative decoding behind one OpenAI-compatible URL.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    gateway_commands.register(sub)
    sim_cli.register(sub)
    loadtest_cli.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.run(args) or 0


if __name__ == "__main__":
    sys.exit(main())
