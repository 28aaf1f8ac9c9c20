"""`crossover bench ...` in this process, as a user calls it: `assert crossover("bench", "--target", ...) == 0`."""

from __future__ import annotations

import argparse

from crossover.loadtest import cli


def crossover(*argv: str) -> int:
    """The exit status `crossover ARGV` would have (argparse's own errors exit 2 too)."""
    parser = argparse.ArgumentParser(prog="crossover")
    cli.register(parser.add_subparsers(dest="command", required=True))
    try:
        args = parser.parse_args(list(argv))
    except SystemExit as exit_:
        return exit_.code
    return args.run(args)
