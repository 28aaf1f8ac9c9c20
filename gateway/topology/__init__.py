"""The deployment's shape behind one interface: partitioned pools, a time-shared GPU set, or in-engine gates;
the live routing state they share."""

from __future__ import annotations

from crossover.gateway.topology.factory import make_topology
from crossover.gateway.topology.gates import GateSync
from crossover.gateway.topology.interface import ModeLease, Topology
from crossover.gateway.topology.routing import Routing
from crossover.gateway.topology.switching import SwitchUnavailable

__all__ = ["GateSync", "ModeLease", "Routing", "SwitchUnavailable", "Topology", "make_topology"]
