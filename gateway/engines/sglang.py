"""SGLang's runtime surface, known in one place: what the gateway and the supervisor call on a running server.

    load = load_from_loads((await client.get(url + LOADS_PATH)).json())  # running + waiting, over ranks
    await control(client, url, RELEASE, headers=headers, timeout=30)     # release / resume / pause / continue
    problem = await generate_once(client, url, headers=headers, timeout=30)  # None: it generated a token
    gate = await write_gate(client, url, 32, headers=headers, timeout=5)  # patched servers: the speculation gate
    reading = acceptance_from_metrics((await client.get(url + METRICS_PATH)).text)  # spec_accept_length

Checked against SGLang 0.5.23 (`../shared/reference/sglang.md`). The next release that moves an endpoint or
changes a body touches this file only.
"""

from __future__ import annotations

import asyncio

import httpx
from prometheus_client.parser import text_string_to_metric_families

from crossover.gateway.engines.calls import ControlCall, SpecReading
from crossover.gateway.engines.calls import EngineError as SGLangError  # noqa: F401  (the name callers use)
from crossover.gateway.engines.fence import FENCED, fence_headers, is_fenced
from crossover.gateway.engines.gate import Gate, GateFenced, GateRejected, MalformedGate, NotPatched, whole

# Load endpoints: `/v1/loads` (0.5.x), `/get_load` (older releases), both JSON.
LOADS_PATH = "/v1/loads"
LEGACY_LOAD_PATH = "/get_load"


# The scheduler's mean tokens per verify step (bonus included) over its last decode-log window (`--decode-log-interval`,
# 40 decode batches): accepted tokens / verify rounds of those batches, held until the next window. 0 on a server
# without speculation, and until its first window.
SPEC_ACCEPT_LENGTH = "sglang:spec_accept_length"


# The memory saver (servers started with --enable-memory-saver): weights and KV cache out of / back into GPU
# memory. SGLang asserts the server is idle on a release; 0.5.23 dies on a resume of memory it holds.
RELEASE = ControlCall("release", "/release_memory_occupation", {"tags": None})
RESUME = ControlCall("resume", "/resume_memory_occupation", {"tags": None})
# Pause in abort mode ends every request the server holds (other clients' too); continue undoes it.
PAUSE = ControlCall("pause", "/pause_generation", {"mode": "abort"})
CONTINUE = ControlCall("continue", "/continue_generation", {})

# SGLang's "The request queue is full." is an error event with this status inside an HTTP 200 stream.
QUEUE_FULL_STATUS = 503


def load_from_loads(payload: object) -> int:
    """`/v1/loads` (`{"loads": [rank, ...]}`) or `/get_load` (`[rank, ...]`): running + waiting, summed over ranks."""
    ranks = payload.get("loads", payload) if isinstance(payload, dict) else payload
    if isinstance(ranks, dict):
        ranks = [ranks]
    if not isinstance(ranks, list) or not ranks:
        raise ValueError("no load entries")
    total = 0
    for rank in ranks:
        running = rank.get("num_running_reqs", rank.get("num_reqs"))
        if running is None:
            raise ValueError("no running-request count")
        total += int(running) + int(rank.get("num_waiting_reqs", 0))
    return total


def load_from_metrics(text: str) -> int:
    """Prometheus text: `sglang:num_running_reqs` + `sglang:num_queue_reqs`; TP ranks repeat their DP rank's
    value, DP ranks add up."""
    by_rank: dict[tuple[str, str], float] = {}
    for family in text_string_to_metric_families(text):
        if family.name not in ("sglang:num_running_reqs", "sglang:num_queue_reqs"):
            continue
        for sample in family.samples:
            key = (family.name, sample.labels.get("dp_rank", "0"))
            by_rank[key] = max(by_rank.get(key, 0.0), sample.value)
    if not by_rank:
        raise ValueError("no sglang:num_running_reqs gauge")
    return int(sum(by_rank.values()))


def acceptance_from_metrics(text: str, previous: SpecReading | None = None) -> SpecReading | None:
    """Prometheus text: `sglang:spec_accept_length`, averaged over the ranks that report one (TP ranks repeat their
    DP rank's); None when no rank does (no speculation, or no window yet). A gauge: `previous` is not needed."""
    values = [
        sample.value
        for family in text_string_to_metric_families(text)
        if family.name == SPEC_ACCEPT_LENGTH
        for sample in family.samples
        if sample.value > 0  # NaN and 0 are no reading
    ]
    return SpecReading(sum(values) / len(values)) if values else None


# The run-time speculation gate of a server patched with patches/sglang-0.5.23 (`/speculative/adaptive`).
PATCH_NAME = "patches/sglang-0.5.23 (the run-time speculation gate)"
PATCH_HINT = f"apply {PATCH_NAME} with `crossover patches apply` on the GPU host and restart it"
GATE_PATH = "/speculative/adaptive"


async def read_gate(client: httpx.AsyncClient, url: str, *, headers: dict[str, str] | None, timeout: float) -> Gate:
    """The gate as the engine holds it now, in every DP group; NotPatched or GateRejected if it cannot say."""
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
    """Zero draft steps for batches of more than `gate` requests (None: no gate; 0: never speculate); `dry_run`:
    the engine checks it and changes nothing; `expected_generation`: only if no one moved it since (else
    GateRejected, status 409); `fence`: the token of the lease this gateway holds (GateFenced if the engine has
    accepted a newer one). `headers` carry the admin key: the patch's POST demands it."""
    body: dict = {"zero_steps_above_bs": gate}
    if dry_run:
        body["dry_run"] = True
    if expected_generation is not None:
        body["expected_generation"] = expected_generation  # compare-and-set: 409 if the gate moved since
    headers = {**(headers or {}), **fence_headers(fence)}
    async with asyncio.timeout(timeout):
        return _gate(url, await client.post(url + GATE_PATH, json=body, headers=headers, timeout=timeout))


def _gate(url: str, response: httpx.Response) -> Gate:
    if response.status_code in (404, 405):
        raise NotPatched(f"{url} has no {GATE_PATH} (HTTP {response.status_code}): {PATCH_HINT}")
    try:
        body = response.json()
    except ValueError:
        body = {}
    if response.status_code != 200 or not isinstance(body, dict) or not body.get("success"):
        message = (body.get("message") or body.get("error")) if isinstance(body, dict) else None
        reason = body.get("reason") if isinstance(body, dict) else None
        text = f"{url} {GATE_PATH}: HTTP {response.status_code}" + (f" ({reason})" if reason else "")
        text += f": {message or response.text[:200]}"
        if response.status_code == 501:
            raise NotPatched(text)
        if is_fenced(response.status_code, body):
            raise GateFenced(text, response.status_code, FENCED)
        raise GateRejected(text, response.status_code, reason if isinstance(reason, str) else None)
    states = body.get("states")
    if not isinstance(states, list) or not states:
        states = [body.get("state")]
    gates = [_state(url, state) for state in states]
    if len({gate.zero_steps_above_bs for gate in gates}) > 1:
        raise GateRejected(
            f"{url} {GATE_PATH}: DP groups hold different gates: {[g.zero_steps_above_bs for g in gates]}"
        )
    first = gates[0]
    return Gate(first.zero_steps_above_bs, first.generation, first.active_steps, len(gates))


def _state(url: str, state: object) -> Gate:
    """One DP group's state, checked: MalformedGate for anything that is not one."""
    gate = state.get("zero_steps_above_bs", "missing") if isinstance(state, dict) else "missing"
    generation = state.get("generation") if isinstance(state, dict) else None
    active = state.get("active_steps") if isinstance(state, dict) else None
    if not (gate is None or whole(gate)) or not whole(generation) or not (active is None or whole(active)):
        raise MalformedGate(f"{url} {GATE_PATH}: HTTP 200 with a state that is not a gate: {str(state)[:200]}", 200)
    return Gate(gate, generation, active)
