"""The admin API: never open, strict about what it accepts, and the gateway keeps serving whatever it gets."""

from __future__ import annotations

import httpx
import pytest

from crossover.gateway.admin import ThresholdUpdate, parse_body
from crossover.gateway.errors import InvalidRequest
from tests.gateway.gateway_helpers import chat

TOKEN = "s3cret-token"
AUTH = {"authorization": f"Bearer {TOKEN}"}


def test_without_a_configured_token_the_admin_api_is_disabled(sims, gateway):
    speculative, plain = sims
    gw = gateway([speculative.url], [plain.url])
    with httpx.Client(base_url=gw.url, timeout=10, trust_env=False) as client:
        for method, path in (("GET", "/admin/threshold"), ("PUT", "/admin/threshold"), ("GET", "/admin/state")):
            response = client.request(method, path, json={"threshold": 1}, headers={"authorization": "Bearer x"})
            assert response.status_code == 403, path
            assert response.json()["error"]["code"] == "admin_disabled"
    assert gw.state.routing.threshold == 32


def test_missing_or_wrong_tokens_get_401(sims, gateway):
    speculative, plain = sims
    gw = gateway([speculative.url], [plain.url], admin_token=TOKEN)
    with httpx.Client(base_url=gw.url, timeout=10, trust_env=False) as client:
        for headers in (
            {},
            {"authorization": "Bearer wrong"},
            {"authorization": f"Basic {TOKEN}"},
            {"authorization": TOKEN},
        ):
            response = client.put("/admin/threshold", json={"threshold": 1}, headers=headers)
            assert response.status_code == 401, headers
            assert response.headers["www-authenticate"] == "Bearer"
            assert response.json()["error"]["type"] == "authentication_error"
        assert client.get("/admin/state").status_code == 401
    assert gw.state.routing.threshold == 32


def test_reading_and_changing_the_threshold(sims, gateway):
    speculative, plain = sims
    gw = gateway([speculative.url], [plain.url], admin_token=TOKEN, policy="switch", threshold=10, hysteresis=2)
    with httpx.Client(base_url=gw.url, timeout=10, trust_env=False) as client:
        assert client.get("/admin/threshold", headers=AUTH).json() == {
            "threshold": 10,
            "hysteresis": 2,
            "policy": "switch",
            "side": "speculative",
            "priority_headroom": 64,
            "spillover_share": 0.0,
            "load_signal": "local",
            "loads": {"speculative": 0, "plain": 0},
        }
        changed = client.put("/admin/threshold", json={"threshold": 24}, headers=AUTH)
        assert changed.status_code == 200
        assert (changed.json()["threshold"], changed.json()["hysteresis"]) == (24, 2)
        both = client.put(
            "/admin/threshold", json={"threshold": 5, "hysteresis": 0, "policy": "spillover"}, headers=AUTH
        ).json()
        assert (both["threshold"], both["hysteresis"], both["policy"]) == (5, 0, "spillover")
        assert client.get("/admin/threshold", headers=AUTH).json()["threshold"] == 5

        state = client.get("/admin/state", headers=AUTH).json()
        assert state["threshold"] == 5 and state["inflight"] == 0 and state["models"] == ["moonshotai/Kimi-K2.5"]
        backend = state["pools"]["speculative"]["backends"][0]
        assert backend["url"] == speculative.url and backend["healthy"] is True and backend["inflight"] == 0
        assert state["pools"]["plain"]["backends"][0]["url"] == plain.url
    assert gw.metric("crossover_routing_threshold") == 5


INVALID_UPDATES = [
    (b'{"threshold": -1}', "threshold"),
    (b'{"threshold": 3.5}', "threshold"),
    (b'{"threshold": "7"}', "threshold"),
    (b'{"threshold": true}', "threshold"),
    (b'{"threshold": null}', "threshold"),
    (b'{"hysteresis": 12}', "hysteresis"),  # not below the threshold of 10
    (b'{"threshold": 8, "policy": "fastest"}', "policy"),
    (b'{"treshold": 8}', "treshold"),
    (b"{}", None),  # no field is at fault: one is missing
    (b'{"threshold": 1' + b"0" * 400 + b"}", "threshold"),  # bounded, so /metrics and the state file stay sane
    (b'{"threshold": 1e3}', "threshold"),
    (b"[8]", None),
    (b'{"threshold": ', None),
]


def test_invalid_threshold_updates_are_400_and_change_nothing(sims, gateway):
    speculative, plain = sims
    gw = gateway([speculative.url], [plain.url], admin_token=TOKEN, threshold=10, hysteresis=2)
    with httpx.Client(base_url=gw.url, timeout=10, trust_env=False) as client:
        for body, param in INVALID_UPDATES:
            response = client.put("/admin/threshold", content=body, headers=AUTH)
            assert response.status_code == 400, (body, response.text)
            error = response.json()["error"]
            assert error["type"] == "invalid_request_error" and error["param"] == param and error["message"], body
            assert client.get("/admin/threshold", headers=AUTH).json()["threshold"] == 10
            assert client.post("/v1/chat/completions", json=chat()).status_code == 200


def test_a_huge_admin_body_is_413(sims, gateway):
    speculative, plain = sims
    gw = gateway([speculative.url], [plain.url], admin_token=TOKEN)
    with httpx.Client(base_url=gw.url, timeout=10, trust_env=False) as client:
        response = client.put("/admin/threshold", content=b" " * 100_000 + b'{"threshold": 1}', headers=AUTH)
        assert response.status_code == 413
        assert client.get("/admin/threshold", headers=AUTH).json()["threshold"] == 32


def test_a_threshold_update_accepts_each_field_alone():
    assert parse_body(ThresholdUpdate, b'{"hysteresis": 0}').hysteresis == 0
    assert parse_body(ThresholdUpdate, b'{"policy": "switch"}').policy == "switch"
    with pytest.raises(InvalidRequest) as caught:
        parse_body(ThresholdUpdate, b'{"threshold": 2000000}')
    assert caught.value.param == "threshold"
