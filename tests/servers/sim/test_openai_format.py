import json

import pytest

from crossover.servers.sim.openai_format import (
    DEFAULT_MAX_TOKENS,
    DONE,
    BadRequest,
    StreamEncoder,
    count_tokens,
    filler_text,
    parse_generation,
    response_body,
    stream_error,
)

CHAT = {"model": "m", "messages": [{"role": "user", "content": "one two three four"}], "max_tokens": 8}


def parse(body, endpoint="chat", context_length=1000):
    return parse_generation(endpoint, body, context_length=context_length, default_model="served")


def test_token_counts_follow_words_with_a_length_floor():
    assert count_tokens("the cat sat") == 3
    assert count_tokens("x" * 80) == 10  # no spaces: one token per 8 characters
    assert (
        parse(
            {
                "messages": [
                    {"role": "system", "content": "a b"},
                    {
                        "role": "user",
                        "content": [{"type": "text", "text": "c d e"}, {"type": "image_url", "image_url": {}}],
                    },
                ]
            }
        ).prompt_tokens
        == 5
    )
    assert parse({"prompt": [1, 2, 3, 4]}, "completion").prompt_tokens == 4
    assert parse({"prompt": ["a b"]}, "completion").prompt_tokens == 2


def test_defaults_and_options():
    gen = parse({"messages": [{"role": "user", "content": "hi"}]})
    assert gen.model == "served" and gen.max_tokens == DEFAULT_MAX_TOKENS and gen.finish_reason == "stop"
    assert not gen.stream and not gen.include_usage
    gen = parse(
        {
            **CHAT,
            "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
            "stop": ["\n"],
            "temperature": 0.5,
        }
    )
    assert gen.stream and gen.include_usage and gen.continuous_usage
    assert gen.max_tokens == 8 and gen.finish_reason == "length" and gen.model == "m"
    assert parse({**CHAT, "max_tokens": None, "max_completion_tokens": 5}).max_tokens == 5
    assert parse({"messages": CHAT["messages"], "ignore_eos": True}).finish_reason == "length"


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ([1, 2], "must be a JSON object"),
        ({"messages": []}, "'messages' must be a non-empty list"),
        ({"messages": [{"content": "x"}]}, "string 'role'"),
        ({"messages": [{"role": "user", "content": 5}]}, "content' must be a string"),
        ({**CHAT, "max_tokens": -1}, "must be >= 0"),
        ({**CHAT, "max_tokens": "10"}, "'max_tokens' must be an integer"),
        ({**CHAT, "max_tokens": True}, "'max_tokens' must be an integer"),
        ({**CHAT, "stream": "yes"}, "'stream' must be a boolean"),
        ({**CHAT, "stream_options": {"include_usage": 1}}, "'stream_options.include_usage' must be a boolean"),
        ({**CHAT, "n": 2}, "'n' other than 1"),
        ({**CHAT, "model": 3}, "'model' must be a string"),
        ({**CHAT, "stop": 3}, "'stop' must be"),
        ({**CHAT, "max_tokens": 997}, "maximum context length of 1000 tokens"),
        ({"messages": [{"role": "user", "content": "w " * 1000}]}, "longer than the model's context length"),
    ],
)
def test_bad_chat_requests(body, message):
    with pytest.raises(BadRequest, match=message):
        parse(body)


def test_bad_completion_prompts():
    for prompt in (None, [], ["a", "b"], [1, "x"], {"text": "x"}):
        with pytest.raises(BadRequest, match="'prompt' must be"):
            parse({"prompt": prompt}, "completion")


def _events(raw: bytes) -> list:
    assert raw.endswith(b"\n\n")
    return [json.loads(part[len(b"data: ") :]) for part in raw.strip().split(b"\n\n")]


def test_chat_stream_chunks_assemble_into_the_response_text():
    gen = parse({**CHAT, "stream": True, "stream_options": {"include_usage": True}})
    enc = StreamEncoder(gen, "chatcmpl-1", 123)
    raw = enc.first(3) + enc.tokens(3, 4) + enc.tokens(7, 1) + enc.finish("length") + enc.usage(8)
    events = _events(raw)
    # As real SGLang 0.5.23 sends them (tests/real_sglang/test_standin_agreement.py).
    assert events[0]["choices"][0]["delta"] == {"reasoning_content": None, "role": "assistant", "content": ""}
    assert all(e["id"] == "chatcmpl-1" and e["object"] == "chat.completion.chunk" and e["model"] == "m" for e in events)
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in events if e["choices"])
    assert text == filler_text(0, 8)
    assert events[-2]["choices"][0]["finish_reason"] == "length"
    assert events[-2]["choices"][0]["delta"] == {"reasoning_content": None}
    assert events[-1]["choices"] == [] and events[-1]["usage"]["total_tokens"] == 4 + 8
    whole = response_body(gen, "chatcmpl-1", 123, 8, "length")
    assert whole["choices"][0]["message"]["content"] == text and whole["usage"]["completion_tokens"] == 8


def test_completion_stream_and_continuous_usage():
    gen = parse(
        {"prompt": "a b c", "max_tokens": 3, "stream": True, "stream_options": {"continuous_usage_stats": True}},
        "completion",
    )
    enc = StreamEncoder(gen, "cmpl-1", 1)
    events = _events(enc.first(2) + enc.tokens(2, 1) + enc.finish("length"))
    assert [e["object"] for e in events] == ["text_completion"] * 3
    assert [e["usage"]["completion_tokens"] for e in events[:2]] == [2, 3]
    assert "".join(e["choices"][0]["text"] for e in events) == filler_text(0, 3)
    assert events[-1]["choices"][0]["finish_reason"] == "length"


def test_filler_is_obviously_not_model_output():
    assert "simulated" in filler_text(0, 12) and "stand-in" in filler_text(0, 12)
    assert filler_text(0, 30) == filler_text(0, 12) * 2 + filler_text(0, 6)


def test_stream_error_is_sglangs_event():
    (event,) = _events(stream_error("The request queue is full.", status=503, err_type="SERVICE_UNAVAILABLE"))
    assert event == {
        "error": {
            "object": "error",
            "message": "The request queue is full.",
            "type": "SERVICE_UNAVAILABLE",
            "param": None,
            "code": 503,
        }
    }
    assert DONE == b"data: [DONE]\n\n"
