"""The GPU-host agent's contract, said once: what the agent answers, the gateway reads and the supervisor reports.

    status = ServerStatus(name="plain", role="plain", state="ready", pid=123, url="http://10.0.0.5:30001")
    ServerStatus.model_validate_json(response.content)   # the gateway's side
    python -m crossover.gateway.engines.agent_contract      # rewrites gateway/engines/agent_contract.schema.json

It lives in `crossover.gateway` because the gateway (the lowest layer) reads it; `crossover.servers` imports it.
"""

from __future__ import annotations

import json
import typing
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict
from pydantic.json_schema import models_json_schema

from crossover.gateway.modes import Mode

# stopped: no process. starting: spawned, no 1-token generation yet. ready: it generated. released: its GPU
# memory is handed back (sleep). stopping: SIGTERM sent, its group not gone yet. releasing / resuming: a release
# or resume of its memory is under way. failed: exited on its own, or the last start or stop of it failed (`error`
# says which and why).
ServerState = Literal["stopped", "starting", "ready", "released", "stopping", "releasing", "resuming", "failed"]
SERVER_STATES: tuple[ServerState, ...] = typing.get_args(ServerState)
# What a gateway may ask of a server; each carries the lease's fencing token (gateway/engines/fence.py) when there is
# one.
Operation = Literal["start", "stop", "release", "resume"]
OPERATIONS: tuple[Operation, ...] = typing.get_args(Operation)

# Where the agent and the gateway look for the token when it is not given otherwise. The agent never passes
# it on to the servers it starts.
TOKEN_ENV = "CROSSOVER_AGENT_TOKEN"


class ServerStatus(BaseModel):
    """GET /servers/{name}, and the answer to POST /servers/{name}/start|stop (202) and /release|resume (200)."""

    # The gateway ignores fields a newer agent adds; the agent never sends one it does not know.
    model_config = ConfigDict(extra="ignore")

    name: str
    role: Mode
    state: ServerState
    pid: int | None = None
    url: str
    last_start_s: float | None = None
    error: str | None = None


class ServerList(BaseModel):
    """GET /servers."""

    servers: list[ServerStatus]


def schema() -> dict:
    """The JSON Schema of the contract (checked in as agent_contract.schema.json; a test keeps them in step)."""
    _, definitions = models_json_schema(
        [(ServerStatus, "validation"), (ServerList, "validation")], title="crossover GPU-host agent contract"
    )
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", **definitions}


SCHEMA_FILE = Path(__file__).with_name("agent_contract.schema.json")


def render_schema() -> str:
    return json.dumps(schema(), indent=2) + "\n"


if __name__ == "__main__":
    SCHEMA_FILE.write_text(render_schema())
