"""A time-shared GPU set's switches: the controller and what it runs (mechanisms, the switch queue, recovery,
backoff, adoption at start-up, the replicas' part)."""

from __future__ import annotations

from crossover.gateway.topology.switching.controller import ACTIVE_MODE, Lease, SwitchController, SwitchUnavailable
from crossover.gateway.topology.switching.replicas import ModeRequests

__all__ = ["ACTIVE_MODE", "Lease", "ModeRequests", "SwitchController", "SwitchUnavailable"]
