"""What the gateway checks in a generation request before routing it: only what routing needs - a JSON
object, `model`, `stream`, `stream_options`, `service_tier` - and standard JSON. The rest of the schema belongs to the
backend, which owns it (SGLang's `logprobs` on /v1/completions is an integer, for one); the body is
forwarded byte for byte.
"""

from __future__ import annotations

import json
from typing import NamedTuple

from crossover.gateway.errors import InvalidRequest, ModelNotFound
from crossover.gateway.policies import TIERS

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


class Generation(NamedTuple):  # a tuple: one is made per request, and a frozen dataclass costs more to make
    model: str | None
    stream: bool
    # OpenAI's `service_tier` (one of TIERS); None: the request named none (the key's default may apply).
    tier: str | None = None


def _type_name(value: object) -> str:
    return {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null"}.get(
        type(value), "number"
    )


def _wrong_type(param: str, expected: str, value: object) -> InvalidRequest:
    return InvalidRequest(f"'{param}' must be {expected}, got {_type_name(value)}", param=param, code="invalid_type")


def _reject_constant(name: str) -> None:
    # Python's json accepts NaN and Infinity; JSON does not, and neither do the backends' parsers.
    raise ValueError(f"{name} is not valid JSON")


# What JSON counts as whitespace (str.strip() would take more).
_JSON_SPACE = " \t\n\r"
# Built once: json.loads with an option builds a decoder per call.
_DECODER = json.JSONDecoder(parse_constant=_reject_constant)
_ABSENT = object()
_TIERS = frozenset(TIERS)
_TIER_CHOICES = ", ".join(f"'{tier}'" for tier in TIERS[:-1]) + f", and '{TIERS[-1]}'"


def _tier(value: object) -> str:
    # As OpenAI words it. (null is no tier, as the SDK's own models read it: the caller never asks.)
    if isinstance(value, str) and value in _TIERS:
        return value
    raise InvalidRequest(
        f"Invalid value: {json.dumps(value)}. Supported values are: {_TIER_CHOICES}.",
        param="service_tier",
        code="invalid_value",
    )


def parse_generation(body: bytes, models: frozenset[str]) -> Generation:
    """Check a chat or completion request body; raise InvalidRequest or ModelNotFound."""
    try:
        # As json.loads reads bytes: UTF-8, -16 or -32 (RFC 8259 allows only UTF-8; what json.loads took stays taken).
        # A body that opens with `{` and no NUL after it is UTF-8 to detect_encoding too: skip asking it.
        if body[:1] == b"{" and body[1:2] != b"\x00":
            # The usual body is an object from its first byte: read as `decode` reads it, without its two
            # whitespace scans (and, for a body with more after the object, by `decode`, which says where).
            text = body.decode("utf-8", "surrogatepass")
            payload, end = _DECODER.raw_decode(text)
            if end != len(text) and text[end:].strip(_JSON_SPACE):
                _DECODER.decode(text)
        else:
            payload = _DECODER.decode(body.decode(json.detect_encoding(body), "surrogatepass"))
    except (ValueError, RecursionError) as exc:  # RecursionError: absurdly deep nesting
        raise InvalidRequest(f"the request body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(payload, dict):
        raise InvalidRequest(f"the request body must be a JSON object, got {_type_name(payload)}", code="invalid_json")
    stream = payload.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise _wrong_type("stream", "a boolean", stream)
    options = payload.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise _wrong_type("stream_options", "an object", options)
    # Absent, `model` is the backend's default (SGLang's request models default it); null is no string, and
    # SGLang would refuse it in its own words after the gateway had routed it.
    tier = payload.get("service_tier")
    if tier is not None:
        tier = _tier(tier)
    model = payload.get("model", _ABSENT)
    if model is _ABSENT:
        return Generation(None, bool(stream), tier)
    if not isinstance(model, str):
        raise _wrong_type("model", "a string", model)
    if models and model not in models:
        raise ModelNotFound(f"The model `{model}` does not exist.", param="model")
    return Generation(model, bool(stream), tier)
