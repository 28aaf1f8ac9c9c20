"""The live routing state an operator changes through the admin API, and the decision it makes."""

from __future__ import annotations

import json
import os
import tempfile
import typing
from dataclasses import dataclass
from pathlib import Path

from crossover.gateway.config import SPECULATIVE, Policy, Settings, ThresholdError, check_threshold, fit_hysteresis
from crossover.gateway.policy import IN_ENGINE, Decision, spillover, switch
from crossover.gateway.pools import Pools

POLICIES: tuple[Policy, ...] = typing.get_args(Policy)


@dataclass
class Routing:
    policy: str
    threshold: int
    hysteresis: int
    # The side the switch policy chose last; an input to the next decision, kept here between requests.
    side: str = SPECULATIVE
    state_file: Path | None = None
    # In-engine: one pool; the threshold moves the engines' gate instead (gateway/in_engine.py).
    one_pool: bool = False

    @classmethod
    def from_settings(cls, settings: Settings) -> Routing:
        routing = cls(
            settings.policy,
            settings.threshold,
            settings.hysteresis,
            state_file=settings.state_file,
            one_pool=settings.topology == "in-engine",
        )
        if routing.state_file is not None and routing.state_file.exists():
            routing._restore(routing.state_file)
        return routing

    def decide(self, pools: Pools) -> Decision:
        if self.one_pool:
            return Decision(SPECULATIVE, IN_ENGINE)
        if self.policy == "spillover":
            return spillover(pools.pool_load(SPECULATIVE), self.threshold)
        decision = switch(pools.total_load(), self.threshold, self.hysteresis, self.side)
        self.side = decision.pool
        return decision

    def update(self, threshold: int | None = None, hysteresis: int | None = None, policy: str | None = None) -> None:
        """Apply a live change (all or nothing); raise ThresholdError naming the field at fault."""
        new_threshold = self.threshold if threshold is None else threshold
        # A new threshold alone keeps the band, narrowed if it no longer fits under the threshold.
        new_hysteresis = fit_hysteresis(new_threshold, self.hysteresis) if hysteresis is None else hysteresis
        new_policy = self.policy if policy is None else policy
        if new_policy not in POLICIES:
            raise ThresholdError("policy", f"policy must be one of {', '.join(POLICIES)}, got {new_policy!r}")
        check_threshold(new_threshold, new_hysteresis)
        self.threshold, self.hysteresis, self.policy = new_threshold, new_hysteresis, new_policy
        if self.state_file is not None:
            self._persist(self.state_file)

    def state(self) -> dict:
        return {"threshold": self.threshold, "hysteresis": self.hysteresis, "policy": self.policy, "side": self.side}

    def _persist(self, path: Path) -> None:
        # Write-then-rename so a crash never leaves a half-written file for the next start to trip on.
        payload = json.dumps({"threshold": self.threshold, "hysteresis": self.hysteresis, "policy": self.policy})
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
        with os.fdopen(fd, "w") as file:
            file.write(payload + "\n")
        os.replace(tmp, path)

    def _restore(self, path: Path) -> None:
        try:
            saved = json.loads(path.read_text())
            for key in ("threshold", "hysteresis"):
                if not isinstance(saved.get(key), int) or isinstance(saved.get(key), bool):
                    raise TypeError(f"{key} is not an integer")
            self.update(saved.get("threshold"), saved.get("hysteresis"), saved.get("policy"))
        except (OSError, ValueError, AttributeError, TypeError) as exc:
            raise ValueError(f"state_file {path} cannot be restored: {exc}") from exc
