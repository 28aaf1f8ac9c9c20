"""Partitioned pools and the OpenAI `service_tier`: through the official SDK, a `priority` request takes the
speculative pool where the load says plain, a `flex` one takes plain where the load says speculative, and the
field reaches the engine as the client sent it."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from crossover.gateway.policies import FLEX_TIER, PRIORITY_TIER
from tests.gateway.gateway_helpers import MODEL, Scripted, chat

CLIENT_KEY = "sk-client-1"
BATCH_KEY = "sk-batch-1"
ANSWER = json.dumps(
    {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "created": 0,
        "model": MODEL,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
    }
).encode()


@pytest.fixture
def tiered(serve, gateway):
    """A gateway over two recording backends, one per pool: (gateway, speculative backend, plain backend)."""

    def start(**settings):
        speculative, plain = Scripted(body=ANSWER), Scripted(body=ANSWER)
        gw = gateway([serve(speculative).url], [serve(plain).url], **settings)
        return gw, speculative, plain

    return start


def sdk(gw, key: str = CLIENT_KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0)


def ask(client: openai.OpenAI, **extra):
    return client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4, **extra
    )


def test_a_priority_request_is_served_by_the_speculative_pool_with_the_threshold_at_zero(tiered):
    gw, speculative, plain = tiered(threshold=0)
    client = sdk(gw)
    ask(client)
    assert (len(speculative.requests), len(plain.requests)) == (0, 1)  # the threshold sends the rest to plain
    response = ask(client, service_tier="priority")
    assert response.choices[0].message.content == "ok"
    assert (len(speculative.requests), len(plain.requests)) == (1, 1)
    # The engine gets the field as the client sent it (the body is forwarded byte for byte).
    assert json.loads(speculative.requests[0][2])["service_tier"] == "priority"
    assert (
        b'"service_tier": "priority"' in speculative.requests[0][2]
        or b'"service_tier":"priority"' in (speculative.requests[0][2])
    )
    gw.settled()
    assert gw.metric("crossover_route_decisions_total", pool="speculative", reason=PRIORITY_TIER) == 1
    assert gw.metric("crossover_requests_by_tier_total", tier="priority", pool="speculative") == 1


def test_a_flex_request_is_served_by_plain_below_the_threshold(tiered):
    gw, speculative, plain = tiered(threshold=32)
    client = sdk(gw)
    ask(client)
    assert (len(speculative.requests), len(plain.requests)) == (1, 0)
    ask(client, service_tier="flex")
    assert (len(speculative.requests), len(plain.requests)) == (1, 1)
    assert json.loads(plain.requests[0][2])["service_tier"] == "flex"
    ask(client, service_tier="auto")  # auto and default route as no tier does
    ask(client, service_tier="default")
    assert (len(speculative.requests), len(plain.requests)) == (3, 1)
    gw.settled()
    assert gw.metric("crossover_route_decisions_total", pool="plain", reason=FLEX_TIER) == 1
    assert gw.metric("crossover_requests_by_tier_total", tier="flex", pool="plain") == 1
    assert gw.metric("crossover_requests_by_tier_total", tier="auto", pool="speculative") == 1


def test_an_unknown_service_tier_is_a_400_naming_the_param(tiered):
    gw, speculative, plain = tiered()
    with pytest.raises(openai.BadRequestError) as caught:
        ask(sdk(gw), service_tier="scale")
    error = caught.value.body
    assert (error["param"], error["code"], error["type"]) == ("service_tier", "invalid_value", "invalid_request_error")
    assert not speculative.requests and not plain.requests


def test_a_keys_default_tier_applies_where_the_request_names_none(tiered):
    gw, speculative, plain = tiered(api_keys=[CLIENT_KEY, BATCH_KEY], api_key_tiers={BATCH_KEY: "flex"})
    batch = sdk(gw, BATCH_KEY)
    ask(batch)  # the key's tier: flex, so plain although the speculative pool is idle
    assert (len(speculative.requests), len(plain.requests)) == (0, 1)
    assert b"service_tier" not in plain.requests[0][2]  # the body is the client's: the gateway adds nothing
    ask(batch, service_tier="priority")  # the request's own tier wins
    ask(sdk(gw))  # another key: no tier
    assert (len(speculative.requests), len(plain.requests)) == (2, 1)
    gw.settled()
    assert gw.metric("crossover_requests_by_tier_total", tier="flex", pool="plain") == 1


def test_a_stream_and_the_ordinary_lane_read_the_tier_too(tiered):
    """The direct lane leaves streams to the coroutine path: the tier it read goes along."""
    gw, speculative, _ = tiered(threshold=0)
    with httpx.Client(base_url=gw.url, timeout=10, trust_env=False) as client:
        response = client.post("/v1/chat/completions", json=chat(stream=True, service_tier="priority"))
    assert response.status_code == 200 and response.headers["x-crossover-pool"] == "speculative"
    assert json.loads(speculative.requests[0][2])["service_tier"] == "priority"


def test_the_priority_headroom_moves_live_through_the_admin_api_and_shows_in_the_state(tiered):
    gw, speculative, plain = tiered(threshold=0, admin_token="admin-1")
    admin = {"authorization": "Bearer admin-1"}
    client = sdk(gw)
    ask(client, service_tier="priority")
    assert (len(speculative.requests), len(plain.requests)) == (1, 0)  # the default headroom lets it in
    moved = httpx.put(gw.url + "/admin/threshold", json={"priority_headroom": 0}, headers=admin)
    assert moved.status_code == 200 and moved.json()["priority_headroom"] == 0
    assert httpx.get(gw.url + "/admin/state", headers=admin).json()["priority_headroom"] == 0
    ask(client, service_tier="priority")  # no room left: the threshold's pool serves it
    assert (len(speculative.requests), len(plain.requests)) == (1, 1)
    bad = httpx.put(gw.url + "/admin/threshold", json={"priority_headroom": -1}, headers=admin)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "priority_headroom"
    assert httpx.get(gw.url + "/admin/threshold", headers=admin).json()["priority_headroom"] == 0


def test_the_priority_headroom_and_the_spillover_share_are_part_of_what_every_replica_shares():
    from crossover.gateway.cluster.store import Control
    from crossover.gateway.config import Settings
    from crossover.gateway.topology.routing import Routing

    pools = {"speculative": {"backends": ["http://s:1"]}, "plain": {"backends": ["http://p:1"]}}
    routing = Routing.from_settings(Settings(pools=pools))
    ours = Control(threshold=routing.threshold, hysteresis=routing.hysteresis, policy=routing.policy)
    theirs = ours.model_copy(update={"priority_headroom": 5})
    assert theirs.changes(ours) == {"priority_headroom": 5}  # a change the cluster writes and reads back
    routing.update(theirs.threshold, theirs.hysteresis, theirs.policy, theirs.priority_headroom)
    assert routing.state()["priority_headroom"] == 5
    routing.update(ours.threshold, ours.hysteresis, ours.policy, ours.priority_headroom)  # a member from before
    assert routing.priority_headroom == 5
    shared = ours.model_copy(update={"spillover_share": 0.5})
    assert shared.changes(ours) == {"spillover_share": 0.5}
    routing.update(shared.threshold, shared.hysteresis, shared.policy, None, shared.spillover_share)
    assert routing.state()["spillover_share"] == 0.5
