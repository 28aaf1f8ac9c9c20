"""The stand-in playing vLLM (`--engine vllm`): vLLM 0.32's endpoints, metric names and error shapes."""

from __future__ import annotations

import json

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.waiting import wait_until

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
TIMEOUT = httpx.Timeout(10.0)
# Tokens that keep a real-time (time scale 1) stand-in busy for many seconds.
LONG = 4000


@pytest.fixture
def client():
    with httpx.Client(timeout=TIMEOUT, trust_env=False) as c:
        yield c


def chat(max_tokens: int = 4, stream: bool = False) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": max_tokens, "stream": stream}


def samples(client, url: str) -> dict[str, float]:
    """name -> value of every sample on /metrics (label sets summed)."""
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(client.get(url + "/metrics").text):
        for sample in family.samples:
            values[sample.name] = values.get(sample.name, 0.0) + sample.value
    return values


def test_it_answers_as_vllm_does_health_models_version_and_no_sglang_endpoints(sim_app, client):
    server = sim_app("llama8b-h200-plain", engine="vllm")
    assert client.get(server.url + "/health").status_code == 200
    (card,) = client.get(server.url + "/v1/models").json()["data"]
    assert card["id"] == MODEL and card["owned_by"] == "vllm"
    assert client.get(server.url + "/version").json() == {"version": "0.32.0"}
    info = client.get(server.url + "/server_info").json()  # says it is a simulator, as the SGLang stand-in does
    assert info["simulated"] is True and "vLLM stand-in" in info["simulator"]["note"]
    assert info["version"] == "0.32.0" and info["schedule"]["time_scale"] == info["simulator"]["time_scale"]
    for path in ("/v1/loads", "/pause_generation", "/sleep"):
        response = client.post(server.url + path) if path != "/v1/loads" else client.get(server.url + path)
        assert response.status_code in (404, 405), path
        # vLLM's HTTPException handler: {"error": {message, type (the status phrase), param, code}}.
        assert response.json()["error"]["code"] == response.status_code


def test_metrics_carry_vllm_names_and_labels_and_the_speculative_counters_grow(sim_app, client):
    server = sim_app("llama8b-h200-eagle3", engine="vllm")
    before = samples(client, server.url)
    assert before["vllm:num_requests_running"] == 0 and before["vllm:num_requests_waiting"] == 0
    assert not any(name.startswith("sglang:") for name in before)
    assert client.post(server.url + "/v1/chat/completions", json=chat(32)).status_code == 200
    after = samples(client, server.url)
    drafts = after["vllm:spec_decode_num_drafts_total"]
    assert drafts > 0 and after["vllm:spec_decode_num_draft_tokens_total"] == 3 * drafts
    assert after["vllm:spec_decode_num_accepted_tokens_total"] > before["vllm:spec_decode_num_accepted_tokens_total"]
    assert after["vllm:generation_tokens_total"] == 32 and after["vllm:request_success_total"] == 1
    text = client.get(server.url + "/metrics").text
    assert 'vllm:num_requests_running{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"}' in text
    plain = sim_app("llama8b-h200-plain", engine="vllm")
    assert "vllm:spec_decode_num_drafts_total" not in samples(client, plain.url)


def test_errors_are_vllm_shaped_as_a_body_and_as_a_stream_event(sim_app, client):
    server = sim_app("llama8b-h200-plain", engine="vllm", time_scale=1.0, max_running_requests=1, max_queued_requests=1)
    bad = client.post(server.url + "/v1/chat/completions", json={"model": MODEL, "messages": "nope"})
    assert bad.status_code == 400 and set(bad.json()) == {"error"}
    assert bad.json()["error"]["code"] == 400 and bad.json()["error"]["type"] == "BadRequestError"
    # One request runs, one waits, the queue takes no more: vLLM's QueueOverflowError, 503, as a body and an event.
    with httpx.Client(timeout=TIMEOUT, trust_env=False) as holder:
        held = [
            holder.send(
                holder.build_request("POST", server.url + "/v1/chat/completions", json=chat(LONG, True)), stream=True
            )
            for _ in range(2)
        ]

        def full() -> bool:
            values = samples(client, server.url)
            return values["vllm:num_requests_running"] == 1 and values["vllm:num_requests_waiting"] == 1

        wait_until(full, 10, what="one running, one waiting")
        busy = client.post(server.url + "/v1/chat/completions", json=chat())
        assert busy.status_code == 503
        error = busy.json()["error"]
        assert error["code"] == 503 and error["type"] == "Service Unavailable"
        assert error["message"].startswith("The engine is currently busy")
        event = client.post(server.url + "/v1/chat/completions", json=chat(stream=True))
        assert event.status_code == 200
        first, done = [line for line in event.text.splitlines() if line]
        assert done == "data: [DONE]"
        assert json.loads(first.removeprefix("data: "))["error"] == {**error, "message": error["message"]}
        for response in held:
            response.close()


def test_sleep_and_wake_up_with_sleep_mode_hold_requests_while_asleep(sim_app, client):
    server = sim_app("llama8b-h200-plain", engine="vllm", sleep_mode=True)
    assert client.get(server.url + "/is_sleeping").json() == {"is_sleeping": False}
    assert client.post(server.url + "/sleep?level=1&mode=abort").json() == {"status": "sleeping", "level": 1}
    assert client.get(server.url + "/is_sleeping").json() == {"is_sleeping": True}
    assert client.get(server.url + "/health").status_code == 200  # vLLM's /health: the engine lives
    with (
        httpx.Client(timeout=TIMEOUT, trust_env=False) as other,
        other.stream("POST", server.url + "/v1/chat/completions", json=chat(stream=True)) as waiting,
    ):
        # Held, not refused: it completes once the server wakes up.
        assert client.post(server.url + "/wake_up").json()["status"] == "awake"
        body = b"".join(waiting.iter_bytes())
    assert waiting.status_code == 200 and body.endswith(b"data: [DONE]\n\n") and b'"error"' not in body
    assert client.get(server.url + "/is_sleeping").json() == {"is_sleeping": False}
    assert client.post(server.url + "/wake_up").status_code == 200  # awake already: harmless, as in vLLM
    assert client.post(server.url + "/sleep?level=3").status_code == 400
    assert client.post(server.url + "/sleep?mode=keep").status_code == 400


def test_a_sleep_in_abort_mode_ends_what_runs(sim_app, client):
    server = sim_app("llama8b-h200-plain", engine="vllm", sleep_mode=True, time_scale=1.0)
    with client.stream("POST", server.url + "/v1/chat/completions", json=chat(LONG, stream=True)) as running:
        wait_until(lambda: samples(client, server.url)["vllm:num_requests_running"] == 1, 10, what="one running")
        with httpx.Client(timeout=TIMEOUT, trust_env=False) as other:
            assert other.post(server.url + "/sleep?level=1&mode=abort").status_code == 200
        body = b"".join(running.iter_bytes())
    assert b'"finish_reason":"abort"' in body and body.endswith(b"data: [DONE]\n\n")
    assert samples(client, server.url)["vllm:num_requests_running"] == 0


def test_the_cli_refuses_what_vllm_does_not_have(sim):
    import subprocess
    import sys

    for extra, message in ((["--enable-sleep-mode"], "--enable-sleep-mode is vLLM's"),):
        argv = [sys.executable, "-m", "crossover.gateway.cli", "sim", "serve", "--profile", "llama8b-h200-eagle3"]
        result = subprocess.run([*argv, "--port", "1", *extra], capture_output=True, text=True, timeout=60, check=False)
        assert result.returncode == 2 and message in result.stderr
