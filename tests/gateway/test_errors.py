"""The error tree: statuses and OpenAI-style bodies."""

import json

import pytest

from crossover.gateway import errors


@pytest.mark.parametrize(
    ("error", "status", "type_"),
    [
        (errors.InvalidRequest("x"), 400, "invalid_request_error"),
        (errors.AuthenticationFailed("x"), 401, "authentication_error"),
        (errors.AdminDisabled("x"), 403, "permission_error"),
        (errors.NotFound("x"), 404, "invalid_request_error"),
        (errors.ModelNotFound("x"), 404, "invalid_request_error"),
        (errors.MethodNotAllowed("x"), 405, "invalid_request_error"),
        (errors.BodyTooLarge("x"), 413, "invalid_request_error"),
        (errors.Overloaded("x", retry_after_s=2), 429, "rate_limit_error"),
        (errors.BackendFailed("x"), 502, "api_error"),
        (errors.NoHealthyBackend("x"), 503, "api_error"),
        (errors.BackendTimeout("x"), 504, "timeout_error"),
    ],
)
def test_every_error_has_a_status_and_an_openai_body(error, status, type_):
    assert error.status == status
    body = error.body()["error"]
    assert set(body) == {"message", "type", "param", "code"}
    assert body["type"] == type_ and body["message"] == "x" and isinstance(body["code"], str)


def test_overloaded_says_when_to_retry():
    assert errors.Overloaded("busy", retry_after_s=2).headers == {"retry-after": "2"}


def test_backend_errors_are_reshaped_like_openai_keeping_the_message():
    sglang = json.dumps({"object": "error", "message": "bad", "type": "BadRequest", "param": None, "code": 400})
    assert json.loads(errors.backend_error_body(400, sglang.encode())) == {
        "error": {"message": "bad", "type": "invalid_request_error", "param": None, "code": "BadRequest"}
    }
    nested = json.dumps({"error": {"message": "m", "type": "t", "param": "messages", "code": "c"}}).encode()
    assert json.loads(errors.backend_error_body(400, nested)) == {
        "error": {"message": "m", "type": "invalid_request_error", "param": "messages", "code": "c"}
    }
    plain = json.loads(errors.backend_error_body(500, b"Internal Server Error"))["error"]
    assert plain == {"message": "Internal Server Error", "type": "api_error", "param": None, "code": 500}
    assert json.loads(errors.backend_error_body(429, b""))["error"]["type"] == "rate_limit_error"
    assert json.loads(errors.backend_error_body(404, b"[1]"))["error"]["message"] == "[1]"


def test_timeouts_tell_the_sdk_not_to_retry():
    assert errors.BackendTimeout("slow").headers == {"x-should-retry": "false"}
