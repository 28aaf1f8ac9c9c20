"""What every engine's HTTP runtime calls have in common: a control POST, an error's message, the 1-token
generation that proves a server serves, what a speculative server's acceptance reads as (`SpecReading`). Each
engine's module (`sglang.py`, `vllm.py`) names its own endpoints and bodies as `ControlCall`s; the calls themselves
are made here, once.

    await control(client, url, RELEASE, headers=headers, timeout=30)          # EngineError unless 200
    problem = await generate_once(client, url, headers=headers, timeout=30)   # None: it generated a token
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import httpx


@dataclass(frozen=True, slots=True)
class ControlCall:
    """One of an engine's control endpoints: its path and the body it is sent with."""

    name: str
    path: str
    body: dict


# Where both engines publish Prometheus text (their load, vLLM's; their acceptance, both).
METRICS_PATH = "/metrics"


@dataclass(frozen=True, slots=True)
class SpecReading:
    """A backend's speculative acceptance as last read from its `/metrics` (each engine's module reads its own).

    `accept_length`: tokens per verify step, the bonus token included (1.0: no draft accepted); None while no window
    has one. `counts`: (drafts, accepted drafts) since the engine started, for an engine that counts rather than
    averages (vLLM): where the next window starts.
    """

    accept_length: float | None
    counts: tuple[float, float] | None = None


# The 1-token generation that proves a server serves (`/health` says only that its HTTP server is up).
VERIFY_PROMPT = "Say OK."


class EngineError(Exception):
    """A call on an engine's server failed; the message says which endpoint and why (never shown to clients)."""


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
    """POST one control endpoint; EngineError unless it answered 200 within `timeout`."""
    target = url + call.path
    try:
        async with asyncio.timeout(timeout):
            response = await client.post(target, json=call.body, timeout=timeout, headers=headers)
    except TimeoutError:
        raise EngineError(f"{target} did not answer within {timeout:g} s") from None
    except httpx.HTTPError as exc:
        raise EngineError(f"{target} failed: {exc!r}") from None
    if response.status_code != 200:
        raise EngineError(f"{target} answered HTTP {response.status_code}: {error_message(response)}")


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
