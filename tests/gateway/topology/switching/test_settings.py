"""The time-shared settings ([switching], topology) and the operator's mode API: errors that say what to fix."""

from __future__ import annotations

import httpx
import pytest

from crossover.gateway.config import (
    DEFAULT_RESTART_COST_S,
    DEFAULT_SLEEP_COST_S,
    SettingsError,
    load_settings,
)
from tests.gateway.topology.switching.test_controller import AUTH, TOKEN, wait_phase

ONE_EACH = """
[pools.speculative]
backends = ["http://127.0.0.1:30001"]
[pools.plain]
backends = ["http://127.0.0.1:30002"]
"""
RESTART = """
topology = "time-shared"
[switching]
mechanism = "restart"
agent_url = "http://10.0.0.5:9000/"
agent_servers = { speculative = "k25-eagle3", plain = "k25-plain" }
"""


@pytest.fixture(autouse=True)
def no_crossover_env(monkeypatch):
    import os

    for name in list(os.environ):
        if name.startswith("CROSSOVER_"):
            monkeypatch.delenv(name)


def load(tmp_path, text: str):
    path = tmp_path / "crossover.toml"
    path.write_text(text)
    return load_settings(path)


def test_a_time_shared_restart_setup_with_the_token_from_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("CROSSOVER_AGENT_TOKEN", "from-env")
    settings = load(tmp_path, RESTART + ONE_EACH)
    switching = settings.switching
    assert settings.topology == "time-shared"
    assert switching.agent_token == "from-env"
    assert switching.agent_url == "http://10.0.0.5:9000"
    assert switching.initial_cost == DEFAULT_RESTART_COST_S  # the mechanism's own prior, left out
    assert load(tmp_path, 'topology = "time-shared"\n' + ONE_EACH).switching.initial_cost == DEFAULT_SLEEP_COST_S


@pytest.mark.parametrize(
    ("text", "words"),
    [
        (
            'topology = "time-shared"\n[pools.speculative]\nbackends = ["http://a:1", "http://a:2"]\n'
            '[pools.plain]\nbackends = ["http://b:1"]\n',
            "exactly one backend per pool",
        ),
        (RESTART + ONE_EACH, "needs switching.agent_token or $CROSSOVER_AGENT_TOKEN"),
        (
            RESTART.replace('agent_url = "http://10.0.0.5:9000/"', 'agent_token = "t"') + ONE_EACH,
            "needs switching.agent_url",
        ),
        (
            RESTART.replace('plain = "k25-plain"', 'plain = "k25-eagle3"').replace(
                "[switching]", '[switching]\nagent_token = "t"'
            )
            + ONE_EACH,
            "the same server for both modes",
        ),
        (
            RESTART.replace('mechanism = "restart"', 'mechanism = "sleep"\nagent_token = "t"').replace(
                'agent_servers = { speculative = "k25-eagle3", plain = "k25-plain" }', ""
            )
            + ONE_EACH,
            "'sleep' with agent_url needs switching.agent_servers",
        ),
        ('[switching]\nmechanism = "hibernate"\n' + ONE_EACH, "'restart', 'sleep' or 'manual'"),
        ('[switching]\nagent_url = "10.0.0.5:9000"\n' + ONE_EACH, "not an agent URL"),
        ("[switching]\nqueue_timeout = 0.5\ninterval = 1.0\n" + ONE_EACH, "must be at least interval"),
        ("[switching]\ndwell = -1\n" + ONE_EACH, "greater than or equal to 0"),
        ('topology = "shared"\n' + ONE_EACH, "'partitioned', 'time-shared' or 'in-engine'"),
    ],
)
def test_invalid_switching_settings_say_what_to_fix(tmp_path, text, words):
    with pytest.raises(SettingsError) as caught:
        load(tmp_path, text)
    assert words in str(caught.value), str(caught.value)


def test_the_mode_api_checks_its_caller_and_its_body(sims, gateway):
    speculative, plain = sims
    gw = gateway(
        [speculative.url],
        [plain.url],
        topology="time-shared",
        admin_token=TOKEN,
        switching={"mechanism": "manual", "interval": 0.1},
    )
    wait_phase(gw, "active", "speculative")
    with httpx.Client(base_url=gw.url, timeout=10, trust_env=False) as client:
        unauthorized = client.put("/admin/mode", json={"mode": "plain"}, headers={"authorization": "Bearer nope"})
        assert unauthorized.status_code == 401
        assert unauthorized.json()["error"]["type"] == "authentication_error"
        for body, param in (
            ({"mode": "eagle"}, "mode"),
            ({}, None),
            ({"pin": "yes"}, "pin"),
            ({"mode": "plain", "now": True}, "now"),
        ):
            response = client.put("/admin/mode", json=body, headers=AUTH)
            assert response.status_code == 400, body
            error = response.json()["error"]
            assert error["type"] == "invalid_request_error" and error["param"] == param, error
        assert client.put("/admin/mode", content=b"{", headers=AUTH).json()["error"]["code"] == "invalid_json"
        # One GPU set serves one mode: a routing policy means nothing here, and is refused (all or nothing).
        policy = client.put("/admin/threshold", json={"threshold": 9, "policy": "switch"}, headers=AUTH)
        assert policy.status_code == 409 and policy.json()["error"]["code"] == "no_routing_policy", policy.text
        assert client.get("/admin/threshold", headers=AUTH).json()["threshold"] == gw.settings.threshold
        assert client.get("/admin/mode", headers=AUTH).json()["mode"] == "speculative"
        state = client.get("/admin/state", headers=AUTH).json()
        assert (state["topology"], state["mode"], state["phase"], state["mechanism"]) == (
            "time-shared",
            "speculative",
            "active",
            "manual",
        )
        # Manual: the operator has both servers up (the stand-ins never sleep here); the gateway drains and verifies.
        assert client.put("/admin/mode", json={"mode": "plain"}, headers=AUTH).status_code == 202
        again = client.put("/admin/mode", json={"mode": "speculative"}, headers=AUTH)
        # 409 while the switch runs; once it is over, one operator change per `operator_interval` (10 s) stands.
        expected = {409: "switch_in_progress", 429: "mode_change_rate_limited"}
        assert again.json()["error"]["code"] == expected.get(again.status_code), again.text
    wait_phase(gw, "active", "plain")
    assert gw.metric("crossover_mode_switches_total", mechanism="manual", to="plain", outcome="ok") == 1


def test_a_partitioned_gateway_has_no_mode_to_switch(sims, gateway):
    speculative, plain = sims
    gw = gateway([speculative.url], [plain.url], admin_token=TOKEN)
    with httpx.Client(base_url=gw.url, timeout=10, trust_env=False) as client:
        # Both modes serve at once: a mode or a pin means nothing, and is refused with a reason, never a 200.
        asks = (("PUT", {"mode": "plain"}), ("PUT", {"pin": True}), ("PUT", {"pin": False}), ("GET", None))
        for method, body in asks:
            response = client.request(method, "/admin/mode", json=body, headers=AUTH)
            assert response.status_code == 409, (body, response.text)
            error = response.json()["error"]
            assert error["code"] == "no_mode_to_switch" and "partitioned" in error["message"], error
        assert client.get("/admin/state", headers=AUTH).json()["topology"] == "partitioned"
        assert client.put("/admin/threshold", json={"policy": "switch"}, headers=AUTH).status_code == 200
    assert gw.metric("crossover_switch_queued_requests") == 0
