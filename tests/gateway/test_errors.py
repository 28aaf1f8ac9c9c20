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


def test_sse_error_ends_the_stream():
    tail = errors.sse_error("backend died", "api_error", "backend_unavailable")
    first, done, rest = tail.split(b"\n\n")
    assert json.loads(first.removeprefix(b"data: "))["error"]["message"] == "backend died"
    assert done == b"data: [DONE]" and rest == b""


def test_backend_errors_are_nested_like_openai():
    sglang = json.dumps({"object": "error", "message": "bad", "type": "BadRequest", "param": None, "code": 400})
    assert json.loads(errors.normalize_backend_error(400, sglang.encode())) == {
        "error": {"message": "bad", "type": "BadRequest", "param": None, "code": 400}
    }
    already = json.dumps({"error": {"message": "m", "type": "t", "param": None, "code": None}}).encode()
    assert errors.normalize_backend_error(400, already) == already
    assert json.loads(errors.normalize_backend_error(422, b"plain text"))["error"]["message"] == "plain text"
