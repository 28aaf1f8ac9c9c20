import httpx
from prometheus_client import CollectorRegistry

MODEL = "moonshotai/Kimi-K2.5"
TOKENIZER_LABELS = {"model_name": MODEL}
SCHEDULER_LABELS = {"model_name": MODEL, "engine_type": "unified", "tp_rank": "0", "pp_rank": "0", "moe_ep_rank": "0"}


def test_counters_and_histograms_count_finished_requests(sim_app):
    registry = CollectorRegistry()
    server = sim_app("k25-eagle3", registry=registry)
    with httpx.Client(timeout=10.0) as client:
        for stream in (False, True):
            body = {"messages": [{"role": "user", "content": "a b c"}], "max_tokens": 30, "stream": stream}
            client.post(f"{server.url}/v1/chat/completions", json=body).raise_for_status()
        client.post(f"{server.url}/v1/completions", json={"prompt": [1, 2], "max_tokens": 5}).raise_for_status()
    value = registry.get_sample_value
    assert value("sglang:num_requests_total", TOKENIZER_LABELS) == 3
    assert value("sglang:prompt_tokens_total", TOKENIZER_LABELS) == 3 + 3 + 2
    assert value("sglang:generation_tokens_total", TOKENIZER_LABELS) == 30 + 30 + 5
    assert value("sglang:time_to_first_token_seconds_count", TOKENIZER_LABELS) == 3
    assert value("sglang:e2e_request_latency_seconds_count", TOKENIZER_LABELS) == 3
    # One inter-token observation per token after the first of the streamed request (chunked ITL per token).
    assert value("sglang:inter_token_latency_seconds_count", TOKENIZER_LABELS) == 29
    assert value("sglang:num_aborted_requests_total", TOKENIZER_LABELS) == 0
    assert value("sglang:num_running_reqs", SCHEDULER_LABELS) == 0
    assert value("sglang:max_total_num_tokens", SCHEDULER_LABELS) == 90000
    assert 1.0 <= value("sglang:spec_accept_length", SCHEDULER_LABELS) <= 4.0
    assert value("sglang:spec_num_steps", SCHEDULER_LABELS) == 3
    assert value("sglang:gen_throughput", SCHEDULER_LABELS) > 0


def test_extra_labels_reach_every_metric(serve):
    from crossover.servers.sim.app import SimSettings, create_app
    from crossover.servers.sim.profile import load_profile

    registry = CollectorRegistry()
    settings = SimSettings(
        profile=load_profile("k25-plain"),
        time_scale=1000.0,
        startup_delay_s=0.0,
        extra_metric_labels={"variant": "base"},
    )
    server = serve(create_app(settings, registry=registry))
    httpx.post(f"{server.url}/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=10.0)
    assert registry.get_sample_value("sglang:num_requests_total", {**TOKENIZER_LABELS, "variant": "base"}) == 1
    assert registry.get_sample_value("sglang:num_queue_reqs", {**SCHEDULER_LABELS, "variant": "base"}) == 0
    assert registry.get_sample_value("sglang:spec_accept_length", {**SCHEDULER_LABELS, "variant": "base"}) == 0
