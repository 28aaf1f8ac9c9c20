"""One request against a scripted backend: success needs tokens, usage and [DONE]; every failure is a failure."""

from __future__ import annotations

import asyncio
import json
import socket

import httpx
import pytest

from crossover.loadtest.client import describe_transport_error, run_request
from tests.loadtest.scripted_backend import CHUNKS, PROMPT_TOKENS, TOKENS_PER_CHUNK

TIMEOUT_S = 10.0


def request(url: str, model: str, total_timeout: float = TIMEOUT_S):
    async def go():
        async with httpx.AsyncClient(timeout=TIMEOUT_S) as client:
            body = json.dumps({"model": model, "messages": [], "stream": True}).encode()
            return await run_request(client, f"{url}/v1/chat/completions", body, {}, total_timeout)

    return asyncio.run(go())


def test_success_counts_tokens_from_usage_and_tokens_per_chunk(backend):
    result = request(backend, "ok")
    assert result.success, result.error
    assert result.output_tokens == CHUNKS * TOKENS_PER_CHUNK
    assert result.prompt_tokens == PROMPT_TOKENS
    assert result.ttft is not None and 0 < result.ttft <= result.latency
    assert len(result.chunk_times) == CHUNKS and len(result.chunk_gaps) == CHUNKS - 1
    assert result.chunk_tokens == [TOKENS_PER_CHUNK] * CHUNKS


def test_usage_only_at_the_end_still_succeeds_without_per_chunk_counts(backend):
    result = request(backend, "ok-final-usage")
    assert result.success, result.error
    assert result.output_tokens == CHUNKS * TOKENS_PER_CHUNK
    assert result.chunk_tokens is None


@pytest.mark.parametrize(
    ("model", "reason"),
    [
        ("http-503", "HTTP 503: 503: no healthy backend"),
        ("error-first", "stream error event: 503: The request queue is full."),
        ("error-mid", "stream error event: 503: The request queue is full."),
        ("cut", "stream ended without [DONE]"),
        ("no-usage", "stream carried no usage"),
        ("unknown-model", "HTTP 404"),
    ],
)
def test_failures_are_failures_with_a_reason(backend, model, reason):
    result = request(backend, model)
    assert not result.success
    assert result.error.startswith(reason), result.error
    assert result.end >= result.start


@pytest.mark.parametrize(
    ("model", "kind"),
    [
        ("http-503", "HTTP 503"),
        ("error-mid", "stream error event"),
        ("cut", "cut before [DONE]"),
        ("no-usage", "no usage"),
        ("unknown-model", "HTTP 404"),
    ],
)
def test_each_failure_has_a_kind_a_level_counts_it_by(backend, model, kind):
    assert request(backend, model).error_kind == kind


def test_a_transport_error_names_the_cause_under_its_empty_message():
    # httpx's ReadError usually says nothing itself: the OSError it wraps, and what the kind means, explain it.
    reset = ConnectionResetError(104, "Connection reset by peer")
    try:
        try:
            raise reset
        except OSError as exc:
            raise httpx.ReadError("") from exc
    except httpx.ReadError as exc:
        message = describe_transport_error(exc)
    assert message.startswith("ReadError: [Errno 104] Connection reset by peer (the connection failed while")


def test_a_stalled_stream_times_out_as_a_failure(backend):
    result = request(backend, "stall", total_timeout=0.5)
    assert not result.success
    assert result.error == "timed out after 0.5 s"


def test_an_unreachable_server_is_a_failure():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))  # bound, never listening: connections are refused
        result = request(f"http://127.0.0.1:{s.getsockname()[1]}", "ok")
    assert not result.success
    assert result.error.startswith("ConnectError") and result.error_kind == "ConnectError"
