"""`--apply` against the real gateway's admin API (no stand-ins needed: the admin API does not route)."""

from __future__ import annotations

import httpx
import pytest

from crossover.gateway.app import create_app
from crossover.gateway.config import Settings
from crossover.loadtest.apply import ApplyError, apply_threshold, policy_of

TOKEN = "apply-test-token"
RECOMMENDED = {"switch": 7, "spillover": 3}


UNUSED = "http://127.0.0.1:1"  # nothing listens on port 1: a pool that is simply down


def gateway(serve, backend: str, **settings) -> str:
    pools = {"speculative": {"backends": [backend]}, "plain": {"backends": [UNUSED]}}
    return serve(create_app(Settings(admin_token=TOKEN, log_level="warning", pools=pools, **settings))).url


def state(url: str) -> dict:
    return httpx.get(f"{url}/admin/threshold", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10).json()


@pytest.mark.parametrize("policy", ["switch", "spillover"])
def test_apply_sends_the_recommendation_for_the_gateways_policy(serve, backend, policy):
    url = gateway(serve, backend, policy=policy, threshold=32, hysteresis=2)
    applied = apply_threshold(f"{url}/v1", TOKEN, RECOMMENDED)
    assert (applied.policy, applied.old_threshold, applied.new_threshold) == (policy, 32, RECOMMENDED[policy])
    assert state(url)["threshold"] == RECOMMENDED[policy]
    assert state(url)["hysteresis"] == 2


def test_spillovers_share_goes_with_its_threshold_and_only_to_a_spillover_gateway(serve, backend):
    url = gateway(serve, backend, policy="spillover", threshold=32, spillover_share=0.1)
    applied = apply_threshold(url, TOKEN, RECOMMENDED, spillover_share=0.5)
    assert (applied.old_share, applied.new_share) == (0.1, 0.5)
    assert (state(url)["threshold"], state(url)["spillover_share"]) == (3, 0.5)
    apply_threshold(url, TOKEN, RECOMMENDED)  # a results file from before the share was fitted: left as it is
    assert state(url)["spillover_share"] == 0.5
    switching = gateway(serve, backend, policy="switch", threshold=32)
    applied = apply_threshold(switching, TOKEN, RECOMMENDED, spillover_share=0.5)
    assert applied.new_share is None and state(switching)["spillover_share"] == 0.0


def test_apply_narrows_a_hysteresis_band_the_new_threshold_cannot_hold(serve, backend):
    url = gateway(serve, backend, policy="switch", threshold=32, hysteresis=10)
    applied = apply_threshold(url, TOKEN, RECOMMENDED)
    assert (applied.old_hysteresis, applied.new_hysteresis) == (10, 6)
    assert (state(url)["threshold"], state(url)["hysteresis"]) == (7, 6)


def test_a_wrong_token_is_reported_and_changes_nothing(serve, backend):
    url = gateway(serve, backend, policy="switch", threshold=32)
    with pytest.raises(ApplyError, match="HTTP 401"):
        apply_threshold(url, "not-the-token", RECOMMENDED)
    assert state(url)["threshold"] == 32


def test_an_unreachable_gateway_is_reported():
    with pytest.raises(ApplyError, match="cannot reach the gateway"):
        apply_threshold(UNUSED, TOKEN, RECOMMENDED, timeout=2)


def test_a_time_shared_gateway_takes_the_switch_value_whatever_its_routing_policy(serve, backend):
    # Time-shared: the whole GPU set switches, so the spillover cap means nothing there.
    url = gateway(
        serve, backend, policy="spillover", threshold=32, topology="time-shared", switching={"mechanism": "manual"}
    )
    applied = apply_threshold(url, TOKEN, RECOMMENDED)
    assert (applied.policy, state(url)["threshold"]) == ("switch", RECOMMENDED["switch"])


def test_a_gateway_that_names_no_known_policy_is_refused_with_both_values():
    with pytest.raises(ApplyError, match="spillover = 3, switch = 7"):
        policy_of({"topology": "partitioned", "policy": "least-loaded"}, RECOMMENDED)
    with pytest.raises(ApplyError, match="cannot tell"):
        policy_of({}, RECOMMENDED)


def test_a_recommendation_too_close_to_call_is_not_applied(serve, backend):
    url = gateway(serve, backend, policy="switch", threshold=32)
    with pytest.raises(ApplyError, match="no switch threshold was recommended"):
        apply_threshold(url, TOKEN, {"switch": None, "spillover": 3})
    assert state(url)["threshold"] == 32
