"""Checks on a generation request before it is routed: JSON, the types of the fields we and SGLang rely on,
and the model name. The body is forwarded byte for byte afterwards; nothing here rewrites it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from crossover.gateway.errors import InvalidRequest, ModelNotFound

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"

_INTEGERS = ("max_tokens", "max_completion_tokens", "n", "seed", "top_logprobs")
_NUMBERS = ("temperature", "top_p", "frequency_penalty", "presence_penalty")
_BOOLEANS = ("stream", "echo", "logprobs")


@dataclass(frozen=True, slots=True)
class Generation:
    model: str | None
    stream: bool


def _type_name(value: object) -> str:
    return {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null"}.get(
        type(value), "number"
    )


def _wrong_type(param: str, expected: str, value: object) -> InvalidRequest:
    return InvalidRequest(f"'{param}' must be {expected}, got {_type_name(value)}", param=param, code="invalid_type")


def parse_generation(path: str, body: bytes, models: frozenset[str]) -> Generation:
    """Validate a chat or completion request body; raise InvalidRequest or ModelNotFound."""
    try:
        payload = json.loads(body)
    except (ValueError, RecursionError) as exc:  # RecursionError: absurdly deep nesting
        raise InvalidRequest(f"the request body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(payload, dict):
        raise InvalidRequest(f"the request body must be a JSON object, got {_type_name(payload)}", code="invalid_json")

    for name in _INTEGERS:
        value = payload.get(name)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
            raise _wrong_type(name, "an integer", value)
    for name in _NUMBERS:
        value = payload.get(name)
        if value is not None and (not isinstance(value, int | float) or isinstance(value, bool)):
            raise _wrong_type(name, "a number", value)
    for name in _BOOLEANS:
        value = payload.get(name)
        if value is not None and not isinstance(value, bool):
            raise _wrong_type(name, "a boolean", value)
    options = payload.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise _wrong_type("stream_options", "an object", options)
    stop = payload.get("stop")
    if (
        stop is not None
        and not isinstance(stop, str)
        and not (isinstance(stop, list) and all(isinstance(item, str) for item in stop))
    ):
        raise _wrong_type("stop", "a string or an array of strings", stop)

    if path == CHAT:
        messages = payload.get("messages")
        if messages is None:
            raise InvalidRequest("'messages' is required", param="messages", code="missing_required_parameter")
        if not isinstance(messages, list) or not all(isinstance(message, dict) for message in messages):
            raise _wrong_type("messages", "an array of message objects", messages)
        if not messages:
            raise InvalidRequest("'messages' must not be empty", param="messages", code="invalid_value")
    else:
        prompt = payload.get("prompt")
        if prompt is None:
            raise InvalidRequest("'prompt' is required", param="prompt", code="missing_required_parameter")
        if not isinstance(prompt, str | list):
            raise _wrong_type("prompt", "a string or an array", prompt)

    model = payload.get("model")
    if model is not None:
        if not isinstance(model, str):
            raise _wrong_type("model", "a string", model)
        if models and model not in models:
            raise ModelNotFound(f"The model `{model}` does not exist.", param="model")
    return Generation(model=model, stream=bool(payload.get("stream")))
