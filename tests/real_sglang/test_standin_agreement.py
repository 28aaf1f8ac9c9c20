"""The stand-in (`servers/sim`) against the real engine: the same requests to both, the same shape back.

A shape is a body with every value replaced by its JSON type (null stays null), so text, token counts and
timings may differ while every field, its nesting and where SGLang says null must agree. Differences kept on
purpose are listed in servers/sim/README.md ("Known differences from real SGLang"); each is pinned here on
the real engine's side.
"""

from __future__ import annotations

import re

import httpx
import pytest

from tests.gateway.gateway_helpers import sse_events

TIMEOUT = httpx.Timeout(60.0, connect=5.0)
SIM_MODEL = "moonshotai/Kimi-K2.5"
HEX_ID = re.compile(r"[0-9a-f]{32}")


def shape(value):
    if isinstance(value, dict):
        return {key: shape(item) for key, item in value.items()}
    if isinstance(value, list):
        return [shape(item) for item in value[:1]]
    if value is None:
        return None
    return {bool: "bool", int: "int", float: "number", str: "str"}[type(value)]


def post(url: str, path: str, body: dict) -> httpx.Response:
    with httpx.Client(timeout=TIMEOUT, trust_env=False) as client:
        return client.post(url + path, json=body)


@pytest.fixture
def engines(real_sglang, active_url, sim):
    stand_in = sim("k25-plain", "--time-scale", "50")
    return {"real": (active_url, real_sglang.model), "sim": (stand_in.url, SIM_MODEL)}


def both(engines, path: str, **body) -> dict[str, httpx.Response]:
    return {name: post(url, path, {"model": model, **body}) for name, (url, model) in engines.items()}


MESSAGES = [{"role": "user", "content": "Say OK."}]


def test_a_chat_completion_has_the_real_shape_and_headers(engines):
    # ignore_eos: the tiny model's random weights may end on EOS within 4 tokens (then SGLang's matched_stop is
    # the EOS id, else null); both engines then stop for length and answer the same shape.
    answers = both(engines, "/v1/chat/completions", messages=MESSAGES, max_tokens=4, ignore_eos=True)
    real, sim = answers["real"], answers["sim"]
    assert shape(sim.json()) == shape(real.json())
    assert HEX_ID.fullmatch(real.json()["id"]) and HEX_ID.fullmatch(sim.json()["id"])
    for name in ("content-type", "vary"):
        assert sim.headers.get(name) == real.headers.get(name), name


def test_a_completion_has_the_real_shape(engines):
    answers = both(engines, "/v1/completions", prompt="Say OK.", max_tokens=4, ignore_eos=True)
    assert shape(answers["sim"].json()) == shape(answers["real"].json())
    assert HEX_ID.fullmatch(answers["sim"].json()["id"])


def test_a_stream_with_usage_has_the_real_events(engines):
    answers = both(
        engines,
        "/v1/chat/completions",
        messages=MESSAGES,
        max_tokens=4,
        stream=True,
        stream_options={"include_usage": True},
    )
    events = {name: sse_events(response.content) for name, response in answers.items()}
    for name in events:
        assert events[name][-1] == "[DONE]", name
    real, sim = events["real"], events["sim"]
    # The role chunk, a token chunk, the finish chunk and the usage chunk.
    for index in (0, 1, -3, -2):
        assert shape(sim[index]) == shape(real[index]), index
    assert answers["sim"].headers["content-type"] == answers["real"].headers["content-type"]


def test_a_prompt_past_the_context_is_the_real_400(engines):
    answers = {}
    for name, (url, model) in engines.items():
        context = httpx.get(url + "/v1/models", timeout=10, trust_env=False).json()["data"][0]["max_model_len"]
        long = [{"role": "user", "content": "hello world " * context}]
        answers[name] = post(url, "/v1/chat/completions", {"model": model, "messages": long, "max_tokens": 2})
    for name, response in answers.items():
        assert response.status_code == 400, name
    assert shape(answers["sim"].json()) == shape(answers["real"].json())
    assert answers["sim"].json()["type"] == answers["real"].json()["type"] == "BadRequestError"


def test_health_and_the_model_card_are_the_real_ones(engines):
    for name, (url, _) in engines.items():
        health = httpx.get(url + "/health", timeout=30, trust_env=False)
        assert (health.status_code, health.content) == (200, b""), name
    cards = {
        name: httpx.get(url + "/v1/models", timeout=10, trust_env=False).json() for name, (url, _) in engines.items()
    }
    assert shape(cards["sim"]) == shape(cards["real"])


def test_the_load_fields_the_gateway_reads_are_in_both(engines):
    ranks = {
        name: httpx.get(url + "/v1/loads", timeout=10, trust_env=False).json()["loads"][0]
        for name, (url, _) in engines.items()
    }
    read = {"num_running_reqs", "num_waiting_reqs", "max_running_requests", "token_usage", "gen_throughput"}
    for name, rank in ranks.items():
        assert read <= set(rank), name
