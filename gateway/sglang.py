"""SGLang's runtime surface, known in one place: what the gateway and the supervisor call on a running server.

    load = load_from_loads((await client.get(url + LOADS_PATH)).json())  # running + waiting, over ranks
    await control(client, url, RELEASE, headers=headers, timeout=30)     # release / resume / pause / continue
    problem = await generate_once(client, url, headers=headers, timeout=30)  # None: it generated a token
    gate = await write_gate(client, url, 32, headers=headers, timeout=5)  # patched servers: the speculation gate

Checked against SGLang 0.5.23 (`../shared/reference/sglang.md`). The next release that moves an endpoint or
changes a body touches this file only.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import httpx

# Load endpoints: `/v1/loads` (0.5.x), `/get_load` (older releases), both JSON.
LOADS_PATH = "/v1/loads"
LEGACY_LOAD_PATH = "/get_load"


@dataclass(frozen=True, slots=True)
class ControlCall:
    """One of SGLang's control endpoints: its path and the body it is sent with."""

    name: str
    path: str
    body: dict


# The memory saver (servers started with --enable-memory-saver): weights and KV cache out of / back into GPU
# memory. SGLang asserts the server is idle on a release; 0.5.23 dies on a resume of memory it holds.
RELEASE = ControlCall("release", "/release_memory_occupation", {"tags": None})
RESUME = ControlCall("resume", "/resume_memory_occupation", {"tags": None})
# Pause in abort mode ends every request the server holds (other clients' too); continue undoes it.
PAUSE = ControlCall("pause", "/pause_generation", {"mode": "abort"})
CONTINUE = ControlCall("continue", "/continue_generation", {})

# SGLang's "The request queue is full." is an error event with this status inside an HTTP 200 stream.
QUEUE_FULL_STATUS = 503

# The 1-token generation that proves a server serves (`/health` says only that its HTTP server is up).
VERIFY_PROMPT = "Say OK."


class SGLangError(Exception):
    """A call on an SGLang server failed; the message says which endpoint and why (never shown to clients)."""


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


def is_queue_full(status: int | None) -> bool:
    """Whether an error event's status is SGLang's queue-full refusal (the backend did no work: fail over)."""
    return status == QUEUE_FULL_STATUS


def error_message(response: httpx.Response) -> str:
    """The message of an error answer, OpenAI-shaped or not, at most a line long."""
    try:
        payload = response.json()
    except ValueError:
        return response.text.strip()[:200] or f"HTTP {response.status_code}"
    error = payload.get("error") if isinstance(payload, dict) else None
    if isinstance(error, dict) and "message" in error:
        return str(error["message"])
    if isinstance(payload, dict) and "message" in payload:
        return str(payload["message"])
    return str(payload)[:200]


async def control(
    client: httpx.AsyncClient, url: str, call: ControlCall, *, headers: dict[str, str] | None, timeout: float
) -> None:
    """POST one control endpoint; SGLangError unless it answered 200 within `timeout`."""
    target = url + call.path
    try:
        async with asyncio.timeout(timeout):
            response = await client.post(target, json=call.body, timeout=timeout, headers=headers)
    except TimeoutError:
        raise SGLangError(f"{target} did not answer within {timeout:g} s") from None
    except httpx.HTTPError as exc:
        raise SGLangError(f"{target} failed: {exc!r}") from None
    if response.status_code != 200:
        raise SGLangError(f"{target} answered HTTP {response.status_code}: {error_message(response)}")


async def server_load(client: httpx.AsyncClient, url: str, *, headers: dict[str, str] | None, timeout: float) -> int:
    """Running + waiting requests the server itself reports (other clients' included); SGLangError if unreadable."""
    target = url + LOADS_PATH
    try:
        response = await client.get(target, timeout=timeout, headers=headers)
        response.raise_for_status()
        return load_from_loads(response.json())
    except (httpx.HTTPError, ValueError, TypeError, AttributeError) as exc:
        raise SGLangError(f"cannot read {target}: {exc!r}") from None


async def generate_once(
    client: httpx.AsyncClient,
    url: str,
    *,
    headers: dict[str, str] | None = None,
    timeout: float,
    model: str | None = None,
) -> str | None:
    """None when `url` generated one token (a real completion, `usage` says so), else why not."""
    try:
        async with asyncio.timeout(timeout):
            if model is None:
                models = await client.get(url + "/v1/models", timeout=timeout, headers=headers)
                if models.status_code != 200:
                    return f"{url}/v1/models answered HTTP {models.status_code}"
                model = models.json()["data"][0]["id"]
            response = await client.post(
                url + "/v1/completions",
                json={"model": model, "prompt": VERIFY_PROMPT, "max_tokens": 1, "temperature": 0, "stream": False},
                timeout=timeout,
                headers=headers,
            )
            if response.status_code != 200:
                return f"a 1-token generation on {url} got HTTP {response.status_code}: {error_message(response)}"
            body = response.json()
            if not body.get("choices") or (body.get("usage") or {}).get("completion_tokens", 1) < 1:
                return f"a 1-token generation on {url} answered without a token"
            return None
    except TimeoutError:
        return f"no 1-token generation from {url} within {timeout:g} s"
    except httpx.HTTPError as exc:
        return f"a 1-token generation on {url} failed: {exc!r}"
    except (ValueError, KeyError, IndexError, TypeError, AttributeError) as exc:
        return f"{url} answered something that is not an OpenAI response: {exc!r}"


# The run-time speculation gate of a server patched with patches/sglang-0.5.23 (`/speculative/adaptive`).
PATCH_NAME = "patches/sglang-0.5.23 (the run-time speculation gate)"
PATCH_HINT = f"apply {PATCH_NAME} with `crossover patches apply` on the GPU host and restart it"
GATE_PATH = "/speculative/adaptive"


class NotPatched(SGLangError):
    """A server has no /speculative/adaptive (an unpatched SGLang, or one without --speculative-adaptive)."""


class GateRejected(SGLangError):
    """The server answered, but refused the gate (its message says why) or read back another value."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True, slots=True)
class Gate:
    """What one server's engine says about its gate, as last read back."""

    zero_steps_above_bs: int | None
    generation: int
    active_steps: int | None = None


async def read_gate(client: httpx.AsyncClient, url: str, *, headers: dict[str, str] | None, timeout: float) -> Gate:
    """The gate as the engine holds it now; NotPatched or GateRejected if it cannot say."""
    return _gate(url, await client.get(url + GATE_PATH, headers=headers, timeout=timeout))


async def write_gate(
    client: httpx.AsyncClient, url: str, gate: int | None, *, headers: dict[str, str] | None, timeout: float
) -> Gate:
    """Zero draft steps for batches of more than `gate` requests (None: no gate; 0: never speculate)."""
    response = await client.post(url + GATE_PATH, json={"zero_steps_above_bs": gate}, headers=headers, timeout=timeout)
    return _gate(url, response)


def _gate(url: str, response: httpx.Response) -> Gate:
    if response.status_code in (404, 405):
        raise NotPatched(f"{url} has no {GATE_PATH} (HTTP {response.status_code}): {PATCH_HINT}")
    try:
        body = response.json()
    except ValueError:
        body = {}
    if response.status_code != 200 or not isinstance(body, dict) or not body.get("success"):
        message = body.get("message") if isinstance(body, dict) else None
        raise GateRejected(
            f"{url} {GATE_PATH}: HTTP {response.status_code}: {message or response.text[:200]}", response.status_code
        )
    state = body.get("state") or {}
    return Gate(state.get("zero_steps_above_bs"), int(state.get("generation", 0)), state.get("active_steps"))
