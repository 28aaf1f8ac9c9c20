"""The whole gateway over real sockets: its endpoints, bad inputs, and the official OpenAI SDK."""

from __future__ import annotations

import asyncio
import contextlib
import enum
import importlib
import inspect
import json
import pkgutil
import sys

import httpx
import openai
import pydantic
import pytest
from prometheus_client import CollectorRegistry

from crossover.gateway.app import create_app
from crossover.gateway.config import Settings
from tests.gateway.gateway_helpers import MODEL, SIM_SCALE, chat, unused_url

BAD_INPUTS = [
    # (what, method, path, body, status, code); code None: the backend's own answer, reshaped like OpenAI's
    ("malformed JSON", "POST", "/v1/chat/completions", b'{"model": ', 400, "invalid_json"),
    ("not an object", "POST", "/v1/completions", b"[]", 400, "invalid_json"),
    ("NaN is not JSON", "POST", "/v1/chat/completions", b'{"temperature": NaN, "messages": []}', 400, "invalid_json"),
    ("wrong type", "POST", "/v1/chat/completions", json.dumps(chat(max_tokens="ten")).encode(), 400, None),
    ("missing messages", "POST", "/v1/chat/completions", json.dumps({"model": MODEL}).encode(), 400, None),
    ("unknown model", "POST", "/v1/chat/completions", json.dumps(chat(model="gpt-5")).encode(), 404, "model_not_found"),
    ("huge body", "POST", "/v1/chat/completions", b"x" * 3000, 413, "request_too_large"),
    ("unknown path", "GET", "/v1/engines", b"", 404, "not_found"),
    ("wrong method", "GET", "/v1/chat/completions", b"", 405, "method_not_allowed"),
    ("unknown model card", "GET", "/v1/models/gpt-5", b"", 404, "model_not_found"),
    # Not a redirect to a URL made of the client's Host header.
    ("a slash too many", "POST", "/v1/chat/completions/", json.dumps(chat()).encode(), 404, "not_found"),
]


def test_bad_inputs_get_an_openai_error_and_the_gateway_keeps_serving(sims, gateway):
    speculative, plain = sims
    gw = gateway([speculative.url], [plain.url], limits={"max_body_bytes": 2048})
    with httpx.Client(base_url=gw.url, timeout=10, trust_env=False) as client:
        for what, method, path, body, status, code in BAD_INPUTS:
            response = client.request(method, path, content=body, headers={"content-type": "application/json"})
            assert response.status_code == status, (what, response.text)
            error = response.json()["error"]
            assert set(error) == {"message", "type", "param", "code"}, (what, error)
            assert error["type"] == "invalid_request_error" and error["message"], (what, error)
            assert code is None or error["code"] == code, (what, error)
            assert response.headers["x-request-id"], what
            assert client.post("/v1/chat/completions", json=chat()).status_code == 200, f"not serving after {what}"
        # A body sent in chunks, without a content-length, is measured as it arrives.
        response = client.post("/v1/chat/completions", content=iter([b"x" * 1500, b"x" * 1500]))
        assert response.status_code == 413 and response.json()["error"]["code"] == "request_too_large"
        assert client.post("/v1/chat/completions", json=chat()).status_code == 200
    assert gw.inflight() == 0
    assert gw.metric("crossover_requests_total", pool="none", outcome="bad_request") == 6
    # What only the backend can judge is its answer, and says nothing about its health.
    assert gw.metric("crossover_requests_total", pool="speculative", outcome="bad_request") == 2
    assert all(backend.healthy for backend in gw.state.pools.all())


def test_over_the_inflight_limit_is_429_with_retry_after(sims, gateway):
    speculative, plain = sims
    gw = gateway([speculative.url], [plain.url], limits={"max_inflight": 1, "max_queued": 0})

    async def scenario():
        async with httpx.AsyncClient(base_url=gw.url, timeout=20, trust_env=False) as client:
            request = client.build_request("POST", "/v1/chat/completions", json=chat(True, 50_000))
            held = await client.send(request, stream=True)
            try:
                rejected = await client.post("/v1/chat/completions", json=chat())
            finally:
                await held.aclose()
            return rejected

    rejected = asyncio.run(scenario())
    assert rejected.status_code == 429
    assert rejected.headers["retry-after"] == "1"
    assert rejected.json()["error"]["type"] == "rate_limit_error"
    assert gw.metric("crossover_requests_total", pool="none", outcome="overloaded") == 1


def test_models_health_and_request_ids(sims, gateway):
    speculative, plain = sims
    gw = gateway([speculative.url], [plain.url])
    with httpx.Client(base_url=gw.url, timeout=10, trust_env=False) as client:
        models = client.get("/v1/models").json()
        assert models["object"] == "list" and [card["id"] for card in models["data"]] == [MODEL]
        assert client.get(f"/v1/models/{MODEL}").json()["id"] == MODEL
        assert client.get("/health").json() == {"status": "ok", "usable_backends": 2, "healthy_backends": 2}

        echoed = client.post("/v1/chat/completions", json=chat(), headers={"x-request-id": "trace-42"})
        assert echoed.headers["x-request-id"] == "trace-42"
        generated = client.post("/v1/chat/completions", json=chat())
        assert len(generated.headers["x-request-id"]) == 32
        error = client.post("/v1/chat/completions", content=b"{", headers={"x-request-id": "bad-1"})
        assert error.headers["x-request-id"] == "bad-1"
        # Every endpoint carries one, not only the proxied ones.
        for path in ("/v1/models", "/health", "/metrics", "/v1/nothing"):
            assert client.get(path, headers={"x-request-id": "t-7"}).headers["x-request-id"] == "t-7", path
            assert len(client.get(path).headers["x-request-id"]) == 32, path


def test_health_is_503_when_no_backend_is_healthy(gateway):
    gw = gateway([unused_url()], [unused_url()])
    with httpx.Client(base_url=gw.url, timeout=10, trust_env=False) as client:
        health = client.get("/health")
        assert health.status_code == 503 and health.json()["healthy_backends"] == 0
        response = client.post("/v1/chat/completions", json=chat())
        assert response.status_code == 503
        assert response.json()["error"]["code"] == "no_healthy_backend"


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_openai_sdk_sync_and_async_match_the_backend_directly(sim, gateway, engine):
    """The same over stand-ins playing either engine: routing and the proxy path do not care which."""
    plays = ("--engine", engine)
    speculative, plain = sim("k25-eagle3", *SIM_SCALE, *plays), sim("k25-plain", *SIM_SCALE, *plays)
    pools = {
        mode: {"backends": [server.url], "engine": engine}
        for mode, server in (("speculative", speculative), ("plain", plain))
    }
    gw = gateway([speculative.url], [plain.url], pools=pools)
    messages = [{"role": "user", "content": "Tell me about speculative decoding."}]
    through = openai.OpenAI(base_url=gw.url + "/v1", api_key="none", max_retries=0)
    direct = openai.OpenAI(base_url=speculative.url + "/v1", api_key="none", max_retries=0)

    def complete(client):
        result = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24)
        return result.choices[0].message.content, result.usage.completion_tokens, result.usage.prompt_tokens

    def stream(client):
        chunks = client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=24, stream=True, stream_options={"include_usage": True}
        )
        text, usage = "", None
        for chunk in chunks:
            text += "".join(choice.delta.content or "" for choice in chunk.choices)
            usage = chunk.usage or usage
        return text, usage.completion_tokens, usage.prompt_tokens

    def legacy(client):
        result = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=12)
        return result.choices[0].text, result.usage.completion_tokens

    assert complete(through) == complete(direct)
    assert stream(through) == stream(direct)
    assert legacy(through) == legacy(direct)
    assert stream(through)[1] == 24

    async def async_calls(base_url: str):
        client = openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="none", max_retries=0)
        result = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16)
        chunks = await client.completions.create(model=MODEL, prompt="Hi", max_tokens=16, stream=True)
        text = "".join([chunk.choices[0].text async for chunk in chunks if chunk.choices])
        await client.close()
        return result.choices[0].message.content, result.usage.completion_tokens, text

    assert asyncio.run(async_calls(gw.url)) == asyncio.run(async_calls(speculative.url))

    with pytest.raises(openai.NotFoundError) as caught:
        through.chat.completions.create(model="gpt-5", messages=messages)
    assert caught.value.code == "model_not_found"
    gw.settled()


# --- every object of the app's graph built whole -----------------------------------------------------------------

PLAIN_DATA = (type(None), bool, int, float, str, bytes, enum.Enum)


def plain(value) -> bool:
    """State, not a collaborator: what a backend's health, a mode or a count is made of."""
    if isinstance(value, tuple | frozenset):
        return all(plain(item) for item in value)
    return isinstance(value, PLAIN_DATA)


def gateway_classes() -> list[type]:
    """Every class the gateway's modules define whose instances take attribute assignments."""
    import crossover.gateway as package

    classes = []
    for module_info in pkgutil.iter_modules(package.__path__):
        module = importlib.import_module(f"{package.__name__}.{module_info.name}")
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if cls.__module__ != module.__name__ or issubclass(cls, BaseException | enum.Enum | pydantic.BaseModel):
                continue
            params = getattr(cls, "__dataclass_params__", None)
            if params is not None and params.frozen:
                continue
            classes.append(cls)
    return classes


@contextlib.contextmanager
def tripwire(wired: list[str]):
    """While it is on, a collaborator (anything but plain data) set on a public attribute of a gateway object by
    code other than that object's own methods is recorded in `wired`: wiring after construction."""
    originals = {cls: cls.__dict__.get("__setattr__") for cls in gateway_classes()}

    def checked(obj, name: str, value) -> None:
        frame = sys._getframe(1)
        if not name.startswith("_") and frame.f_locals.get("self") is not obj and not plain(value):
            where = f"{frame.f_code.co_filename.rsplit('/', 1)[-1]}:{frame.f_lineno}"
            wired.append(f"{type(obj).__name__}.{name} = {type(value).__name__} ({where})")
        object.__setattr__(obj, name, value)

    for cls in originals:
        cls.__setattr__ = checked
    try:
        yield
    finally:
        for cls, original in originals.items():
            if original is None:
                del cls.__setattr__
            else:
                cls.__setattr__ = original


def test_no_object_of_the_app_is_wired_after_it_was_built(sim, sims):
    """For each topology: build the app and run its start-up (until the topology serves) and shutdown; no object
    of the graph gets a collaborator assigned by anyone but itself (`x.sender = ...`, `breaker.probe = ...`)."""
    speculative, plain_sim = sims
    gated = sim("k25-eagle3", *SIM_SCALE, "--speculation-gate")
    pools = {"speculative": {"backends": [speculative.url]}, "plain": {"backends": [plain_sim.url]}}
    topologies = {
        "partitioned": Settings(pools=pools),
        "time-shared": Settings(topology="time-shared", pools=pools, switching={"mechanism": "manual"}),
        "in-engine": Settings(topology="in-engine", pools={"speculative": {"backends": [gated.url]}}),
    }
    for name, settings in topologies.items():
        wired: list[str] = []

        async def run(settings=settings) -> None:
            app = create_app(settings, registry=CollectorRegistry())
            starlette = app.rest.app
            async with starlette.router.lifespan_context(starlette):
                state = app.state.snapshot()
                deadline = asyncio.get_running_loop().time() + 30
                while state.get("phase", "active") != "active":  # time-shared: adopted in the background
                    assert asyncio.get_running_loop().time() < deadline, state
                    await asyncio.sleep(0.02)
                    state = app.state.snapshot()

        with tripwire(wired):
            asyncio.run(run())
        assert wired == [], f"{name}: wired after construction: {wired}"
    assert gateway_classes(), "the tripwire sees no class"
