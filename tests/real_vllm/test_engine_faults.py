"""What a vLLM pool says when it cannot serve, against real vLLM 0.32.0 on CPU, and what the gateway makes of it.

- Busy: a server past `--max-num-queued-reqs` (BUSY_CAP, as the shipped vLLM profiles set it) refuses with 503 and
  vLLM's "The engine is currently busy ..." before doing any work (`AsyncLLM.check_admission`); the gateway takes
  that for busy, not broken, and serves the request on the other pool (a `backend_busy` failover).
- Dead: once the EngineCore process is gone, `/health` answers 503 (the API server's monitor thread marks the
  engine dead; `check_health` raises EngineDeadError) until vLLM's watchdog shuts the API server down (within
  ~5 s, unless VLLM_KEEP_ALIVE_ON_ENGINE_DEATH=1); the gateway sends the next request to the other pool. This test
  ends the plain server for good, so it runs last (conftest.LAST_TESTS).
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import httpx

from crossover.gateway.engines.vllm import BUSY_STATUS, RUNNING
from crossover.gateway.metrics import BACKEND_BUSY
from crossover.gateway.modes import PLAIN, SPECULATIVE
from crossover.servers.state import group_members
from tests.real_vllm.conftest import BUSY_CAP, PROBE_TOKENS
from tests.waiting import wait_until

BUSY_MESSAGE = "The engine is currently busy and cannot accept new requests."
# vLLM's own count of requests it refused at admission (by reason: the queue cap, or queued prompt tokens).
REJECTIONS = "vllm:admission_rejections_total"
HEALTH_POLL_S = 0.05  # vLLM's watchdog ends the API server ~5 s after the engine died: look often
ALL_PLAIN = 0  # spillover threshold: every request goes to the plain pool


def one_token(model: str) -> dict:
    return {"model": model, "prompt": "Say OK.", "max_tokens": 1}


def test_a_full_vllm_answers_503_busy_and_the_gateway_serves_the_request_on_the_other_pool(vllm_gateway, real_vllm):
    plain = real_vllm.servers[PLAIN]
    plain.wait_for(RUNNING, 0)
    gw = vllm_gateway(policy="spillover", threshold=ALL_PLAIN)
    # One request of BUSY_CAP choices fills the cap by itself (vLLM counts a request of n choices as n), and far
    # more tokens than the checks below take: it is still running when they are made.
    full = {**one_token(real_vllm.model), "n": BUSY_CAP, "max_tokens": real_vllm.max_model_len // 2}
    full |= {"ignore_eos": True, "stream": True}
    timeout = real_vllm.timeout(PROBE_TOKENS)
    rejected = plain.metric(REJECTIONS)
    with (
        httpx.Client(timeout=timeout, trust_env=False) as http,
        http.stream("POST", plain.url + "/v1/completions", json=full) as held,
    ):
        assert held.status_code == 200
        # The first event is sent before the request reaches the engine; the second carries generated text, so by
        # then all BUSY_CAP choices are in flight and the cap is reached.
        events, chunks = b"", held.iter_bytes()
        while events.count(b"data: ") < 2:
            events += next(chunks)
        refused = http.post(plain.url + "/v1/completions", json=one_token(real_vllm.model))
        assert refused.status_code == BUSY_STATUS, refused.text
        assert refused.json()["error"]["message"].startswith(BUSY_MESSAGE)
        routed = http.post(gw.url + "/v1/completions", json=one_token(real_vllm.model))
        assert routed.status_code == 200, routed.text
        assert routed.headers["x-crossover-pool"] == SPECULATIVE
        assert gw.metric("crossover_failovers_total", reason=BACKEND_BUSY) == 1
    # Both refusals were vLLM's queue cap, by its own count.
    assert plain.metric(REJECTIONS) - rejected == 2
    plain.wait_for(RUNNING, 0)  # the held request was aborted when its client left
    gw.settled()


def engine_core(pid: int) -> int:
    """The EngineCore process of the vLLM API server `pid` (vLLM names it `VLLM::EngineCore`)."""
    for member in group_members(os.getpgid(pid)):
        try:
            comm = Path(f"/proc/{member}/comm").read_text().strip()
        except OSError:
            continue
        if comm.startswith("VLLM::EngineCor"):  # comm holds 15 characters
            return member
    raise AssertionError(f"no VLLM::EngineCore process under {pid}")


def test_health_is_503_once_the_engine_core_died(vllm_gateway, real_vllm):
    plain = real_vllm.servers[PLAIN]
    gw = vllm_gateway(policy="spillover", threshold=ALL_PLAIN)
    plain_backend = {"pool": PLAIN, "backend": plain.url}
    wait_until(lambda: gw.metric("crossover_backend_healthy", **plain_backend) == 1, real_vllm.bound(0), "plain up")
    os.kill(engine_core(plain.proc.pid), signal.SIGKILL)
    statuses: list[int | str] = []
    deadline = time.monotonic() + real_vllm.bound(PROBE_TOKENS)
    with httpx.Client(timeout=5.0, trust_env=False) as http:
        while 503 not in statuses and time.monotonic() < deadline:
            try:
                statuses.append(http.get(plain.url + "/health").status_code)
            except httpx.TransportError as error:
                statuses.append(type(error).__name__)  # the API server already gone
                if plain.proc.poll() is not None:
                    break
            time.sleep(HEALTH_POLL_S)
    assert 503 in statuses, statuses[-10:]
    # The gateway's probe sees it too (vLLM would answer a request 500 before its API server goes), and the
    # next request is served by the speculative pool.
    wait_until(lambda: gw.metric("crossover_backend_healthy", **plain_backend) == 0, real_vllm.bound(0), "plain down")
    routed = httpx.post(
        gw.url + "/v1/completions", json=one_token(real_vllm.model), timeout=real_vllm.timeout(1), trust_env=False
    )
    assert routed.status_code == 200, routed.text
    assert routed.headers["x-crossover-pool"] == SPECULATIVE
    # And vLLM's watchdog ends the API server that has no engine left.
    plain.proc.wait(real_vllm.bound(0))
    gw.settled()
