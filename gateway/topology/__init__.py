"""The deployment's shape behind one interface: partitioned pools, a time-shared GPU set, or in-engine gates;
the live routing state they share; the adaptive controller that moves its threshold."""

from __future__ import annotations

from crossover.gateway.topology.adaptive import AdaptiveController
from crossover.gateway.topology.factory import make_topology
from crossover.gateway.topology.gates import GateSync
from crossover.gateway.topology.interface import ModeLease, Topology
from crossover.gateway.topology.routing import Routing
from crossover.gateway.topology.switching import SwitchUnavailable

__all__ = ["AdaptiveController", "GateSync", "ModeLease", "Routing", "SwitchUnavailable", "Topology", "make_topology"]
