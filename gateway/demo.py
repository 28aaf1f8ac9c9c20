"""`crossover demo`: a k25-eagle3 and a k25-plain stand-in, and the gateway in front of them, on 127.0.0.1.

The stand-ins run as child processes in their own process group, and ask the kernel to SIGTERM them if
the demo dies (PR_SET_PDEATHSIG), so not even a SIGKILLed demo leaves them behind. Ctrl-C or SIGTERM
stops the gateway, then the stand-ins.
"""

from __future__ import annotations

import asyncio
import secrets
import signal
import subprocess
import sys

from crossover.gateway.config import DEFAULT_THRESHOLD, Settings
from crossover.gateway.server import make_server
from crossover.servers import process

HOST = "127.0.0.1"
PROFILES = {"speculative": "k25-eagle3", "plain": "k25-plain"}
STANDIN_READY_TIMEOUT_S = 60.0
STANDIN_STOP_TIMEOUT_S = 10.0
READY_POLL_S = 0.05


def start_standin(profile: str, port: int, time_scale: float) -> subprocess.Popen:
    argv = [
        sys.executable,
        "-m",
        "crossover.gateway.cli",
        "sim",
        "serve",
        "--profile",
        profile,
        "--host",
        HOST,
        "--port",
        str(port),
        "--time-scale",
        str(time_scale),
        # The demo shows routing, not the minutes of weight loading the k25 profiles model.
        "--startup-delay",
        "0",
    ]
    # The demo starts its stand-ins before it runs any thread, so they can die with it.
    return process.spawn(argv)


def banner(url: str, token: str, model: str) -> str:
    sdk = (
        f"python -c \"from openai import OpenAI; c = OpenAI(base_url='{url}/v1', api_key='none'); "
        f"print(c.chat.completions.create(model='{model}', messages=[{{'role': 'user', 'content': 'Hi'}}])"
        f'.choices[0].message.content)"'
    )
    return "\n".join(
        [
            f"crossover demo: gateway on {url} (two simulated SGLang pools: {', '.join(PROFILES.values())})",
            f"  admin token: {token}",
            f"  try:         {sdk}",
            f"  threshold:   curl -H 'Authorization: Bearer {token}' {url}/admin/threshold",
            f"  metrics:     curl {url}/metrics",
            "  Ctrl-C stops everything.",
        ]
    )


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


async def _serve(settings: Settings, text: str) -> None:
    server = make_server(settings)
    serving = asyncio.create_task(server.serve())
    while not server.started and not serving.done():
        await asyncio.sleep(READY_POLL_S)
    if server.started:
        print(text, flush=True)
    await serving


def run(port: int, admin_token: str | None, policy: str, threshold: int | None, time_scale: float) -> int:
    # SIGTERM behaves like Ctrl-C; while uvicorn serves it takes both, shuts down, then re-raises them here.
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGINT, _interrupt)
    token = admin_token or secrets.token_urlsafe(18)
    threshold = DEFAULT_THRESHOLD if threshold is None else threshold
    procs: list[subprocess.Popen] = []
    try:
        urls = {}
        for pool, profile in PROFILES.items():
            standin_port = process.free_port(HOST)
            procs.append(start_standin(profile, standin_port, time_scale))
            urls[pool] = f"http://{HOST}:{standin_port}"
        for proc, url in zip(procs, urls.values(), strict=False):
            process.wait_ready(url + "/health", proc, STANDIN_READY_TIMEOUT_S)
        settings = Settings(
            host=HOST,
            port=port,
            policy=policy,
            threshold=threshold,
            admin_token=token,
            pools={pool: {"backends": [url]} for pool, url in urls.items()},
            # No load balancer in front of a demo to warn before it stops: Ctrl-C stops at once.
            timeouts={"shutdown_delay": 0},
        )
        url = f"http://{HOST}:{port}"
        import uvloop

        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            runner.run(_serve(settings, banner(url, token, "moonshotai/Kimi-K2.5")))
    except KeyboardInterrupt:
        pass
    except process.NotReady as exc:
        print(f"crossover demo: {exc}", file=sys.stderr)
        return 1
    finally:
        process.stop(procs, STANDIN_STOP_TIMEOUT_S)
    return 0
