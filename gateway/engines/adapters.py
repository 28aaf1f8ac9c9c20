"""The engines a pool may run, behind one adapter: what the gateway asks of a backend, whichever engine it is.

    engine = adapter(settings.pools.speculative.engine)   # "sglang" (default) or "vllm"
    load = await engine.server_load(client, url, headers=headers, timeout=5)   # running + waiting, as it says
    await control(client, url, engine.release, headers=control_headers, timeout=120)   # sleep / wake
    engine.busy(event.status)                               # a refusal before any work: fail over, no evidence

Routing, switching and metrics never branch on the engine: they ask the adapter. What each engine's endpoints
and bodies are is its own module's (`sglang.py`, `vllm.py`); what they have in common is here:
- health: `GET /health` answers 200 when the engine serves (SGLang; vLLM: 503 once its engine died); the
  names it serves come from `/v1/models`; a 1-token completion (`generate_once`) proves it generates.
- load: running + waiting requests, the engine's own count (SGLang `/v1/loads`; vLLM `vllm:num_requests_running`
  + `vllm:num_requests_waiting` on `/metrics`, summed over their labels).
- acceptance (a speculative server's tokens per verify step, on `/metrics`): SGLang's gauge
  `sglang:spec_accept_length`; vLLM's counters, 1 + accepted / drafts between two readings.
- errors: both answer `{"error": {"message", "code", ...}}` (SGLang also a flat `{"object": "error", ...}`);
  busy is 503 - SGLang's "queue full" event, vLLM's `QueueOverflowError` past `--max-num-queued-reqs` - and
  gateway/errors.py reshapes either into the gateway's OpenAI error.
- a client that leaves: both abort the request in the engine when its connection closes.
- control: SGLang releases, resumes, pauses and continues (its memory saver); vLLM sleeps and wakes up
  (`--enable-sleep-mode`, `VLLM_SERVER_DEV_MODE=1`). Patched, each has a run-time speculation gate (the in-engine
  topology): `read_gate` / `write_gate` speak the engine's route and raise gate.py's errors alike.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Literal, Protocol, get_args

import httpx

from crossover.gateway.engines import sglang, vllm
from crossover.gateway.engines.calls import (
    METRICS_PATH,
    ControlCall,
    EngineError,
    SpecReading,
    control,
    error_message,
    generate_once,
)
from crossover.gateway.engines.gate import Gate

EngineName = Literal["sglang", "vllm"]
ENGINE_NAMES: tuple[EngineName, ...] = get_args(EngineName)
DEFAULT_ENGINE: EngineName = "sglang"


__all__ = ["METRICS_PATH", "ControlCall", "EngineError", "SpecReading", "control", "error_message", "generate_once"]


class ReadGate(Protocol):
    def __call__(
        self, client: httpx.AsyncClient, url: str, *, headers: dict[str, str] | None, timeout: float
    ) -> Awaitable[Gate]: ...


class WriteGate(Protocol):
    def __call__(
        self,
        client: httpx.AsyncClient,
        url: str,
        gate: int | None,
        *,
        headers: dict[str, str] | None,
        timeout: float,
        dry_run: bool = False,
        expected_generation: int | None = None,
        fence: int | None = None,
    ) -> Awaitable[Gate]: ...


@dataclass(frozen=True, slots=True)
class LoadSource:
    """One place an engine reports its load, and how to read it."""

    path: str
    parse: Callable[[httpx.Response], int]


@dataclass(frozen=True, slots=True)
class EngineAdapter:
    name: EngineName
    # Tried in order until one answers (an older release may lack the first); the scrape remembers which did.
    load_sources: tuple[LoadSource, ...]
    # Sleep/wake on one GPU set: `release` frees the server's GPU memory, `resume` brings it back.
    release: ControlCall
    resume: ControlCall
    # What ends other clients' requests before a release; None: the release itself aborts them.
    pause: ControlCall | None
    # What lets a resumed (or paused) server schedule again; None: `resume` does.
    resume_generation: ControlCall | None
    busy_status: int
    # The run-time speculation gate of a patched server (the in-engine topology): patches/sglang-0.5.23's
    # /speculative/adaptive, patches/vllm-0.32.0's /speculation_gate. Errors: gate.py's.
    read_gate: ReadGate
    write_gate: WriteGate
    # A speculative server's acceptance from its /metrics text and the previous reading (vLLM's is a window between
    # two): SGLang's gauge, vLLM's counters. None: the text has none.
    acceptance: Callable[[str, SpecReading | None], SpecReading | None]
    # Where the engine says whether it sleeps (vLLM's /is_sleeping); None: it cannot say (SGLang).
    sleeping_path: str | None = None

    def busy(self, status: int | None) -> bool:
        """An error (event) with this status is the engine refusing before any work: fail over, no evidence."""
        return status == self.busy_status

    async def server_load(
        self, client: httpx.AsyncClient, url: str, *, headers: dict[str, str] | None, timeout: float
    ) -> int:
        """Running + waiting requests the server itself reports (other clients' too); EngineError if unreadable."""
        failures = []
        for source in self.load_sources:
            try:
                response = await client.get(url + source.path, timeout=timeout, headers=headers)
                response.raise_for_status()
                return source.parse(response)
            except (httpx.HTTPError, ValueError, TypeError, AttributeError) as exc:
                failures.append(f"{source.path}: {exc!r}")
        raise EngineError(f"cannot read the load of {url} ({self.name}): {'; '.join(failures)}")

    async def sleeping(
        self, client: httpx.AsyncClient, url: str, *, headers: dict[str, str] | None, timeout: float
    ) -> bool | None:
        """Whether the server sleeps, as it says itself; None when the engine (or this server) cannot say. A
        sleeping vLLM holds a new request until it wakes rather than refusing it: ask this before generating."""
        if self.sleeping_path is None:
            return None
        try:
            response = await client.get(url + self.sleeping_path, timeout=timeout, headers=headers)
            response.raise_for_status()
            answer = response.json()["is_sleeping"]
        except (httpx.HTTPError, ValueError, KeyError, TypeError):
            return None
        return answer if isinstance(answer, bool) else None


SGLANG = EngineAdapter(
    name="sglang",
    load_sources=(
        LoadSource(sglang.LOADS_PATH, lambda response: sglang.load_from_loads(response.json())),
        LoadSource(sglang.LEGACY_LOAD_PATH, lambda response: sglang.load_from_loads(response.json())),
        LoadSource(METRICS_PATH, lambda response: sglang.load_from_metrics(response.text)),
    ),
    acceptance=sglang.acceptance_from_metrics,
    release=sglang.RELEASE,
    resume=sglang.RESUME,
    pause=sglang.PAUSE,
    resume_generation=sglang.CONTINUE,
    busy_status=sglang.QUEUE_FULL_STATUS,
    read_gate=sglang.read_gate,
    write_gate=sglang.write_gate,
)

VLLM = EngineAdapter(
    name="vllm",
    load_sources=(LoadSource(METRICS_PATH, lambda response: vllm.load_from_metrics(response.text)),),
    acceptance=vllm.acceptance_from_metrics,
    release=vllm.SLEEP,
    resume=vllm.WAKE_UP,
    pause=None,
    resume_generation=None,
    busy_status=vllm.BUSY_STATUS,
    read_gate=vllm.read_gate,
    write_gate=vllm.write_gate,
    sleeping_path=vllm.IS_SLEEPING_PATH,
)

ENGINES: dict[EngineName, EngineAdapter] = {"sglang": SGLANG, "vllm": VLLM}


def adapter(name: EngineName | str) -> EngineAdapter:
    return ENGINES[name]  # type: ignore[index]


def busy(status: int | None) -> bool:
    """Whether an error event's status is a busy refusal by any engine (both say 503): where the backend that
    sent it is not at hand, as when a stream's first event is read."""
    return any(engine.busy(status) for engine in ENGINES.values())
