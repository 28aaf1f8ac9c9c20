"""The agent's side of the fencing token (gateway/engines/fence.py): the highest token each GPU accepted, on disk.

    fences = AgentFences(profile, state_dir)
    refused = fences.admit("plain", 7)   # None: accepted (and remembered); else the refusal's message

A call on a server is checked against every GPU the server runs on, so servers that share GPUs share a fence
(a server with no GPUs, a stand-in on CPU, is its own). A call that passes raises the fence on all of its GPUs
before the operation begins, whatever the operation then does: the new lease holder's first call shuts the old
one out, even one refused as busy. The tokens are kept per GPU, not per server or per profile, so a profile that
regroups the GPUs later still remembers what each one accepted.

They live in `<state dir>/fence.json`, written (and flushed to disk) before the call is answered, so an agent that
restarts does not forget a token and let a paused ex-leader back in.
"""

from __future__ import annotations

import os
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from crossover.gateway.engines import refusal
from crossover.servers.profile import Profile, Server

FENCE_FILE = "fence.json"


class FenceFile(BaseModel):
    model_config = ConfigDict(extra="ignore")

    # "gpu:<id>" (or "server:<name>" for a server without GPUs) -> the highest token accepted on it.
    highest: dict[str, int] = Field(default_factory=dict)


def fence_keys(server: Server) -> list[str]:
    return [f"gpu:{gpu}" for gpu in server.gpus] or [f"server:{server.name}"]


class AgentFences:
    def __init__(self, profile: Profile, directory: Path) -> None:
        self.profile = profile
        self.path = Path(directory) / FENCE_FILE
        self.highest = self._load()

    def _load(self) -> dict[str, int]:
        try:
            return dict(FenceFile.model_validate_json(self.path.read_text()).highest)
        except FileNotFoundError:
            return {}
        except (OSError, ValidationError) as exc:
            # Starting with no memory of the tokens would let a stale gateway back in: refuse to start instead.
            raise RuntimeError(f"{self.path}: unreadable fencing tokens ({exc}); inspect it, then remove it") from None

    def current(self, name: str) -> int | None:
        """The highest token the server's GPU set accepted, or None (no token yet)."""
        tokens = [self.highest[key] for key in fence_keys(self.profile.server(name)) if key in self.highest]
        return max(tokens, default=None)

    def admit(self, name: str, token: int | None) -> str | None:
        """None if a call on `name` carrying `token` passes (a call without one always does), else why not."""
        if token is None:
            return None
        highest = self.current(name)
        if highest is not None and token < highest:
            return refusal(token, highest)
        keys = fence_keys(self.profile.server(name))
        if any(self.highest.get(key) != token for key in keys):
            self.highest.update(dict.fromkeys(keys, token))
            self._save()
        return None

    def _save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        with open(tmp, "w") as file:
            file.write(FenceFile(highest=self.highest).model_dump_json(indent=2))
            file.flush()
            os.fsync(file.fileno())
        os.replace(tmp, self.path)
