"""The live routing state an operator changes through the admin API, and the decision it makes.

With `state_file` set, live changes are saved (write-then-rename) and restored at the next start. Restoring
only reads: a read-only directory (a ConfigMap, a StateDirectory= owned by another user) serves the saved
values. A file that cannot be read or holds nonsense is no reason to stay down: the configured values serve,
a warning says why, and the problem stays visible (`state_file_problem`: /admin/state and
crossover_state_file_problem) until a save succeeds. A save that fails leaves the change live and says so.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from crossover.gateway.backends import Pools
from crossover.gateway.config import (
    DEFAULT_PRIORITY_HEADROOM,
    DEFAULT_SPILLOVER_SHARE,
    MAX_THRESHOLD,
    PLAIN,
    SPECULATIVE,
    Settings,
    ThresholdError,
    check_threshold,
    fit_hysteresis,
)
from crossover.gateway.policies import POLICIES, Decision, for_tier

log = logging.getLogger("crossover.routing")


@dataclass
class Routing:
    policy: str
    threshold: int
    hysteresis: int
    # The side the switch policy chose last; an input to the next decision, kept here between requests.
    side: str = SPECULATIVE
    state_file: Path | None = None
    # Why the state file was not restored at start, or the last save failed; None once a save succeeds.
    state_file_problem: str | None = None
    # The speculative pool's load below which a `priority` request goes there, whatever the threshold: this
    # (per speculative server, as [routing] priority_headroom and PUT /admin/threshold give it) times the servers.
    priority_headroom: int = DEFAULT_PRIORITY_HEADROOM
    speculative_servers: int = 1
    # Spillover: the speculative pool also takes requests below this share of all in flight (route.py's spillover).
    spillover_share: float = DEFAULT_SPILLOVER_SHARE
    # An operator's PUT /admin/threshold pinned the threshold: the adaptive controller holds until resumed.
    adaptive_paused: bool = False
    # The leader's adaptive decision and move as the cluster's state carries them (Control.adaptive).
    adaptive_shared: dict | None = None

    @classmethod
    def from_settings(cls, settings: Settings) -> Routing:
        routing = cls(
            settings.policy,
            settings.threshold,
            settings.hysteresis,
            state_file=settings.state_file,
            priority_headroom=settings.priority_headroom,
            speculative_servers=len(settings.pools.speculative.backends),
            spillover_share=settings.spillover_share,
        )
        if routing.state_file is not None and routing.state_file.exists():
            try:
                routing._restore(routing.state_file)
            except ValueError as exc:
                routing.state_file_problem = str(exc)
                log.warning("%s; serving the configured threshold %d instead", exc, routing.threshold)
        return routing

    def decide(self, pools: Pools, tier: str | None = None) -> Decision:
        """The policy's decision for the load, then the request's service tier's (`for_tier`). The side the switch
        policy keeps is the load's: a tiered request moves itself, not the requests after it."""
        decision = POLICIES[self.policy](pools, self.threshold, self.hysteresis, self.spillover_share, self.side)
        self.side = decision.pool
        if tier is None:
            return decision
        room = self.priority_headroom * self.speculative_servers
        return for_tier(decision, tier, pools.pool_load(SPECULATIVE), room, pools.usable(PLAIN))

    def update(
        self,
        threshold: int | None = None,
        hysteresis: int | None = None,
        policy: str | None = None,
        priority_headroom: int | None = None,
        spillover_share: float | None = None,
    ) -> None:
        """Apply a live change (all or nothing) and save it; raise ThresholdError naming the field at fault, or
        OSError if the change applies but cannot be saved."""
        self._apply(threshold, hysteresis, policy, priority_headroom, spillover_share)
        if self.state_file is not None:
            try:
                self._persist(self.state_file)
            except OSError as exc:
                self.state_file_problem = f"state_file {self.state_file} cannot be saved: {exc}"
                log.warning("%s; the change is live until the gateway restarts", self.state_file_problem)
                raise
            self.state_file_problem = None

    def _apply(
        self,
        threshold: int | None,
        hysteresis: int | None,
        policy: str | None,
        priority_headroom: int | None = None,
        spillover_share: float | None = None,
    ) -> None:
        new_threshold = self.threshold if threshold is None else threshold
        # A new threshold alone keeps the band, narrowed if it no longer fits under the threshold.
        new_hysteresis = fit_hysteresis(new_threshold, self.hysteresis) if hysteresis is None else hysteresis
        new_policy = self.policy if policy is None else policy
        if new_policy not in POLICIES:
            raise ThresholdError("policy", f"policy must be one of {', '.join(POLICIES)}, got {new_policy!r}")
        check_threshold(new_threshold, new_hysteresis)
        headroom = self.priority_headroom if priority_headroom is None else priority_headroom
        if not 0 <= headroom <= MAX_THRESHOLD:
            raise ThresholdError(
                "priority_headroom", f"priority_headroom must be between 0 and {MAX_THRESHOLD}, got {headroom}"
            )
        share = self.spillover_share if spillover_share is None else spillover_share
        if not 0.0 <= share <= 1.0:  # also NaN
            raise ThresholdError("spillover_share", f"spillover_share must be between 0 and 1, got {share}")
        self.threshold, self.hysteresis, self.policy = new_threshold, new_hysteresis, new_policy
        self.priority_headroom, self.spillover_share = headroom, share

    def state(self) -> dict:
        view = {
            "threshold": self.threshold,
            "hysteresis": self.hysteresis,
            "policy": self.policy,
            "side": self.side,
            "priority_headroom": self.priority_headroom,
            "spillover_share": self.spillover_share,
        }
        if self.state_file is not None:
            view["state_file"] = {"path": str(self.state_file), "problem": self.state_file_problem}
        return view

    def _persist(self, path: Path) -> None:
        # Write-then-rename so a crash never leaves a half-written file for the next start to trip on.
        saved = {"threshold": self.threshold, "hysteresis": self.hysteresis, "policy": self.policy}
        payload = json.dumps(
            {**saved, "priority_headroom": self.priority_headroom, "spillover_share": self.spillover_share}
        )
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
            headroom = saved.get("priority_headroom")  # absent from files saved before it was live
            if headroom is not None and (not isinstance(headroom, int) or isinstance(headroom, bool)):
                raise TypeError("priority_headroom is not an integer")
            share = saved.get("spillover_share")  # absent from files saved before it existed
            if share is not None and (not isinstance(share, int | float) or isinstance(share, bool)):
                raise TypeError("spillover_share is not a number")
            # Read, not written.
            self._apply(saved.get("threshold"), saved.get("hysteresis"), saved.get("policy"), headroom, share)
        except (OSError, ValueError, AttributeError, TypeError) as exc:
            raise ValueError(f"state_file {path} cannot be restored: {exc}") from exc
