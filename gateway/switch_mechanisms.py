"""How a time-shared GPU set changes mode: the server-side half of a switch (the controller drives it).

    mechanism = make_mechanism(settings.switching, urls, client, headers, inflight)  # each per mode
    await mechanism.hand_over("speculative", "plain")
    await verify(client, urls["plain"], timeout, headers["plain"])  # a 1-token generation: it really serves
    await mechanism.restore("speculative")       # after a failure: bring the old mode back

- `restart`: the GPU-host agent (`crossover servers agent`) stops the old server and starts the other; its
  start waits for a 1-token generation before it says `ready`.
- `sleep`: SGLang's own endpoints, both servers started with `--enable-memory-saver
  --enable-weights-cpu-backup`: release the old server's memory, resume the new one's, continue it. Never
  release a busy server (SGLang asserts idle): the gateway's own count and the server's `/v1/loads` must
  both say zero first.
- `manual`: the operator moves the servers; the gateway only drains, holds and verifies.

Every call is bounded by a named timeout; every failure raises `SwitchFailed` naming the step.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Literal

import httpx
from pydantic import BaseModel, ConfigDict, ValidationError

from crossover.gateway.config import SwitchingSettings
from crossover.gateway.health import load_from_loads

# Between polls of the agent's view of a server while it starts or stops.
AGENT_POLL_S = 0.1
# Between polls of a server's /v1/loads while waiting for it to become idle.
IDLE_POLL_S = 0.05
# How long an old server may take to finish the requests /pause_generation aborted.
IDLE_WAIT_S = 10.0
VERIFY_PROMPT = "ping"

AgentState = Literal["stopped", "starting", "ready", "released", "stopping", "failed"]


class SwitchFailed(Exception):
    """One step of a switch failed; `step` names it (drain, stop, start, release, resume, continue, verify)."""

    def __init__(self, step: str, message: str) -> None:
        super().__init__(f"{step}: {message}")
        self.step = step
        self.message = message


class AgentBusy(SwitchFailed):
    """The agent answered 409: another operation on the same GPU set is under way."""


class ServerStatus(BaseModel):
    """One server as the GPU-host agent reports it (the agent contract's ServerStatus)."""

    model_config = ConfigDict(extra="ignore")

    name: str
    role: str
    state: AgentState
    pid: int | None = None
    url: str
    last_start_s: float | None = None
    error: str | None = None


def _error_message(response: httpx.Response) -> str:
    try:
        payload = response.json()
    except ValueError:
        return response.text.strip()[:200] or f"HTTP {response.status_code}"
    error = payload.get("error") if isinstance(payload, dict) else None
    if isinstance(error, dict) and "message" in error:
        return str(error["message"])
    return str(payload)[:200]


async def verify(client: httpx.AsyncClient, url: str, timeout: float, headers: dict[str, str] | None = None) -> None:
    """A real 1-token generation on `url` (`headers`: the backend's API key), or SwitchFailed("verify", why)."""
    try:
        async with asyncio.timeout(timeout):
            models = await client.get(url + "/v1/models", timeout=timeout, headers=headers)
            if models.status_code != 200:
                raise SwitchFailed("verify", f"{url}/v1/models answered HTTP {models.status_code}")
            model = models.json()["data"][0]["id"]
            response = await client.post(
                url + "/v1/completions",
                json={"model": model, "prompt": VERIFY_PROMPT, "max_tokens": 1, "stream": False},
                timeout=timeout,
                headers=headers,
            )
            if response.status_code != 200:
                raise SwitchFailed(
                    "verify",
                    f"a 1-token generation on {url} got HTTP {response.status_code}: {_error_message(response)}",
                )
            if not response.json().get("choices"):
                raise SwitchFailed("verify", f"a 1-token generation on {url} returned no choices")
    except TimeoutError:
        raise SwitchFailed("verify", f"no 1-token generation from {url} within {timeout:g} s") from None
    except httpx.HTTPError as exc:
        raise SwitchFailed("verify", f"a 1-token generation on {url} failed: {exc!r}") from None
    except (ValueError, KeyError, IndexError, TypeError) as exc:
        raise SwitchFailed("verify", f"{url} answered something that is not an OpenAI response: {exc!r}") from None


class Mechanism:
    """The manual mechanism, and the interface of the others: every step a no-op the operator performs."""

    name = "manual"

    def __init__(
        self,
        settings: SwitchingSettings,
        urls: dict[str, str],
        client: httpx.AsyncClient,
        headers: dict[str, dict[str, str]] | None = None,
    ) -> None:
        self.settings = settings
        self.urls = urls
        self.client = client
        # Per mode: what every call to that mode's server carries (its SGLang --api-key).
        self.headers = headers or {mode: {} for mode in urls}

    async def hand_over(self, old: str | None, new: str) -> None:
        """Take the GPU set from `old` (None: nothing serves) and give it to `new`."""

    async def wake(self, mode: str) -> None:
        """After a failed switch: undo what the drain did to `mode` (a pause), if anything."""

    async def restore(self, mode: str, failed: str | None) -> None:
        """After a failed switch: make `mode` serve again; `failed` is the mode that did not come up."""


class SleepMechanism(Mechanism):
    """SGLang's sleep/wake: pause/drain -> release old -> resume new -> continue new."""

    name = "sleep"

    def __init__(
        self,
        settings: SwitchingSettings,
        urls: dict[str, str],
        client: httpx.AsyncClient,
        headers: dict[str, dict[str, str]],
        gateway_inflight: Callable[[str], int],
    ) -> None:
        super().__init__(settings, urls, client, headers)
        self.gateway_inflight = gateway_inflight
        # Which servers hold no weights now. SGLang 0.5.23 dies (not errs) on a resume of memory it holds, so
        # only what this gateway released - or `crossover servers up` left released: the mode not started
        # with - is ever resumed, and nothing is released twice.
        self.released = {_other(settings.initial_mode)}

    async def _release(self, mode: str) -> None:
        await self._post(mode, "/release_memory_occupation", {"tags": None}, "release")
        self.released.add(mode)

    async def _resume(self, mode: str) -> None:
        if mode in self.released:
            await self._post(mode, "/resume_memory_occupation", {"tags": None}, "resume")
            self.released.discard(mode)

    async def _post(self, mode: str, path: str, body: dict, step: str) -> None:
        url = self.urls[mode] + path
        timeout = self.settings.control_timeout
        try:
            async with asyncio.timeout(timeout):
                response = await self.client.post(url, json=body, timeout=timeout, headers=self.headers[mode])
        except TimeoutError:
            raise SwitchFailed(step, f"{url} did not answer within {timeout:g} s") from None
        except httpx.HTTPError as exc:
            raise SwitchFailed(step, f"{url} failed: {exc!r}") from None
        if response.status_code != 200:
            raise SwitchFailed(step, f"{url} answered HTTP {response.status_code}: {_error_message(response)}")

    async def server_load(self, mode: str) -> int:
        """Running + waiting requests the server itself reports (other clients' included)."""
        url = self.urls[mode] + "/v1/loads"
        try:
            response = await self.client.get(url, timeout=self.settings.control_timeout, headers=self.headers[mode])
            response.raise_for_status()
            return load_from_loads(response.json())
        except (httpx.HTTPError, ValueError, TypeError, AttributeError) as exc:
            raise SwitchFailed("release", f"cannot read {url} to check that the server is idle: {exc!r}") from None

    async def quiesce(self, mode: str) -> None:
        """End the requests of other clients on `mode` (SGLang's pause, abort mode)."""
        await self._post(mode, "/pause_generation", {"mode": "abort"}, "pause")

    async def wake(self, mode: str) -> None:
        await self._post(mode, "/continue_generation", {}, "continue")

    async def _wait_idle(self, mode: str) -> None:
        """Both counts at zero (the gateway's and the server's), or SwitchFailed: never release a busy server."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + IDLE_WAIT_S
        paused = False
        while True:
            gateway, server = self.gateway_inflight(mode), await self.server_load(mode)
            if not gateway and not server:
                return
            if gateway == 0 and not paused:
                # Requests the gateway did not send (other clients): SGLang's pause aborts them.
                await self.quiesce(mode)
                paused = True
            if loop.time() >= deadline:
                raise SwitchFailed(
                    "release",
                    f"the {mode} server is not idle ({gateway} requests in flight through the gateway, "
                    f"{server} running or waiting on the server): it is never released busy",
                )
            await asyncio.sleep(IDLE_POLL_S)

    async def hand_over(self, old: str | None, new: str) -> None:
        if old is not None and old not in self.released:
            await self._wait_idle(old)
            await self._release(old)
        elif old is None:
            await self._release_if_idle(_other(new))  # from no serving mode: whatever the other holds
        await self._resume(new)
        await self._post(new, "/continue_generation", {}, "continue")

    async def restore(self, mode: str, failed: str | None) -> None:
        if failed is not None and failed != mode:
            # Whatever the failed mode holds must leave the GPUs first; it has served nothing yet.
            await self._release_if_idle(failed)
        await self._resume(mode)
        await self._post(mode, "/continue_generation", {}, "continue")

    async def _release_if_idle(self, mode: str) -> None:
        if mode in self.released:
            return
        try:
            if not self.gateway_inflight(mode) and not await self.server_load(mode):
                await self._release(mode)
        except SwitchFailed:
            pass  # a dead server holds no memory; a live busy one is reported by the resume that follows


class RestartMechanism(Mechanism):
    """A restart through the GPU-host agent: stop the old server, start the other, wait until it is ready."""

    name = "restart"

    def __init__(self, settings: SwitchingSettings, urls: dict[str, str], client: httpx.AsyncClient) -> None:
        super().__init__(settings, urls, client)
        self.agent_headers = {"authorization": f"Bearer {settings.agent_token}"}

    async def _call(self, method: str, path: str, step: str) -> ServerStatus:
        url = self.settings.agent_url + path
        timeout = self.settings.control_timeout
        try:
            async with asyncio.timeout(timeout):
                response = await self.client.request(method, url, headers=self.agent_headers, timeout=timeout)
        except TimeoutError:
            raise SwitchFailed(step, f"the agent did not answer {method} {path} within {timeout:g} s") from None
        except httpx.HTTPError as exc:
            raise SwitchFailed(step, f"the agent at {self.settings.agent_url} failed: {exc!r}") from None
        if response.status_code == 409:
            raise AgentBusy(step, f"the agent refused {method} {path}: {_error_message(response)}")
        if response.status_code not in (200, 202):
            raise SwitchFailed(
                step, f"the agent answered {method} {path} with HTTP {response.status_code}: {_error_message(response)}"
            )
        try:
            return ServerStatus.model_validate_json(response.content)
        except ValidationError as exc:
            raise SwitchFailed(step, f"the agent's answer to {method} {path} is not a server status: {exc}") from None

    async def status(self, mode: str) -> ServerStatus:
        return await self._call("GET", f"/servers/{self.settings.agent_servers[mode]}", "status")

    async def _until(self, mode: str, wanted: set[str], step: str, timeout: float) -> None:
        name = self.settings.agent_servers[mode]
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            status = await self.status(mode)
            if status.state in wanted:
                return
            if status.state == "failed":
                raise SwitchFailed(step, f"the agent reports server {name!r} failed: {status.error or 'no reason'}")
            if loop.time() >= deadline:
                raise SwitchFailed(step, f"server {name!r} is still {status.state} after {timeout:g} s")
            await asyncio.sleep(AGENT_POLL_S)

    async def stop(self, mode: str) -> None:
        status = await self.status(mode)
        if status.state == "stopped":
            return
        if status.state != "stopping":
            path = f"/servers/{self.settings.agent_servers[mode]}/stop"
            try:
                await self._call("POST", path, "stop")
            except AgentBusy:
                # A start of it is under way (the agent takes one operation at a time): let it end, then stop.
                await self._until(mode, {"ready", "stopped", "failed"}, "stop", self.settings.switch_timeout)
                if (await self.status(mode)).state == "stopped":
                    return
                await self._call("POST", path, "stop")
        await self._until(mode, {"stopped"}, "stop", self.settings.control_timeout)

    async def start(self, mode: str) -> None:
        status = await self.status(mode)
        if status.state == "ready":
            return
        if status.state != "starting":
            await self._call("POST", f"/servers/{self.settings.agent_servers[mode]}/start", "start")
        await self._until(mode, {"ready"}, "start", self.settings.switch_timeout)

    async def hand_over(self, old: str | None, new: str) -> None:
        # From no serving mode (old None) the other server may still hold the GPUs: stop it all the same.
        await self.stop(old if old is not None else _other(new))
        await self.start(new)

    async def restore(self, mode: str, failed: str | None) -> None:
        if failed is not None and failed != mode:
            await self.stop(failed)  # one GPU set: the agent refuses (409) to start while the other runs
        await self.start(mode)


def _other(mode: str) -> str:
    return "plain" if mode == "speculative" else "speculative"


def make_mechanism(
    settings: SwitchingSettings,
    urls: dict[str, str],
    client: httpx.AsyncClient,
    headers: dict[str, dict[str, str]],
    gateway_inflight: Callable[[str], int],
) -> Mechanism:
    """`urls` and `headers` (each server's API key) per mode; `gateway_inflight(mode)`: the gateway's count."""
    if settings.mechanism == "restart":
        return RestartMechanism(settings, urls, client)
    if settings.mechanism == "sleep":
        return SleepMechanism(settings, urls, client, headers, gateway_inflight)
    return Mechanism(settings, urls, client, headers)
