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
from crossover.gateway.engines.fence import FENCED, fence_headers, is_fenced, refusal
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


# The run-time speculation gate of a server patched with patches/sglang-0.5.23 (`/speculative/adaptive`), or with
# patches/sglang-main: numeric `speculative_adaptive_*` keys of SGLang's own `/set_internal_state` (answered `[true]`
# or `[false]`), read back under `speculative_adaptive` in `/server_info`'s `internal_states`, with why the last
# update was refused (`last_update.reason`). A server without the first path is asked the second way.
PATCH_NAME = "patches/sglang-0.5.23 or patches/sglang-main (the run-time speculation gate)"
PATCH_HINT = f"apply {PATCH_NAME} with `crossover patches apply` on the GPU host and restart it"
GATE_PATH = "/speculative/adaptive"
INTERNAL_STATE_PATH = "/set_internal_state"
SERVER_INFO_PATH = "/server_info"
GATE_STATE_KEY = "speculative_adaptive"
# The main series' refusals, by `last_update.reason`, as the statuses the 0.5.23 series answers them with.
_REASON_STATUS = {"rejected": 400, "fence_jump": 403, "stale_generation": 409, FENCED: 409, "failed": 500}


async def read_gate(client: httpx.AsyncClient, url: str, *, headers: dict[str, str] | None, timeout: float) -> Gate:
    """The gate as the engine holds it now, in every DP group; NotPatched or GateRejected if it cannot say."""
    async with asyncio.timeout(timeout):
        response = await client.get(url + GATE_PATH, headers=headers, timeout=timeout)
        if response.status_code in (404, 405):
            return _agreed(url, await _internal_states(client, url, headers, timeout))
        return _gate(url, response)


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
    async with asyncio.timeout(timeout):
        response = await client.post(
            url + GATE_PATH, json=body, headers={**(headers or {}), **fence_headers(fence)}, timeout=timeout
        )
        if response.status_code not in (404, 405):
            return _gate(url, response)
        args = {"zero_steps_above_bs": -1 if gate is None else gate}  # -1: no gate (the keys are numbers)
        if expected_generation is not None:
            args["expected_generation"] = expected_generation
        if fence is not None:
            args["fence"] = fence
        return await _write_internal_state(client, url, args, headers, timeout, dry_run)


async def _internal_states(
    client: httpx.AsyncClient, url: str, headers: dict[str, str] | None, timeout: float
) -> list[dict]:
    """Each DP group's `speculative_adaptive` in `/server_info` (patches/sglang-main); NotPatched without one."""
    response = await client.get(url + SERVER_INFO_PATH, headers=headers, timeout=timeout)
    try:
        groups = response.json().get("internal_states") if response.status_code == 200 else None
    except (ValueError, AttributeError):
        groups = None
    found = [group.get(GATE_STATE_KEY) for group in groups or () if isinstance(group, dict)]
    states = [state for state in found if isinstance(state, dict)]
    if not states or len(states) != len(found):
        raise NotPatched(
            f"{url} has no {GATE_PATH} and no {GATE_STATE_KEY} in {SERVER_INFO_PATH} "
            f"(HTTP {response.status_code}): {PATCH_HINT}"
        )
    return states


def _agreed(url: str, states: list) -> Gate:
    """The gate every DP group holds; GateRejected if they differ, MalformedGate for a state that is not one."""
    gates = [_state(url, state) for state in states]
    if len({gate.zero_steps_above_bs for gate in gates}) > 1:
        raise GateRejected(
            f"{url} {GATE_PATH}: DP groups hold different gates: {[g.zero_steps_above_bs for g in gates]}"
        )
    first = gates[0]
    return Gate(first.zero_steps_above_bs, first.generation, first.active_steps, len(gates))


async def _write_internal_state(
    client: httpx.AsyncClient, url: str, args: dict, headers: dict[str, str] | None, timeout: float, dry_run: bool
) -> Gate:
    """The gate written as patches/sglang-main takes it, then read back; a `[false]` raises as the 0.5.23 series'
    status would (the reason from `last_update`, a fence's refusal in `refusal`'s words). The main series has no dry
    run: one checks that the engine can gate at all (step 0 captured) and reads the gate back."""
    states = await _internal_states(client, url, headers, timeout)
    if dry_run:
        lacking = [state for state in states if 0 not in (state.get("captured_steps") or ())]
        if lacking and args["zero_steps_above_bs"] != -1:
            raise GateRejected(f"{url}: no 0-step runtime state captured: it cannot gate", 400, "rejected")
        return _agreed(url, states)
    server_args = {f"{GATE_STATE_KEY}_{name}": value for name, value in args.items()}
    response = await client.post(
        url + INTERNAL_STATE_PATH, json={"server_args": server_args}, headers=headers, timeout=timeout
    )
    text = f"{url} {INTERNAL_STATE_PATH}: HTTP {response.status_code}"
    try:
        replies = response.json()
    except ValueError:
        replies = None
    if response.status_code != 200 or not isinstance(replies, list) or not replies:
        reason = "unauthorized" if response.status_code in (401, 403) else None
        raise GateRejected(f"{text}: {response.text[:200]}", response.status_code, reason)
    states = await _internal_states(client, url, headers, timeout)
    if all(reply is True for reply in replies):
        return _agreed(url, states)
    refused = states[[reply is True for reply in replies].index(False)] if len(replies) == len(states) else states[0]
    last = refused.get("last_update")
    last = last if isinstance(last, dict) else {}
    reason = last.get("reason")
    reason = reason if isinstance(reason, str) and reason else "failed"
    message = f"{text} [false] ({reason}): {str(last.get('message') or 'refused')[:300]}"
    fence_view = refused.get("fence")
    highest = fence_view.get("highest") if isinstance(fence_view, dict) else None
    if reason == FENCED:
        token = args.get("fence")
        if isinstance(token, int) and isinstance(highest, int):
            message += f"; {refusal(token, highest)}"
        raise GateFenced(message, 409, FENCED)
    raise GateRejected(message, _REASON_STATUS.get(reason, 500), reason)


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
    return _agreed(url, states)


def _state(url: str, state: object) -> Gate:
    """One DP group's state, checked: MalformedGate for anything that is not one."""
    gate = state.get("zero_steps_above_bs", "missing") if isinstance(state, dict) else "missing"
    generation = state.get("generation") if isinstance(state, dict) else None
    active = state.get("active_steps") if isinstance(state, dict) else None
    if not (gate is None or whole(gate)) or not whole(generation) or not (active is None or whole(active)):
        raise MalformedGate(f"{url} {GATE_PATH}: HTTP 200 with a state that is not a gate: {str(state)[:200]}", 200)
    return Gate(gate, generation, active)
