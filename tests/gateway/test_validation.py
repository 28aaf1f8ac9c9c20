"""What a generation request must look like before it is routed."""

import json

import pytest

from crossover.gateway.errors import InvalidRequest, ModelNotFound
from crossover.gateway.validation import CHAT, COMPLETIONS, parse_generation

MODELS = frozenset({"moonshotai/Kimi-K2.5"})
CHAT_OK = {"model": "moonshotai/Kimi-K2.5", "messages": [{"role": "user", "content": "hi"}]}


def parse(payload, path=CHAT, models=MODELS):
    body = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    return parse_generation(path, body, models)


def test_valid_requests():
    assert parse(CHAT_OK).stream is False
    assert parse({**CHAT_OK, "stream": True, "stream_options": {"include_usage": True}}).stream is True
    assert parse({"prompt": "hi", "max_tokens": 5}, COMPLETIONS).model is None
    assert parse({"prompt": [1, 2, 3], "model": "x"}, COMPLETIONS, frozenset()).model == "x"  # names unknown yet
    # Fields the gateway does not know are the backend's business.
    assert parse({**CHAT_OK, "chat_template_kwargs": {"thinking": True}, "top_k": 20}).stream is False


@pytest.mark.parametrize(
    ("payload", "param", "code"),
    [
        (b"{not json", None, "invalid_json"),
        (b"\xff\xfe", None, "invalid_json"),
        (b"[" * 100_000, None, "invalid_json"),
        ([1, 2], None, "invalid_json"),
        ({**CHAT_OK, "max_tokens": "10"}, "max_tokens", "invalid_type"),
        ({**CHAT_OK, "max_tokens": True}, "max_tokens", "invalid_type"),
        ({**CHAT_OK, "temperature": "hot"}, "temperature", "invalid_type"),
        ({**CHAT_OK, "stream": "yes"}, "stream", "invalid_type"),
        ({**CHAT_OK, "stream_options": []}, "stream_options", "invalid_type"),
        ({**CHAT_OK, "stop": [1]}, "stop", "invalid_type"),
        ({**CHAT_OK, "model": 7}, "model", "invalid_type"),
        ({"model": "moonshotai/Kimi-K2.5"}, "messages", "missing_required_parameter"),
        ({**CHAT_OK, "messages": "hi"}, "messages", "invalid_type"),
        ({**CHAT_OK, "messages": []}, "messages", "invalid_value"),
    ],
)
def test_bad_requests_name_the_problem(payload, param, code):
    with pytest.raises(InvalidRequest) as caught:
        parse(payload)
    assert caught.value.status == 400
    assert caught.value.param == param and caught.value.code == code


def test_completions_need_a_prompt():
    with pytest.raises(InvalidRequest) as caught:
        parse({"model": "moonshotai/Kimi-K2.5"}, COMPLETIONS)
    assert caught.value.param == "prompt"
    with pytest.raises(InvalidRequest):
        parse({"prompt": 3}, COMPLETIONS)


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
