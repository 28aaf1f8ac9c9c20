"""Generation over real sockets: the official OpenAI SDK, SGLang's error shapes, aborts on disconnect."""

import asyncio
import json
import time

import httpx
import openai
import pytest

from tests.waiting import wait_until

MODEL = "moonshotai/Kimi-K2.5"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "five words in this prompt"}], "max_tokens": 12}
TIMEOUT = httpx.Timeout(10.0)


def running(client: httpx.Client, url: str) -> tuple[int, int]:
    load = client.get(f"{url}/v1/loads").json()["loads"][0]
    return load["num_running_reqs"], load["num_waiting_reqs"]


def test_openai_sdk_chat_and_completions(sim_app):
    server = sim_app("k25-eagle3")
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", timeout=10.0, max_retries=0)

    chat = client.chat.completions.create(model=MODEL, messages=CHAT["messages"], max_tokens=12)
    assert chat.choices[0].finish_reason == "length" and chat.choices[0].message.role == "assistant"
    assert chat.usage.prompt_tokens == 5 and chat.usage.completion_tokens == 12 and chat.usage.total_tokens == 17
    assert "simulated" in chat.choices[0].message.content

    stream = client.chat.completions.create(
        model=MODEL, messages=CHAT["messages"], max_tokens=40, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 40
    assert chunks[-1].usage.total_tokens == 45
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert (
        text
        == client.chat.completions.create(model=MODEL, messages=CHAT["messages"], max_tokens=40)
        .choices[0]
        .message.content
    )
    # EAGLE streams several accepted tokens per chunk, as the real engine does.
    content_chunks = [c for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(content_chunks) < 40

    completion = client.completions.create(model=MODEL, prompt="a b c", max_tokens=7)
    assert completion.usage.prompt_tokens == 3 and completion.usage.completion_tokens == 7
    assert completion.choices[0].finish_reason == "length"
    streamed = list(
        client.completions.create(
            model=MODEL, prompt="a b c", max_tokens=7, stream=True, stream_options={"include_usage": True}
        )
    )
    assert "".join(c.choices[0].text for c in streamed if c.choices) == completion.choices[0].text
    assert streamed[-1].usage.completion_tokens == 7


@pytest.mark.parametrize(
    ("kwargs", "status", "message"),
    [
        ({"content": b"{not json", "headers": {"content-type": "application/json"}}, 400, "Invalid JSON"),
        ({"content": json.dumps(CHAT), "headers": {"content-type": "text/plain"}}, 400, "Unsupported Media Type"),
        ({"json": {**CHAT, "messages": "hi"}}, 400, "'messages' must be a non-empty list"),
        ({"json": {**CHAT, "max_tokens": -5}}, 400, "must be >= 0"),
        ({"json": {**CHAT, "max_tokens": 300_000}}, 400, "maximum context length"),
        ({"json": {**CHAT, "max_tokens": 95_000}}, 400, "KV cache tokens"),
        ({"content": b"x" * (17 * 1024 * 1024), "headers": {"content-type": "application/json"}}, 413, "too large"),
    ],
)
def test_bad_requests_get_sglang_error_bodies(sim_app, kwargs, status, message):
    server = sim_app("k25-eagle3")
    with httpx.Client(timeout=TIMEOUT) as client:
        response = client.post(f"{server.url}/v1/chat/completions", **kwargs)
        assert response.status_code == status
        body = response.json()
        assert body["object"] == "error" and body["code"] == status and message.lower() in body["message"].lower()
        assert client.post(f"{server.url}/v1/chat/completions", json=CHAT).status_code == 200  # still serving


def test_queue_overflow_fails_as_sglang_does(sim_app):
    server = sim_app("k25-plain", time_scale=1.0, max_running_requests=1, max_queued_requests=1)
    with httpx.Client(timeout=TIMEOUT) as client:
        long = {**CHAT, "max_tokens": 20_000, "stream": True}
        first = client.send(client.build_request("POST", f"{server.url}/v1/chat/completions", json=long), stream=True)
        wait_until(lambda: running(client, server.url) == (1, 0))
        second = client.send(client.build_request("POST", f"{server.url}/v1/chat/completions", json=long), stream=True)
        wait_until(lambda: running(client, server.url) == (1, 1))

        rejected = client.post(f"{server.url}/v1/chat/completions", json=CHAT)
        assert rejected.status_code == 503
        assert rejected.json() == {
            "object": "error",
            "message": "The request queue is full.",
            "type": "503",
            "param": None,
            "code": 503,
        }

        streamed = client.post(f"{server.url}/v1/chat/completions", json={**CHAT, "stream": True})
        assert streamed.status_code == 200  # the error arrives inside the stream
        events = [line for line in streamed.text.split("\n\n") if line]
        assert events[-1] == "data: [DONE]"
        error = json.loads(events[0].removeprefix("data: "))["error"]
        assert error["code"] == 503 and error["type"] == "SERVICE_UNAVAILABLE"
        assert error["message"] == "The request queue is full."
        first.close()
        second.close()
        wait_until(lambda: running(client, server.url) == (0, 0))


def test_client_disconnect_aborts_in_the_engine(sim_app):
    server = sim_app("k25-eagle3", time_scale=1.0)
    long = {**CHAT, "max_tokens": 5_000}  # six of these fit the KV pool

    async def scenario():
        async with httpx.AsyncClient(timeout=TIMEOUT) as client:
            streams = []
            for _ in range(5):
                response = await client.send(
                    client.build_request("POST", f"{server.url}/v1/chat/completions", json={**long, "stream": True}),
                    stream=True,
                )
                lines = response.aiter_lines()  # kept: dropping the iterator would close the stream
                await anext(lines)  # generating
                streams.append((response, lines))
            blocking = asyncio.create_task(
                client.post(f"{server.url}/v1/completions", json={"prompt": "x", "max_tokens": 5_000})
            )
            deadline = time.monotonic() + 10
            while (await client.get(f"{server.url}/v1/loads")).json()["loads"][0]["num_running_reqs"] < 6:
                assert time.monotonic() < deadline, "the sixth request never ran"
                await asyncio.sleep(0.02)
            for response, _ in streams:
                await response.aclose()
            blocking.cancel()  # the non-streaming client goes away too
            deadline = time.monotonic() + 10
            while (await client.get(f"{server.url}/v1/loads")).json()["loads"][0]["num_running_reqs"]:
                assert time.monotonic() < deadline, "aborted requests still running"
                await asyncio.sleep(0.02)

    asyncio.run(scenario())
    metrics = httpx.get(f"{server.url}/metrics", timeout=TIMEOUT).text
    assert 'sglang:num_aborted_requests_total{model_name="moonshotai/Kimi-K2.5"} 6.0' in metrics


def test_two_hundred_streams_with_disconnects_leave_nothing_running(sim_app):
    server = sim_app("k25-eagle3", time_scale=200.0)

    async def one(client: httpx.AsyncClient, i: int) -> int:
        body = {**CHAT, "max_tokens": 64, "stream": True}
        async with client.stream("POST", f"{server.url}/v1/chat/completions", json=body) as response:
            chunks = 0
            async for line in response.aiter_lines():
                chunks += line.startswith("data: ")
                if i % 10 < 3 and chunks == 2:  # 30% of clients walk away mid-stream
                    return -1
            return chunks

    async def scenario():
        limits = httpx.Limits(max_connections=250, max_keepalive_connections=250)
        async with httpx.AsyncClient(timeout=httpx.Timeout(60.0), limits=limits) as client:
            results = await asyncio.gather(*(one(client, i) for i in range(200)))
        assert results.count(-1) == 60 and all(r > 2 for r in results if r != -1)
        # A fresh client: a kept-alive connection left idle past the server's keep-alive timeout while the
        # streams ran (seconds, on a busy machine) may be closed under a reuse. The bound is generous: a leak
        # never drains, a busy machine only drains later.
        async with httpx.AsyncClient(timeout=httpx.Timeout(60.0)) as client:
            deadline = time.monotonic() + 60
            while (await client.get(f"{server.url}/v1/loads")).json()["loads"][0]["num_running_reqs"]:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.02)

    asyncio.run(scenario())


def test_deeply_nested_json_is_a_bad_request(sim_app):
    server = sim_app()
    body = b"[" * 100_000 + b"]" * 100_000
    response = httpx.post(
        f"{server.url}/v1/chat/completions", content=body, headers={"content-type": "application/json"}, timeout=TIMEOUT
    )
    assert response.status_code == 400 and "Invalid JSON" in response.json()["message"]
