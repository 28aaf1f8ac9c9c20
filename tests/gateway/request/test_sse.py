"""SSE framing: where events end, error events (SGLang's, with HTTP 200) and usage in a stream's tail."""

import json

from crossover.gateway.request.sse import error_event, error_in, split_events, usage_tokens


def test_error_events_are_found_with_their_status():
    queue_full = b'data: {"error": {"message": "The request queue is full.", "code": 503}}\n\ndata: [DONE]\n\n'
    assert error_in(queue_full).message == "The request queue is full." and error_in(queue_full).status == 503
    assert error_in(b'data: {"error": "plain words"}\n\n').status is None
    assert error_in(b'data: {"choices": []}\n\n') is None
    assert error_in(b"data: [DONE]\n\n") is None
    assert error_in(b": a comment\n\n") is None


def test_split_events():
    assert split_events(b"data: a\n\ndata: b") == (b"data: a\n\n", b"data: b")
    assert split_events(b"data: a\r\n\r\n") == (b"data: a\r\n\r\n", b"")
    assert split_events(b"data: a") == (b"", b"data: a")


def test_a_cut_stream_ends_with_an_error_event_then_done():
    first, done, rest = error_event("backend died", "api_error", "backend_unavailable").split(b"\n\n")
    assert json.loads(first.removeprefix(b"data: "))["error"]["message"] == "backend died"
    assert done == b"data: [DONE]" and rest == b""


def test_usage_is_read_from_the_last_usage_event():
    tail = b'data: {"choices": []}\n\ndata: {"choices": [], "usage": {"completion_tokens": 7}}\n\ndata: [DONE]\n\n'
    assert usage_tokens(tail) == 7
    assert usage_tokens(b"data: [DONE]\n\n") == 0


def test_usage_is_read_from_a_whole_body_not_from_the_generated_text():
    body = {
        "choices": [{"message": {"content": 'say "completion_tokens": 99'}}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 12, "completion_tokens_details": None},
    }
    assert usage_tokens(json.dumps(body).encode()) == 12
    assert usage_tokens(json.dumps({"choices": [], "usage": {"completion_tokens": None}}).encode()) == 0


def test_a_count_too_long_to_be_one_is_no_count():
    assert usage_tokens(b'{"usage": {"completion_tokens": 999999999999999999}}') == 999999999999999999
    assert usage_tokens(b'{"usage": {"completion_tokens": 1' + b"0" * 4999 + b"}}") == 0
    assert usage_tokens(json.dumps({"choices": [{"text": 'x "completion_tokens": 5'}]}).encode()) == 0
