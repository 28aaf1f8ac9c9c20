"""OpenAI-style bodies shaped as SGLang's /v1 endpoints shape them (srt/entrypoints/openai/...).

    gen = parse_generation("chat", body, context_length=262144)     # BadRequest names the bad field
    enc = StreamEncoder(gen, rid=uuid.uuid4().hex, created=1700000000)
    enc.first(3) + enc.tokens(3, 2) + enc.finish("length") + enc.usage(7) + DONE

The stand-in has no tokenizer: a prompt counts one token per whitespace-separated word, and at least one
per CHARS_PER_TOKEN_FLOOR characters (a long string without spaces is not free). Generated text is a fixed
filler sentence, one word per token, so it is obviously not a model's output. Stream chunks are built from
pre-encoded pieces: a stand-in carrying hundreds of streams on one core pays for every chunk.
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass
from typing import Any, Literal

FILLER = (
    " This",
    " is",
    " simulated",
    " output",
    " from",
    " the",
    " crossover",
    " SGLang",
    " stand-in,",
    " not",
    " a",
    " model.",
)
# Without max_tokens a model stops at its EOS; the stand-in "stops" after this many tokens.
DEFAULT_MAX_TOKENS = 256
CHARS_PER_TOKEN_FLOOR = 8
DONE = b"data: [DONE]\n\n"
WEIGHT_VERSION = "default"

Endpoint = Literal["chat", "completion"]


class BadRequest(ValueError):
    """A request SGLang would answer with 400."""


@dataclass(frozen=True)
class Generation:
    endpoint: Endpoint
    model: str
    prompt_tokens: int
    max_tokens: int
    finish_reason: str  # at max_tokens: "length" when the client set it, "stop" for the simulated EOS
    stream: bool
    include_usage: bool
    continuous_usage: bool


def count_tokens(text: str) -> int:
    return max(len(text.split()), math.ceil(len(text) / CHARS_PER_TOKEN_FLOOR))


def parse_generation(endpoint: Endpoint, body: Any, *, context_length: int, default_model: str) -> Generation:
    if not isinstance(body, dict):
        raise BadRequest("The request body must be a JSON object.")
    model = body.get("model", default_model)
    if not isinstance(model, str):
        raise BadRequest("'model' must be a string.")
    prompt_tokens = _chat_tokens(body) if endpoint == "chat" else _completion_tokens(body)
    if _opt(body, "n", int, 1) != 1:
        raise BadRequest("'n' other than 1 is not supported by the stand-in.")
    stop = body.get("stop")  # accepted, then ignored: filler text never matches a stop sequence
    stops = [stop] if isinstance(stop, str) else stop
    if not (stops is None or (isinstance(stops, list) and all(isinstance(s, str) for s in stops))):
        raise BadRequest("'stop' must be a string or a list of strings.")
    stream = _opt(body, "stream", bool, False)
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise BadRequest("'stream_options' must be an object.")
    options = options or {}
    include_usage = _opt(options, "include_usage", bool, False, "stream_options.")
    continuous = _opt(options, "continuous_usage_stats", bool, False, "stream_options.")
    key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _opt(body, key, int, None)
    if max_tokens is not None and max_tokens < 0:
        raise BadRequest(f"'{key}' must be >= 0, got {max_tokens}.")
    if prompt_tokens >= context_length:
        raise BadRequest(
            f"The input ({prompt_tokens} tokens) is longer than the model's context length ({context_length} tokens)."
        )
    if max_tokens is not None and prompt_tokens + max_tokens > context_length:
        raise BadRequest(
            f"Requested token count exceeds the model's maximum context length of {context_length} tokens. "
            f"You requested a total of {prompt_tokens + max_tokens} tokens: {prompt_tokens} tokens from the "
            f"input messages and {max_tokens} tokens for the completion. Please reduce the number of tokens "
            "in the input messages or the completion to fit within the limit."
        )
    length_set = max_tokens is not None or _opt(body, "ignore_eos", bool, False)
    if max_tokens is None:
        max_tokens = min(DEFAULT_MAX_TOKENS, context_length - prompt_tokens)
    return Generation(
        endpoint,
        model,
        prompt_tokens,
        max_tokens,
        "length" if length_set else "stop",
        stream,
        include_usage,
        continuous,
    )


def _opt(body: dict, key: str, kind: type, default: Any, prefix: str = "") -> Any:
    value = body.get(key)
    if value is None:
        return default
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise BadRequest(f"'{prefix}{key}' must be {'an integer' if kind is int else 'a boolean'}, got {value!r}.")
    return value


def _chat_tokens(body: dict) -> int:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty list.")
    total = 0
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise BadRequest(f"'messages[{i}]' must be an object with a string 'role'.")
        content = message.get("content")
        if isinstance(content, str):
            total += count_tokens(content)
        elif isinstance(content, list):
            for part in content:
                if not isinstance(part, dict):
                    raise BadRequest(f"'messages[{i}].content' parts must be objects.")
                if isinstance(part.get("text"), str):
                    total += count_tokens(part["text"])
        elif content is not None:
            raise BadRequest(f"'messages[{i}].content' must be a string, a list of parts or null.")
    return max(total, 1)


def _completion_tokens(body: dict) -> int:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        return max(count_tokens(prompt), 1)
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return len(prompt)
    raise BadRequest(
        "'prompt' must be a string or a list of token ids (batched prompts are not supported by the stand-in)."
    )


# --- bodies -----------------------------------------------------------------------------------------------


def error_body(message: str, *, status: int = 400, err_type: str = "BadRequestError") -> dict:
    """SGLang's top-level error body (ErrorResponse), used before a stream starts or when not streaming."""
    return {"object": "error", "message": message, "type": err_type, "param": None, "code": status}


def stream_error(message: str, *, status: int, err_type: str) -> bytes:
    """An error after HTTP 200 has gone out: an SSE event SGLang sends before `data: [DONE]`."""
    return _sse({"error": error_body(message, status=status, err_type=err_type)})


@dataclass(frozen=True, slots=True)
class ErrorShape:
    """How the engine the stand-in plays writes its errors (`--engine`): SGLang's top-level body, or vLLM's
    `{"error": {...}}` (its ErrorResponse, vllm/entrypoints/serve/engine/protocol.py), as a body and as an
    event. Busy is 503 in both: SGLang's "queue full", vLLM's QueueOverflowError past --max-num-queued-reqs."""

    nested: bool
    # vLLM's words for a full queue and their type; None: the engine's own (SGLang's "The request queue is full.").
    queue_full_message: str | None = None
    # The type of a busy refusal in a stream's error event, and in a 503 body.
    busy_type: str = "SERVICE_UNAVAILABLE"
    busy_body_type: str = "503"
    # The type of an HTTP error (an unknown path, a wrong method): its status phrase as it is ("Not Found", vLLM),
    # or run together ("NotFound", SGLang).
    spaced_phrases: bool = False

    def body(self, message: str, *, status: int = 400, err_type: str = "BadRequestError") -> dict:
        if self.nested:
            return {"error": {"message": message, "type": err_type, "param": None, "code": status}}
        return error_body(message, status=status, err_type=err_type)

    def stream(self, message: str, *, status: int, err_type: str) -> bytes:
        if self.nested:
            return _sse(self.body(message, status=status, err_type=err_type))
        return stream_error(message, status=status, err_type=err_type)

    def http_type(self, phrase: str) -> str:
        return phrase if self.spaced_phrases else phrase.replace(" ", "")

    def queue_full(self, engine_message: str) -> str:
        return self.queue_full_message or engine_message


SGLANG_ERRORS = ErrorShape(nested=False)
VLLM_ERRORS = ErrorShape(
    nested=True,
    queue_full_message="The engine is currently busy and cannot accept new requests. Please try again later or "
    "on a different instance.",
    busy_type="Service Unavailable",
    busy_body_type="Service Unavailable",
    spaced_phrases=True,
)


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
        "prompt_tokens_details": None,
        "reasoning_tokens": 0,
        "completion_tokens_details": None,
    }


def filler_text(start: int, n: int) -> str:
    period = len(FILLER)
    return "".join(FILLER[(start + i) % period] for i in range(n))


def response_body(gen: Generation, rid: str, created: int, completion_tokens: int, finish_reason: str) -> dict:
    text = filler_text(0, completion_tokens)
    if gen.endpoint == "chat":
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": text, "reasoning_content": None},
        }
        obj = "chat.completion"
    else:
        choice, obj = {"index": 0, "text": text}, "text_completion"
    choice.update({"logprobs": None, "finish_reason": finish_reason, "matched_stop": None})
    body = {
        "id": rid,
        "object": obj,
        "created": created,
        "model": gen.model,
        "choices": [choice],
        "usage": usage(gen.prompt_tokens, completion_tokens),
    }
    body["metadata"] = {
        "weight_version": WEIGHT_VERSION,
        "weight_versions": [{"version": WEIGHT_VERSION, "start": 0, "end": completion_tokens}],
    }
    return body


# SGLang 0.5.23 without a reasoning parser still names reasoning_content in every chat delta (null).
_ROLE_DELTA = b'{"reasoning_content":null,"role":"assistant","content":""}'


class StreamEncoder:
    """SSE chunks for one request: `chat.completion.chunk` or `text_completion` objects."""

    def __init__(self, gen: Generation, rid: str, created: int):
        self._gen = gen
        chat = gen.endpoint == "chat"
        obj = "chat.completion.chunk" if chat else "text_completion"
        head = json.dumps({"id": rid, "object": obj, "created": created, "model": gen.model}, separators=(",", ":"))[
            :-1
        ].encode()
        self._head = b"data: " + head
        self._open = self._head + (
            b',"choices":[{"index":0,"delta":{"reasoning_content":null,"content":'
            if chat
            else b',"choices":[{"index":0,"text":'
        )
        self._tail = b'"logprobs":null,"finish_reason":null,"matched_stop":null}]'
        self._close = (b"}," if chat else b",") + self._tail

    def first(self, n: int) -> bytes:
        """The first tokens; a chat stream opens with the assistant role, as SGLang's does."""
        chunk = self.tokens(0, n)
        if self._gen.endpoint != "chat":
            return chunk
        role = self._head + b',"choices":[{"index":0,"delta":' + _ROLE_DELTA + b"," + self._tail + b"}\n\n"
        return role + chunk

    def tokens(self, start: int, n: int) -> bytes:
        close = self._close
        if self._gen.continuous_usage:
            close += b',"usage":' + _json(usage(self._gen.prompt_tokens, start + n))
        return self._open + _filler_json(start % len(FILLER), n) + close + b"}\n\n"

    def finish(self, reason: str) -> bytes:
        body = b'"delta":{"reasoning_content":null},' if self._gen.endpoint == "chat" else b'"text":"",'
        tail = self._tail.replace(b'"finish_reason":null', b'"finish_reason":' + _json(reason))
        return self._head + b',"choices":[{"index":0,' + body + tail + b"}\n\n"

    def usage(self, completion_tokens: int) -> bytes:
        return (
            self._head + b',"choices":[],"usage":' + _json(usage(self._gen.prompt_tokens, completion_tokens)) + b"}\n\n"
        )


def _json(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":")).encode()


def _sse(value: Any) -> bytes:
    return b"data: " + _json(value) + b"\n\n"


@functools.lru_cache(maxsize=4096)
def _filler_json(offset: int, n: int) -> bytes:
    return _json(filler_text(offset, n))
