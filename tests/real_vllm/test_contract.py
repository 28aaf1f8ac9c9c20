"""The gateway's contract against real vLLM 0.32.0 on CPU, the speculative pool running EAGLE-3.

Through the gateway (partitioned, one vLLM server a pool) with the official `openai` client and raw HTTP: the
stream's text, usage, finish reason and `data: [DONE]`; vLLM's own errors passed through with their status; a
client that leaves is aborted inside vLLM; the speculative server really speculates (its accepted-token
counter grows) at the mean length it was set to.

Both pools are `engine = "vllm"`: the gateway probes vLLM's `/health`, learns the model from `/v1/models` and
reads each server's load from the `vllm:num_requests_running` / `_waiting` gauges (gateway/engines/vllm.py; with
`load_signal` other than "local"), checked here while a stream is held.
"""

from __future__ import annotations

import socket

import httpx
import openai
import pytest

from crossover.gateway.engines.vllm import DEV_MODE_ENV, IS_SLEEPING_PATH, RUNNING, SPEC_ACCEPTED
from crossover.servers.process import LOOPBACK
from tests.gateway.gateway_helpers import sse_events
from tests.real_vllm.conftest import ACCEPTANCE_LENGTH, DRAFT_TOKENS, PROBE_TOKENS, VLLMServer, dev_mode_launch
from tests.waiting import wait_until

GENERATED = "vllm:generation_tokens_total"
ACCEPTED = f"{SPEC_ACCEPTED}_total"  # a counter's sample
DRAFTS = "vllm:spec_decode_num_drafts_total"
MESSAGES = [{"role": "user", "content": "Count from one to ten."}]
ALL_SPECULATIVE = 1000  # spillover threshold: every request goes to the speculative pool
ALL_PLAIN = 0


SPEC_CHECK_TOKENS = 200


def client(gateway_url: str, timeout: float) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway_url + "/v1", api_key="unused", max_retries=0, timeout=timeout)


@pytest.fixture
def speculative_gateway(vllm_gateway):
    # Load read from the engines too (load_signal "max"), so a test can see the gateway read vLLM's gauges.
    return vllm_gateway(policy="spillover", threshold=ALL_SPECULATIVE, load_signal="max")


@pytest.mark.parametrize("threshold", [ALL_SPECULATIVE, ALL_PLAIN], ids=["speculative", "plain"])
def test_a_stream_through_the_official_client_has_text_usage_finish_and_done(vllm_gateway, real_vllm, threshold):
    gw = vllm_gateway(policy="spillover", threshold=threshold)
    stream = client(gw.url, real_vllm.bound(24)).chat.completions.create(
        model=real_vllm.model,
        messages=MESSAGES,
        max_tokens=24,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    text = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
    finishes = [chunk.choices[0].finish_reason for chunk in chunks if chunk.choices and chunk.choices[0].finish_reason]
    assert text and finishes == ["length"]
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage.completion_tokens == 24
    assert usage.total_tokens == usage.prompt_tokens + 24 and usage.prompt_tokens > 0
    # The raw stream ends as vLLM ends it, the pool chosen as routed. (Its text is not judged: four tokens sampled
    # from random weights may all be pieces of a character, which vLLM holds back - an empty text.)
    body = {"model": real_vllm.model, "messages": MESSAGES, "max_tokens": 4, "stream": True}
    body |= {"stream_options": {"include_usage": True}, "ignore_eos": True}
    raw = httpx.post(gw.url + "/v1/chat/completions", json=body, timeout=real_vllm.timeout(4), trust_env=False)
    assert raw.status_code == 200 and raw.headers["content-type"].startswith("text/event-stream")
    assert raw.content.endswith(b"data: [DONE]\n\n")
    *events, done = sse_events(raw.content)
    assert done == "[DONE]" and all(event["object"] == "chat.completion.chunk" for event in events)
    assert [choice["finish_reason"] for event in events for choice in event["choices"] if choice["finish_reason"]] == [
        "length"
    ]
    assert events[-1]["usage"]["completion_tokens"] == 4
    assert raw.headers["x-crossover-pool"] == ("speculative" if threshold else "plain")


def mean_accept_length(server: VLLMServer, url: str, model: str) -> float:
    """Generate SPEC_CHECK_TOKENS through `url` (a gateway routing to `server`, or the server) and read the mean
    accept length of the verify rounds in between from `server`'s own counters. AssertionError where the server
    does not speculate: no counters, or none grew."""
    accepted, drafts = server.metric(ACCEPTED), server.metric(DRAFTS)
    answer = client(url, server.bound(SPEC_CHECK_TOKENS)).completions.create(
        model=model, prompt="Say OK.", max_tokens=SPEC_CHECK_TOKENS, extra_body={"ignore_eos": True}
    )
    assert answer.usage.completion_tokens == SPEC_CHECK_TOKENS
    more_accepted, more_drafts = server.metric(ACCEPTED) - accepted, server.metric(DRAFTS) - drafts
    assert more_drafts > 0 and more_accepted > 0, f"{server.mode}: no verify round accepted a draft"
    # Each verify step emits its accepted drafts plus one token; synthetic acceptance sets their mean.
    return 1 + more_accepted / more_drafts


def test_the_speculative_server_runs_eagle3_at_the_acceptance_it_was_set_to(speculative_gateway, real_vllm):
    mean_length = mean_accept_length(real_vllm.servers["speculative"], speculative_gateway.url, real_vllm.model)
    assert 1.5 < mean_length <= DRAFT_TOKENS + 1, mean_length
    assert mean_length == pytest.approx(ACCEPTANCE_LENGTH, abs=0.5)


def test_the_speculation_check_fails_on_a_server_launched_without_eagle3(real_vllm):
    # The check above against the plain server, launched as the speculative one would be but without
    # --speculative-config: a suite whose speculative server lost its EAGLE-3 fails, it does not pass quietly.
    plain = real_vllm.servers["plain"]
    with pytest.raises(AssertionError, match=f"plain: no {ACCEPTED} in /metrics"):
        mean_accept_length(plain, plain.url, real_vllm.model)


def outward_address() -> str | None:
    """This host's address on its network (the interface a packet out would leave by), None without one."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("198.51.100.1", 9))  # TEST-NET-2; nothing is sent: a UDP connect only picks a route
        except OSError:
            return None
        address = probe.getsockname()[0]
    return None if address.startswith("127.") else address


def test_dev_mode_as_the_shipped_sleep_profile_launches_it_is_reachable_on_loopback_only(real_vllm):
    # The plain server runs in vLLM's dev mode on the host the shipped sleeping profile gives its servers.
    host, env = dev_mode_launch()
    assert host == LOOPBACK and env == {DEV_MODE_ENV: "1"}
    plain = real_vllm.servers["plain"]
    # Its dev routes are there, for the agent on this host to call.
    asleep = httpx.get(plain.url + IS_SLEEPING_PATH, timeout=real_vllm.timeout(0), trust_env=False)
    assert asleep.status_code == 200 and asleep.json() == {"is_sleeping": False}
    address = outward_address()
    if address is None:
        pytest.skip("this host has no network address but loopback: nothing off-host to be unreachable from")
    port = httpx.URL(plain.url).port
    with pytest.raises(httpx.ConnectError):
        httpx.post(f"http://{address}:{port}/collective_rpc", json={"method": "noop"}, timeout=5, trust_env=False)


def test_a_bad_parameter_is_vllms_400_with_its_message(speculative_gateway, real_vllm):
    with pytest.raises(openai.BadRequestError) as raised:
        client(speculative_gateway.url, real_vllm.bound(2)).chat.completions.create(
            model=real_vllm.model, messages=MESSAGES, max_tokens=2, temperature=-1
        )
    direct = httpx.post(
        real_vllm.servers["speculative"].url + "/v1/chat/completions",
        json={"model": real_vllm.model, "messages": MESSAGES, "max_tokens": 2, "temperature": -1},
        timeout=real_vllm.timeout(2),
        trust_env=False,
    )
    assert direct.status_code == 400
    assert raised.value.status_code == 400
    message = direct.json()["error"]["message"]
    assert "temperature" in message
    assert raised.value.body["message"] == message


def test_a_prompt_past_the_context_is_vllms_400(speculative_gateway, real_vllm):
    long = [{"role": "user", "content": "hello world " * real_vllm.max_model_len}]
    with pytest.raises(openai.BadRequestError) as raised:
        client(speculative_gateway.url, real_vllm.bound(2)).chat.completions.create(
            model=real_vllm.model, messages=long, max_tokens=2
        )
    assert raised.value.status_code == 400
    assert f"maximum context length is {real_vllm.max_model_len} tokens" in raised.value.body["message"]


def test_a_client_that_leaves_mid_stream_is_aborted_in_vllm(speculative_gateway, real_vllm):
    server = real_vllm.servers["speculative"]
    server.wait_for(RUNNING, 0)
    generated = server.metric(GENERATED)
    body = {
        "model": real_vllm.model,
        "messages": MESSAGES,
        "max_tokens": real_vllm.max_model_len - 64,
        "ignore_eos": True,
        "stream": True,
    }
    with (
        httpx.Client(timeout=real_vllm.timeout(PROBE_TOKENS), trust_env=False) as http,
        http.stream("POST", speculative_gateway.url + "/v1/chat/completions", json=body) as response,
    ):
        assert response.status_code == 200
        # Held while the stream is open: a dropped iterator closes the response (the client would leave now).
        chunks = response.iter_bytes()
        assert next(chunks).startswith(b"data: ")
        assert response.headers["x-crossover-pool"] == "speculative"
        server.wait_for(RUNNING, 1)
        # The gateway reads the same load from vLLM's gauges.
        scraped = {"pool": "speculative", "backend": server.url}
        wait_until(lambda: speculative_gateway.metric("crossover_backend_scraped_load", **scraped) == 1)
    # The client closed its connection: the gateway drops its backend stream and vLLM aborts the request, long
    # before the thousands of tokens it was asked for.
    server.wait_for(RUNNING, 0)
    assert server.metric(GENERATED) - generated < body["max_tokens"] / 2
    wait_until(lambda: speculative_gateway.metric("crossover_backend_scraped_load", **scraped) == 0)
    speculative_gateway.settled()
