"""`--apply`: send the recommended threshold for the gateway's current policy to its admin API.

    GET /admin/threshold  -> {"policy": "switch", "threshold": 32, "hysteresis": 4, ...}
    PUT /admin/threshold     {"threshold": 7}   (Authorization: Bearer TOKEN)

The gateway keeps its hysteresis band below the threshold; if the new threshold would leave no room for the
current band, the band is narrowed to threshold - 1 (and said so) rather than the change being refused.
"""

from __future__ import annotations

from dataclasses import dataclass

import httpx

DEFAULT_ADMIN_TIMEOUT_S = 10.0


class ApplyError(Exception):
    """The gateway could not be reached or refused the change; the message says which."""


@dataclass(frozen=True)
class Applied:
    policy: str
    old_threshold: int
    new_threshold: int
    old_hysteresis: int | None
    new_hysteresis: int | None


def _check(response: httpx.Response, what: str) -> dict:
    if response.status_code != 200:
        raise ApplyError(f"{what}: HTTP {response.status_code}: {response.text[:300]}")
    try:
        return response.json()
    except ValueError:
        raise ApplyError(f"{what}: answer is not JSON: {response.text[:300]}") from None


def apply_threshold(
    gateway_url: str, token: str, recommended: dict[str, int], timeout: float = DEFAULT_ADMIN_TIMEOUT_S
) -> Applied:
    url = gateway_url.rstrip("/").removesuffix("/v1") + "/admin/threshold"
    headers = {"Authorization": f"Bearer {token}"}
    try:
        with httpx.Client(timeout=timeout) as client:
            state = _check(client.get(url, headers=headers), f"GET {url}")
            policy = state.get("policy")
            if policy not in recommended:
                raise ApplyError(f"gateway policy {policy!r} has no recommendation (have {sorted(recommended)})")
            threshold = recommended[policy]
            hysteresis = state.get("hysteresis")
            change: dict[str, int] = {"threshold": threshold}
            if hysteresis and hysteresis >= threshold:
                change["hysteresis"] = max(threshold - 1, 0)
            new_state = _check(client.put(url, headers=headers, json=change), f"PUT {url}")
    except httpx.HTTPError as exc:
        raise ApplyError(f"cannot reach the gateway at {url}: {exc}") from None
    if new_state.get("threshold") != threshold:
        raise ApplyError(f"gateway answered threshold {new_state.get('threshold')!r}, expected {threshold}")
    return Applied(
        policy=policy,
        old_threshold=state.get("threshold"),
        new_threshold=threshold,
        old_hysteresis=hysteresis,
        new_hysteresis=new_state.get("hysteresis"),
    )
