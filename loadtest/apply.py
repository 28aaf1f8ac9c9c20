"""`--apply`: send the recommended threshold for the gateway's current policy to its admin API.

    GET /admin/state      -> {"topology": "partitioned", "policy": "switch", "threshold": 32, "hysteresis": 4, ...}
    PUT /admin/threshold     {"threshold": 7}   (Authorization: Bearer TOKEN)

A bench run recommends one threshold per policy, and they differ (switch sends everything to one pool, so it
is the crossover; spillover caps the speculative pool, so it is usually far lower). Which one applies is the
gateway's to say: a time-shared gateway switches its whole GPU set, so it takes the switch value whatever its
routing policy reads; a partitioned one takes its policy's. A gateway that names neither is refused, with both
values, rather than guessed at.

The gateway keeps its hysteresis band below the threshold; if the new threshold would leave no room for the
current band, the band is narrowed to threshold - 1 (and said so) rather than the change being refused.
"""

from __future__ import annotations

from dataclasses import dataclass

import httpx

from crossover.gateway.policies import PolicyName

DEFAULT_ADMIN_TIMEOUT_S = 10.0


class ApplyError(Exception):
    """The gateway could not be reached or refused the change; the message says which."""


@dataclass(frozen=True)
class Applied:
    policy: PolicyName
    old_threshold: int
    new_threshold: int
    old_hysteresis: int | None
    new_hysteresis: int | None
    old_share: float | None = None  # spillover's share, where it was sent
    new_share: float | None = None


def _check(response: httpx.Response, what: str) -> dict:
    if response.status_code != 200:
        raise ApplyError(f"{what}: HTTP {response.status_code}: {response.text[:300]}")
    try:
        return response.json()
    except ValueError:
        raise ApplyError(f"{what}: answer is not JSON: {response.text[:300]}") from None


def policy_of(state: dict, recommended: dict[str, int | None]) -> PolicyName:
    """Which recommendation fits the gateway whose /admin/state is `state`; ApplyError if it cannot be told."""
    policy = "switch" if state.get("topology") == "time-shared" else state.get("policy")
    offered = ", ".join(f"{name} = {value}" for name, value in sorted(recommended.items()))
    if policy not in recommended:
        raise ApplyError(
            f"cannot tell which threshold fits the gateway (topology {state.get('topology')!r}, policy "
            f"{state.get('policy')!r}); recommended: {offered}. Set one with PUT /admin/threshold."
        )
    if recommended[policy] is None:
        raise ApplyError(f"the gateway uses the {policy} policy, and no {policy} threshold was recommended ({offered})")
    return policy


def apply_threshold(
    gateway_url: str,
    token: str,
    recommended: dict[str, int | None],
    timeout: float = DEFAULT_ADMIN_TIMEOUT_S,
    spillover_share: float | None = None,
) -> Applied:
    """PUT the recommendation for the gateway's policy; spillover's share goes with its threshold (null: a
    results file from before the share was fitted, which leaves the gateway's as it is)."""
    base = gateway_url.rstrip("/").removesuffix("/v1")
    url = base + "/admin/threshold"
    headers = {"Authorization": f"Bearer {token}"}
    try:
        with httpx.Client(timeout=timeout) as client:
            state = _check(client.get(base + "/admin/state", headers=headers), f"GET {base}/admin/state")
            policy = policy_of(state, recommended)
            threshold = recommended[policy]
            assert threshold is not None  # policy_of refuses a missing value
            hysteresis = state.get("hysteresis")
            change: dict[str, float] = {"threshold": threshold}
            if hysteresis and hysteresis >= threshold:
                change["hysteresis"] = max(threshold - 1, 0)
            share = spillover_share if policy == "spillover" else None
            if share is not None:
                change["spillover_share"] = share
            new_state = _check(client.put(url, headers=headers, json=change), f"PUT {url}")
    except httpx.HTTPError as exc:
        raise ApplyError(f"cannot reach the gateway at {base}: {exc}") from None
    if new_state.get("threshold") != threshold:
        raise ApplyError(f"gateway answered threshold {new_state.get('threshold')!r}, expected {threshold}")
    return Applied(
        policy=policy,
        old_threshold=state.get("threshold"),
        new_threshold=threshold,
        old_hysteresis=hysteresis,
        new_hysteresis=new_state.get("hysteresis"),
        old_share=None if share is None else state.get("spillover_share"),
        new_share=share,
    )
