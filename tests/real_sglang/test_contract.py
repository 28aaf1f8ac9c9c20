"""The gateway's contract against real SGLang 0.5.23: each request asked of SGLang directly and through the
gateway, one after the other, greedy (temperature 0) so the engine answers the same tokens both times.

The bodies must be the same bytes once the fields that differ by nature are masked - the response id,
`created` (a second's clock) and a logprob's digits past the third decimal; a stream, the same events once
the text is taken out of them and the same text (SGLang's detokenizer chunks tokens by its own timing) - and
the headers the same except those the gateway owns: `date` and `server` (its own uvicorn's),
`content-length` / `transfer-encoding` (its own framing), `x-request-id` and `x-crossover-pool` (added).
Errors are the exception, on purpose: the gateway reshapes SGLang's top-level error body into OpenAI's
`{"error": {...}}`, keeping SGLang's status and message (gateway/errors.py).
"""

from __future__ import annotations

import json
import re

import httpx
import openai
import pytest

from tests.gateway.gateway_helpers import sse_events, stream_text
from tests.real_sglang.tiny_model import CONTEXT_TOKENS

_ID = re.compile(rb'"id":"[0-9a-f]{32}"')
_CREATED = re.compile(rb'"created":\d+')
# A log-probability's last digits depend on what else SGLang batched with the request (its own /health probes
# are 1-token generations): the same to three decimals.
_LOGPROB = re.compile(rb'"logprob":(-?[0-9.]+(?:[eE][-+]?[0-9]+)?)')
# Headers the gateway owns; everything else SGLang sends must arrive unchanged.
GATEWAY_OWNED = {"date", "server", "content-length", "transfer-encoding", "x-request-id", "x-crossover-pool"}
TIMEOUT = httpx.Timeout(120.0, connect=5.0)


def masked(body: bytes) -> bytes:
    body = _LOGPROB.sub(lambda m: b'"logprob":%.3f' % float(m.group(1)), body)
    return _CREATED.sub(b'"created":0', _ID.sub(b'"id":"<id>"', body))


def ask(url: str, path: str, body: dict) -> httpx.Response:
    with httpx.Client(timeout=TIMEOUT, trust_env=False) as client:
        response = client.post(url + path, json=body)
        response.read()
        return response


def passed_headers(response: httpx.Response) -> dict[str, str]:
    return {name: value for name, value in response.headers.items() if name not in GATEWAY_OWNED}


def both(direct_url: str, gateway_url: str, path: str, body: dict) -> tuple[httpx.Response, httpx.Response]:
    # Once first, so both runs find the prompt in SGLang's prefix cache: a cached and an uncached prefill differ
    # in the last digits of a logprob.
    ask(direct_url, path, body)
    return ask(direct_url, path, body), ask(gateway_url, path, body)


def regrouped(raw: bytes) -> tuple[list, str]:
    """A stream's events with the generated text taken out of them, runs of events that then read the same
    collapsed into one, and the text: how SGLang's detokenizer splits tokens into chunks depends on its timing,
    so two runs of one greedy request agree on this, not on the chunk boundaries."""
    events, text = [], ""
    for event in sse_events(masked(raw)):
        if isinstance(event, dict):
            event = json.loads(json.dumps(event))
            for choice in event.get("choices", []):
                holder, key = (choice["delta"], "content") if "delta" in choice else (choice, "text")
                if isinstance(holder.get(key), str):
                    text += holder.pop(key)
        if not events or events[-1] != event:
            events.append(event)
    return events, text


def assert_passed_through(direct: httpx.Response, through: httpx.Response) -> None:
    assert through.status_code == direct.status_code, through.text
    if direct.headers["content-type"].startswith("text/event-stream"):
        assert regrouped(through.content) == regrouped(direct.content)
        assert through.content.count(b"data: ") == len(sse_events(through.content))
        assert through.content.endswith(b"data: [DONE]\n\n")
    else:
        assert masked(through.content) == masked(direct.content)
    assert passed_headers(through) == passed_headers(direct)
    assert through.headers["x-crossover-pool"] in ("speculative", "plain")
    assert through.headers["x-request-id"]


def chat(model: str, **extra) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": "Count from one to ten."}], **extra}


@pytest.fixture
def pair(real_sglang, active_url, real_gateway):
    gw = real_gateway()
    return active_url, gw.url, real_sglang.model


def test_a_chat_completion_passes_through_byte_for_byte(pair):
    direct_url, gateway_url, model = pair
    direct, through = both(direct_url, gateway_url, "/v1/chat/completions", chat(model, max_tokens=8, temperature=0))
    assert_passed_through(direct, through)
    body = direct.json()
    assert body["object"] == "chat.completion" and body["usage"]["completion_tokens"] == 8
    # What SGLang itself sends: no request id echoed, CORS's `vary: Origin` (the stand-in's differences).
    assert "x-request-id" not in direct.headers and direct.headers["vary"] == "Origin"


def test_a_stream_with_usage_passes_through_byte_for_byte(pair):
    direct_url, gateway_url, model = pair
    body = chat(model, max_tokens=6, temperature=0, stream=True, stream_options={"include_usage": True})
    direct, through = both(direct_url, gateway_url, "/v1/chat/completions", body)
    assert_passed_through(direct, through)
    events = sse_events(direct.content)
    assert events[-1] == "[DONE]"
    assert events[-2]["choices"] == [] and events[-2]["usage"]["completion_tokens"] == 6
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    assert direct.headers["content-type"] == "text/event-stream; charset=utf-8"


def test_n_choices_and_logprobs_pass_through(pair):
    direct_url, gateway_url, model = pair
    body = chat(model, max_tokens=4, temperature=0, n=2, logprobs=True, top_logprobs=2)
    direct, through = both(direct_url, gateway_url, "/v1/chat/completions", body)
    assert_passed_through(direct, through)
    choices = direct.json()["choices"]
    assert [choice["index"] for choice in choices] == [0, 1]
    assert all(len(choice["logprobs"]["content"]) == 4 for choice in choices)
    assert all(len(entry["top_logprobs"]) == 2 for entry in choices[0]["logprobs"]["content"])


def test_a_completion_with_a_stop_sequence_stops_there_through_the_gateway(pair):
    direct_url, gateway_url, model = pair
    plain = {"model": model, "prompt": "Say OK.", "max_tokens": 12, "temperature": 0}
    text = ask(direct_url, "/v1/completions", plain).json()["choices"][0]["text"]
    stop = text[4:6]  # somewhere inside what the model says greedily
    assert len(stop) == 2, text
    direct, through = both(direct_url, gateway_url, "/v1/completions", {**plain, "stop": [stop]})
    assert_passed_through(direct, through)
    choice = direct.json()["choices"][0]
    assert choice["text"] == text[: text.find(stop)]
    assert (choice["finish_reason"], choice["matched_stop"]) == ("stop", stop)


def test_a_stream_through_the_official_client_reads_what_sglang_generates(pair):
    direct_url, gateway_url, model = pair
    body = chat(model, max_tokens=6, temperature=0, stream=True)
    expected = stream_text(sse_events(ask(direct_url, "/v1/chat/completions", body).content))
    client = openai.OpenAI(base_url=gateway_url + "/v1", api_key="unused", max_retries=0)
    stream = client.chat.completions.create(
        model=model, messages=body["messages"], max_tokens=6, temperature=0, stream=True
    )
    assert "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices) == expected


def test_a_bad_request_gets_sglangs_status_and_message_in_openais_shape(pair):
    direct_url, gateway_url, model = pair
    direct, through = both(direct_url, gateway_url, "/v1/chat/completions", chat(model, max_tokens=2, temperature=-1))
    # SGLang's own body: top-level, its exception's name as the type.
    assert (direct.status_code, direct.json()) == (
        400,
        {
            "object": "error",
            "message": "temperature must be a non-negative finite number, got -1.0.",
            "type": "BadRequestError",
            "param": None,
            "code": 400,
        },
    )
    assert through.status_code == 400
    assert through.json() == {
        "error": {
            "message": direct.json()["message"],
            "type": "invalid_request_error",
            "param": None,
            "code": "BadRequestError",
        }
    }


def test_a_body_sglang_cannot_validate_is_its_400_too(pair):
    direct_url, gateway_url, model = pair
    direct, through = both(direct_url, gateway_url, "/v1/chat/completions", {"model": model})
    # SGLang's pydantic validation error: type "Bad Request", a traceback-like message naming the field.
    assert direct.status_code == 400 and direct.json()["type"] == "Bad Request"
    assert "'loc': ('body', 'messages')" in direct.json()["message"]
    assert through.status_code == 400
    assert through.json()["error"]["message"] == direct.json()["message"]


def test_a_prompt_longer_than_the_context_is_rejected_for_length_by_sglang(pair):
    direct_url, gateway_url, model = pair
    body = chat(model, max_tokens=2)
    body["messages"][0]["content"] = "hello world " * CONTEXT_TOKENS
    direct, through = both(direct_url, gateway_url, "/v1/chat/completions", body)
    assert direct.status_code == 400
    message = direct.json()["message"]
    limit = rf"\({CONTEXT_TOKENS} tokens\)"
    assert re.fullmatch(rf"The input \(\d+ tokens\) is longer than the model's context length {limit}\.", message)
    assert (through.status_code, through.json()["error"]["message"]) == (400, message)
    too_many = ask(direct_url, "/v1/chat/completions", chat(model, max_tokens=100_000))
    assert too_many.status_code == 400
    limit = f"Requested token count exceeds the model's maximum context length of {CONTEXT_TOKENS} tokens"
    assert limit in too_many.json()["message"]


def test_an_unknown_model_is_the_gateways_404_while_sglang_would_serve_it(pair):
    direct_url, gateway_url, model = pair
    body = chat("no-such-model", max_tokens=2, temperature=0)
    direct, through = both(direct_url, gateway_url, "/v1/chat/completions", body)
    # SGLang 0.5.23 serves any model name and echoes it: only the gateway knows what is served.
    assert direct.status_code == 200 and direct.json()["model"] == "no-such-model"
    assert through.status_code == 404
    assert through.json()["error"]["code"] == "model_not_found"
    models = httpx.get(gateway_url + "/v1/models", timeout=10, trust_env=False).json()
    assert [card["id"] for card in models["data"]] == [model]


def test_the_gateway_lists_the_model_sglang_serves(pair):
    direct_url, gateway_url, model = pair
    card = httpx.get(direct_url + "/v1/models", timeout=10, trust_env=False).json()["data"][0]
    assert {key: card[key] for key in ("id", "object", "owned_by", "root", "parent", "max_model_len")} == {
        "id": model,
        "object": "model",
        "owned_by": "sglang",
        "root": model,
        "parent": None,
        "max_model_len": CONTEXT_TOKENS,
    }
    # The gateway's own card (its pools may hold several servers): the same name.
    listed = httpx.get(gateway_url + "/v1/models", timeout=10, trust_env=False).json()["data"]
    assert [entry["id"] for entry in listed] == [model]
