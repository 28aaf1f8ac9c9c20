"""What the gateway checks before routing: only what routing needs. The rest is the backend's to judge."""

import json

import httpx
import pytest

from crossover.gateway.errors import InvalidRequest, ModelNotFound
from crossover.gateway.request.validation import parse_generation
from tests.gateway.gateway_helpers import WAIT_S, chat, unused_url

MODELS = frozenset({"moonshotai/Kimi-K2.5"})
CHAT_OK = {"model": "moonshotai/Kimi-K2.5", "messages": [{"role": "user", "content": "hi"}]}


def parse(payload, models=MODELS):
    body = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    return parse_generation(body, models)


def test_valid_requests():
    assert parse(CHAT_OK).stream is False
    assert parse({**CHAT_OK, "stream": True, "stream_options": {"include_usage": True}}).stream is True
    assert parse({"prompt": "hi", "max_tokens": 5}).model is None
    assert parse({"prompt": [1, 2, 3], "model": "x"}, frozenset()).model == "x"  # names not known yet
    # The schema beyond routing is the backend's: an integer `logprobs` on /v1/completions (OpenAI and
    # SGLang both take one), SGLang's own extensions, even fields a backend will refuse.
    assert parse({"prompt": "hi", "logprobs": 5, "echo": True}).stream is False
    assert parse({**CHAT_OK, "chat_template_kwargs": {"thinking": True}, "top_k": 20}).stream is False
    assert parse({**CHAT_OK, "max_tokens": "ten"}).stream is False


@pytest.mark.parametrize(
    ("payload", "param", "code"),
    [
        (b"{not json", None, "invalid_json"),
        (b"\xff\xfe", None, "invalid_json"),
        (b"[" * 100_000, None, "invalid_json"),
        (b'{"temperature": NaN}', None, "invalid_json"),
        (b'{"max_tokens": Infinity}', None, "invalid_json"),
        ([1, 2], None, "invalid_json"),
        ({**CHAT_OK, "stream": "yes"}, "stream", "invalid_type"),
        ({**CHAT_OK, "stream_options": []}, "stream_options", "invalid_type"),
        ({**CHAT_OK, "model": 7}, "model", "invalid_type"),
        ({**CHAT_OK, "model": None}, "model", "invalid_type"),  # absent is the backend's default; null is no name
    ],
    ids=lambda value: value if isinstance(value, str) or value is None else repr(value)[:30],
)
def test_what_routing_needs_is_checked_and_named(payload, param, code):
    with pytest.raises(InvalidRequest) as caught:
        parse(payload)
    assert caught.value.status == 400
    assert caught.value.param == param and caught.value.code == code


def test_unknown_model_is_404():
    with pytest.raises(ModelNotFound) as caught:
        parse({**CHAT_OK, "model": "gpt-4"})
    assert caught.value.status == 404
    assert caught.value.body() == {
        "error": {
            "message": "The model `gpt-4` does not exist.",
            "type": "invalid_request_error",
            "param": "model",
            "code": "model_not_found",
        }
    }


@pytest.mark.parametrize("stream", [False, True], ids=["direct lane", "stream"])
def test_a_null_model_is_refused_before_routing(gateway, stream):
    # Nothing listens behind the pools: a request that was routed would answer 502 or 503, not 400.
    running = gateway([unused_url()], [unused_url()])
    response = httpx.post(f"{running.url}/v1/chat/completions", json=chat(stream=stream, model=None), timeout=WAIT_S)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["param"], error["code"], error["type"]) == ("model", "invalid_type", "invalid_request_error")
    assert error["message"] == "'model' must be a string, got null"


def test_the_service_tier_is_read_once_and_an_unknown_one_is_400():
    assert parse(CHAT_OK).tier is None
    assert parse({**CHAT_OK, "service_tier": None}).tier is None  # null: no tier, as the SDK reads it
    for tier in ("auto", "default", "flex", "priority"):
        assert parse({**CHAT_OK, "service_tier": tier}).tier == tier
    for wrong in ("scale", "PRIORITY", 1, ["flex"], {"tier": "flex"}):
        with pytest.raises(InvalidRequest) as caught:
            parse({**CHAT_OK, "service_tier": wrong})
        assert (caught.value.status, caught.value.param, caught.value.code) == (400, "service_tier", "invalid_value")
        assert "Supported values are: 'auto', 'default', 'flex', and 'priority'." in caught.value.message
