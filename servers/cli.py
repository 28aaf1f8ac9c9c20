"""`crossover servers`: placeholder while the subcommands are written."""

from __future__ import annotations

import argparse


def register(subparsers: argparse._SubParsersAction) -> None:
    subparsers.add_parser("servers", help="SGLang deployment profiles: plan, up, down, status, agent")
