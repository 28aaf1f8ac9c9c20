"""`crossover serve`: the uvicorn server, the workers' supervisor, the command."""

from __future__ import annotations

from crossover.gateway.serve.commands import register
from crossover.gateway.serve.server import make_server

__all__ = ["make_server", "register"]
