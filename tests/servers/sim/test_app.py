"""One test per SGLang endpoint: shapes as in shared/reference/sglang.md (real uvicorn on loopback)."""

import httpx
import pytest

from tests.waiting import wait_until

TIMEOUT = httpx.Timeout(10.0)
CHAT = {"model": "moonshotai/Kimi-K2.5", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 4}


@pytest.fixture
def client():
    with httpx.Client(timeout=TIMEOUT) as c:
        yield c


def hold(client, url, n=1):
    """Start n long streams (slow server) and return their open responses."""
    streams = []
    for _ in range(n):
        request = client.build_request(
            "POST", f"{url}/v1/chat/completions", json={**CHAT, "max_tokens": 20_000, "stream": True}
        )
        streams.append(client.send(request, stream=True))
    return streams


def test_health_and_ready(sim_app, client):
    server = sim_app()
    for path in ("/health", "/health_generate", "/ready"):
        response = client.get(server.url + path)
        assert response.status_code == 200 and response.content == b""


def test_server_info_says_it_is_a_simulator(sim_app, client):
    server = sim_app("k25-eagle3")
    for path in ("/server_info", "/get_server_info"):
        info = client.get(server.url + path).json()
        assert info["simulated"] is True and "no model runs" in info["simulator"]["note"]
        assert info["simulator"]["profile"] == "k25-eagle3" and info["simulator"]["time_scale"] == 1000.0
        assert info["version"] == "0.5.23" and info["served_model_name"] == "moonshotai/Kimi-K2.5"
        assert info["max_running_requests"] == 48 and info["speculative_algorithm"] == "EAGLE3"
        assert info["speculative_num_steps"] == 3 and info["speculative_num_draft_tokens"] == 4
        (state,) = info["internal_states"]
        assert {"speculative_num_steps", "avg_spec_accept_length"} <= set(state)


def test_model_info(sim_app, client):
    server = sim_app("k25-plain")
    for path in ("/model_info", "/get_model_info"):
        info = client.get(server.url + path).json()
        assert info["model_path"] == info["served_model_name"] == "moonshotai/Kimi-K2.5"
        assert info["is_generation"] is True and info["weight_version"] == "default"


def test_models(sim_app, client):
    server = sim_app("llama8b-h200-plain")
    body = client.get(server.url + "/v1/models").json()
    assert body["object"] == "list"
    (card,) = body["data"]
    assert card["id"] == card["root"] == "meta-llama/Llama-3.1-8B-Instruct"
    assert card["object"] == "model" and card["owned_by"] == "sglang" and card["max_model_len"] == 131072
    assert client.get(f"{server.url}/v1/models/meta-llama/Llama-3.1-8B-Instruct").json()["id"] == card["id"]
    missing = client.get(server.url + "/v1/models/other")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"


def test_loads(sim_app, client):
    server = sim_app("k25-eagle3", time_scale=1.0)
    streams = hold(client, server.url, 2)
    try:
        wait_until(lambda: client.get(server.url + "/v1/loads").json()["loads"][0]["num_running_reqs"] == 2)
        body = client.get(server.url + "/v1/loads").json()
        assert {"timestamp", "version", "loads"} <= set(body)
        (load,) = body["loads"]
        assert load["dp_rank"] == 0 and load["num_waiting_reqs"] == 0 and load["max_running_requests"] == 48
        assert load["num_used_tokens"] > 0 and 0 < load["token_usage"] < 1
        assert {"gen_throughput", "max_total_num_tokens", "cache_hit_rate"} <= set(load)
        assert set(load["speculative"]) == {"accept_length", "accept_rate"}
        assert load["queues"]["waiting"] == 0
        only_queues = client.get(server.url + "/v1/loads", params={"include": "queues"}).json()["loads"][0]
        assert "queues" in only_queues and "num_running_reqs" not in only_queues
        text = client.get(server.url + "/v1/loads", params={"format": "prometheus"}).text
        assert 'sglang_num_running_reqs{dp_rank="0"} 2' in text and "sglang_spec_accept_length" in text
        bad = client.get(server.url + "/v1/loads", params={"include": "nope"})
        assert bad.status_code == 400 and "Invalid include sections" in bad.json()["message"]
    finally:
        for s in streams:
            s.close()


def test_metrics_names_and_labels(sim_app, client):
    server = sim_app("k25-eagle3")
    client.post(server.url + "/v1/chat/completions", json=CHAT).raise_for_status()
    text = client.get(server.url + "/metrics").text
    labels = 'engine_type="unified",model_name="moonshotai/Kimi-K2.5",moe_ep_rank="0",pp_rank="0",tp_rank="0"'
    for gauge in (
        "num_running_reqs",
        "num_queue_reqs",
        "token_usage",
        "gen_throughput",
        "spec_accept_length",
        "spec_accept_rate",
        "num_used_tokens",
        "max_total_num_tokens",
    ):
        assert f"sglang:{gauge}{{{labels}}}" in text
    for series in (
        "time_to_first_token_seconds_bucket",
        "inter_token_latency_seconds_bucket",
        "e2e_request_latency_seconds_count",
        "queue_time_seconds_count",
        "prompt_tokens_total",
        "generation_tokens_total",
        "num_requests_total",
        "num_aborted_requests_total",
    ):
        assert f"sglang:{series}" in text
    assert 'sglang:generation_tokens_total{model_name="moonshotai/Kimi-K2.5"} 4.0' in text


def test_flush_cache(sim_app, client):
    server = sim_app(time_scale=1.0)
    assert client.post(server.url + "/flush_cache").status_code == 200
    assert "Cache flushed" in client.get(server.url + "/flush_cache").text
    streams = hold(client, server.url)
    try:
        assert client.post(server.url + "/flush_cache").status_code == 400
    finally:
        streams[0].close()


def test_pause_and_continue_generation(sim_app, client):
    server = sim_app(time_scale=1.0)
    (stream,) = hold(client, server.url)
    lines = stream.iter_lines()
    assert next(lines).startswith("data: ")  # generating
    paused = client.post(server.url + "/pause_generation", json={"mode": "abort"})
    assert paused.json() == {"message": "Generation paused successfully.", "status": "ok"}
    rest = [line for line in lines if line]
    assert '"finish_reason":"abort"' in rest[-2] and rest[-1] == "data: [DONE]"
    assert client.get(server.url + "/health").status_code == 503  # a paused server cannot generate
    assert client.post(server.url + "/pause_generation", json={"mode": "later"}).status_code == 400
    resumed = client.post(server.url + "/continue_generation", json={"torch_empty_cache": True})
    assert resumed.json() == {"message": "Generation continued successfully.", "status": "ok"}
    assert client.post(server.url + "/v1/chat/completions", json=CHAT).status_code == 200


def test_release_and_resume_memory(sim_app, client):
    server = sim_app(time_scale=1000.0)
    streams = hold(client, server.url)
    busy = client.post(server.url + "/release_memory_occupation", json={"tags": None})
    assert busy.status_code == 400 and "requests in flight" in busy.json()["error"]["message"]
    streams[0].close()
    wait_until(lambda: client.get(server.url + "/v1/loads").json()["loads"][0]["num_running_reqs"] == 0)
    released = client.post(server.url + "/release_memory_occupation", json={})
    assert released.status_code == 200 and released.json() is None
    refused = client.post(server.url + "/v1/chat/completions", json=CHAT)
    assert refused.status_code == 503 and "resume_memory_occupation" in refused.json()["message"]
    assert client.post(server.url + "/v1/chat/completions", json={**CHAT, "stream": True}).status_code == 503
    assert client.get(server.url + "/health").status_code == 503
    bad = client.post(server.url + "/resume_memory_occupation", json={"tags": ["gpu"]})
    assert bad.status_code == 400
    partial = client.post(server.url + "/resume_memory_occupation", json={"tags": ["weights"]})
    assert partial.status_code == 200
    assert client.post(server.url + "/v1/chat/completions", json=CHAT).status_code == 503  # KV still released
    assert client.post(server.url + "/resume_memory_occupation").status_code == 200
    assert client.post(server.url + "/v1/chat/completions", json=CHAT).status_code == 200
    assert client.get(server.url + "/health").status_code == 200


def test_release_while_paused_with_queued_requests_is_allowed(sim_app, client):
    server = sim_app(time_scale=100.0)
    (stream,) = hold(client, server.url)
    try:
        client.post(server.url + "/pause_generation", json={"mode": "retract"}).raise_for_status()
        wait_until(lambda: client.get(server.url + "/v1/loads").json()["loads"][0]["num_waiting_reqs"] == 1)
        assert client.post(server.url + "/release_memory_occupation").status_code == 200
    finally:
        stream.close()


def test_startup_delay(sim_app, client):
    server = sim_app(startup_delay_s=5)  # long enough for the two requests below, however busy the machine
    assert client.get(server.url + "/health").status_code == 503
    starting = client.post(server.url + "/v1/chat/completions", json=CHAT)
    assert starting.status_code == 503 and "starting" in starting.json()["message"]
    wait_until(lambda: client.get(server.url + "/health").status_code == 200, timeout=30.0)
    assert client.post(server.url + "/v1/chat/completions", json=CHAT).status_code == 200


def test_unknown_paths_and_methods_get_error_bodies(sim_app, client):
    server = sim_app()
    missing = client.get(server.url + "/v2/anything")
    assert missing.status_code == 404 and missing.json()["code"] == 404 and missing.json()["object"] == "error"
    wrong = client.get(server.url + "/v1/chat/completions")
    assert wrong.status_code == 405 and wrong.json()["type"] == "MethodNotAllowed"


def test_switch_costs_come_from_the_profile_divided_by_the_time_scale(sim_app, client, tmp_path):
    profile = tmp_path / "slow-start.toml"
    profile.write_text(
        'kind = "parametric"\nmodel_name = "m"\n[limits]\nmax_running_requests = 4\nmax_total_num_tokens = 10000\n'
        "[prefill]\n[decode]\nfixed_s = 0.01\n[memory]\nstartup_s = 50.0\nrelease_s = 20.0\nresume_s = 30.0\n"
    )
    server = sim_app(str(profile), time_scale=100.0, startup_delay_s=None)
    delays = client.get(server.url + "/server_info").json()["simulator"]["delays_s"]
    assert delays == {"startup": 0.5, "release": 0.2, "resume": 0.3}
    assert client.get(server.url + "/health").status_code == 503  # loading weights: 50 s / 100
    wait_until(lambda: client.get(server.url + "/health").status_code == 200, timeout=10.0)


def test_wall_clock_delays_override_the_profile(serve, client):
    from crossover.servers.sim.app import SimSettings, create_app
    from crossover.servers.sim.profile import load_profile

    settings = SimSettings(
        profile=load_profile("k25-eagle3"), time_scale=1.0, startup_delay_s=0.0, release_delay_s=0.05, resume_delay_s=0
    )
    server = serve(create_app(settings))
    assert client.get(server.url + "/health").status_code == 200  # not 420 s of weight loading
    delays = client.get(server.url + "/server_info").json()["simulator"]["delays_s"]
    assert delays == {"startup": 0.0, "release": 0.05, "resume": 0.0}
    assert client.post(server.url + "/release_memory_occupation").status_code == 200
    assert client.post(server.url + "/resume_memory_occupation").status_code == 200


def memory(client, url):
    return client.get(url + "/server_info").json()["memory"]


def test_every_release_attempt_is_counted(sim_app, client):
    server = sim_app(time_scale=100.0)
    assert memory(client, server.url) == {
        "released": [],
        "release_total": 0,
        "release_refused_total": 0,
        "resume_total": 0,
        "resume_not_released_total": 0,
    }
    (stream,) = hold(client, server.url)
    try:
        for _ in range(2):
            assert client.post(server.url + "/release_memory_occupation").status_code == 400
    finally:
        stream.close()
    wait_until(lambda: client.get(server.url + "/v1/loads").json()["loads"][0]["num_running_reqs"] == 0)
    assert client.post(server.url + "/release_memory_occupation", json={"tags": ["weights"]}).status_code == 200
    report = memory(client, server.url)
    assert report["released"] == ["weights"]
    assert (report["release_total"], report["release_refused_total"], report["resume_total"]) == (1, 2, 0)
    assert (
        'crossover_sim_release_refused_total{model_name="moonshotai/Kimi-K2.5"} 2.0'
        in client.get(server.url + "/metrics").text
    )
    assert client.post(server.url + "/resume_memory_occupation", json={"tags": ["weights"]}).status_code == 200
    # Resuming what is not released: SGLang 0.5.23 dies of it (KeyError); the stand-in goes on and counts it.
    assert client.post(server.url + "/resume_memory_occupation").status_code == 200
    report = memory(client, server.url)
    assert report["released"] == [] and report["resume_total"] == 2 and report["resume_not_released_total"] == 1


def test_requests_sent_while_paused_wait_before_the_engine(sim_app, client):
    # SGLang's tokenizer manager holds them (no queue limit, not in the scheduler's counts) until continue.
    server = sim_app(time_scale=100.0)
    client.post(server.url + "/pause_generation", json={"mode": "in_place"}).raise_for_status()
    with httpx.Client(timeout=TIMEOUT) as other:
        request = other.build_request("POST", server.url + "/v1/chat/completions", json={**CHAT, "stream": True})
        stream = other.send(request, stream=True)
        try:
            loads = lambda: client.get(server.url + "/v1/loads").json()["loads"][0]  # noqa: E731
            wait_until(lambda: loads()["queues"]["paused"] == 1)
            assert loads()["num_waiting_reqs"] == 0 and loads()["num_running_reqs"] == 0
            assert client.get(server.url + "/ready").status_code == 503
            client.post(server.url + "/continue_generation").raise_for_status()
            lines = [line for line in stream.iter_lines() if line]
            assert '"finish_reason":"length"' in lines[-2] and lines[-1] == "data: [DONE]"
        finally:
            stream.close()


def test_continue_while_released_fails_the_held_requests_clearly(sim_app, client):
    server = sim_app(time_scale=1000.0)
    client.post(server.url + "/pause_generation", json={"mode": "retract"}).raise_for_status()
    with httpx.Client(timeout=TIMEOUT) as other:
        streaming = other.send(
            other.build_request("POST", server.url + "/v1/chat/completions", json={**CHAT, "stream": True}),
            stream=True,
        )
        try:
            wait_until(lambda: client.get(server.url + "/v1/loads").json()["loads"][0]["queues"]["paused"] == 1)
            # Held requests are not in the scheduler, so SGLang's idle check passes and the release goes ahead.
            assert client.post(server.url + "/release_memory_occupation").status_code == 200
            assert client.get(server.url + "/health").status_code == 503
            client.post(server.url + "/continue_generation").raise_for_status()
            lines = [line for line in streaming.iter_lines() if line]
            assert '"code":503' in lines[0] and "resume_memory_occupation" in lines[0]
            assert lines[-1] == "data: [DONE]"
        finally:
            streaming.close()
    refused = client.post(server.url + "/v1/chat/completions", json=CHAT)
    assert refused.status_code == 503 and "released" in refused.json()["message"]


def test_flush_cache_while_paused_with_retracted_requests(sim_app, client):
    server = sim_app(time_scale=100.0)
    (stream,) = hold(client, server.url)
    try:
        assert client.post(server.url + "/pause_generation", json={"mode": "in_place"}).status_code == 200
        assert client.post(server.url + "/flush_cache").status_code == 400  # in place: still running
        assert client.post(server.url + "/pause_generation", json={"mode": "retract"}).status_code == 200
        assert client.post(server.url + "/flush_cache").status_code == 200  # only waiting, and paused
    finally:
        stream.close()
