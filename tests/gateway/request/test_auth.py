"""Keys: clients present one of `api_keys` when they are configured; the gateway presents each pool's own key
to its backends, never the client's; the admin token is apart from both."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.gateway.gateway_helpers import MODEL, Scripted, chat

CLIENT_KEY = "sk-client-1"
BACKEND_KEY = "sglang-secret"


def test_clients_must_present_a_configured_key(sims, gateway):
    speculative, plain = sims
    gw = gateway([speculative.url], [plain.url], api_keys=["sk-other", CLIENT_KEY], admin_token="admin")
    with httpx.Client(base_url=gw.url, timeout=10, trust_env=False) as client:
        for headers in ({}, {"authorization": "Bearer sk-wrong"}, {"authorization": f"Basic {CLIENT_KEY}"}):
            response = client.post("/v1/chat/completions", json=chat(), headers=headers)
            assert response.status_code == 401, headers
            assert response.json()["error"]["code"] == "invalid_api_key"
            assert response.headers["www-authenticate"] == "Bearer"
            for path in ("/v1/models", f"/v1/models/{MODEL}"):  # which models a gateway serves is behind the key too
                listed = client.get(path, headers=headers)
                assert listed.status_code == 401 and listed.json()["error"]["code"] == "invalid_api_key", path
        keyed = {"authorization": f"Bearer {CLIENT_KEY}"}
        assert client.get("/v1/models", headers=keyed).json()["data"][0]["id"] == MODEL
        # A client key is not the admin token, and the admin token is not a client key.
        assert client.get("/admin/threshold", headers={"authorization": f"Bearer {CLIENT_KEY}"}).status_code == 401
        assert (
            client.post("/v1/chat/completions", json=chat(), headers={"authorization": "Bearer admin"}).status_code
            == 401
        )
        # Health and metrics stay open for probes and scrapers.
        assert client.get("/health").status_code == 200 and client.get("/metrics").status_code == 200
    sdk = openai.OpenAI(base_url=gw.url + "/v1", api_key=CLIENT_KEY, max_retries=0)
    assert sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=gw.url + "/v1", api_key="sk-nope", max_retries=0).chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4
        )
    assert gw.metric("crossover_requests_total", pool="none", outcome="unauthorized") == 5


def test_the_gateway_sends_the_pool_key_to_its_backends_never_the_clients(serve, gateway):
    backend = Scripted(body=b'{"choices": []}')
    url = serve(backend).url
    gw = gateway(
        [url],
        [url],
        api_keys=[CLIENT_KEY],
        pools={"speculative": {"backends": [url], "api_key": BACKEND_KEY}, "plain": {"backends": [url]}},
    )
    with httpx.Client(base_url=gw.url, timeout=10, trust_env=False) as client:
        response = client.post("/v1/chat/completions", json=chat(), headers={"authorization": f"Bearer {CLIENT_KEY}"})
    assert response.status_code == 200
    _, headers, _ = backend.requests[0]
    assert headers[b"authorization"] == f"Bearer {BACKEND_KEY}".encode()
    # Its own calls too (health, model names), or an SGLang started with --api-key would answer 401.
    assert {path for path, _ in backend.probes} == {"/health", "/v1/models"}
    keyed = [headers.get(b"authorization") for _, headers in backend.probes]
    assert f"Bearer {BACKEND_KEY}".encode() in keyed


def test_a_keys_default_tier_is_looked_up_by_the_key_it_carries():
    from crossover.gateway.request.auth import key_tier, key_tiers

    tiers = key_tiers({"sk-batch": "flex"})
    assert key_tier([(b"authorization", b"Bearer sk-batch")], tiers) == "flex"
    assert key_tier([(b"authorization", b"Bearer sk-other")], tiers) is None
    assert key_tier([], tiers) is None
