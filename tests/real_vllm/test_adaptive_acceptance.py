"""[adaptive] against real vLLM 0.32.0 on CPU: two EAGLE-3 servers of the tiny model at two synthetic acceptances,
each behind its own gateway: the session's speculative server (ACCEPTANCE_LENGTH) and the session's gated one
(LOW_ACCEPTANCE, its gate off), each pinned to its own core (tests/real_vllm/conftest.py).

- The gateway reads each server's acceptance from its /metrics (vLLM's spec_decode counters, 1 + accepted / drafts
  between two load scrapes) within +-0.2 of the synthetic setting.
- The adaptive threshold, from one bench table (benched at the higher acceptance), is lower at the lower one.
- The model (gateway/policies/adaptive.py) against the engine: the lower server's tok/s predicted from the higher's
  (its time per request split into a prefill, the TTFT alone, and decode steps scaled by 2.75 / 1.75) beside the
  measured one - printed for the report; a loose bound only, the two cores being shared with whatever else runs.

Cheap: no server of its own (the gated one starts once for this test and the gate's), the traffic is C=2 of short
requests, every wait is bounded.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import httpx
import pytest

from crossover.gateway.engines import vllm
from crossover.gateway.modes import SPECULATIVE
from crossover.gateway.policies import BenchTable
from tests.real_vllm.conftest import ACCEPTANCE_LENGTH, GATE_ADMIN_KEY, LOW_ACCEPTANCE, MODEL_NAME, VLLMServer
from tests.waiting import wait_until

HIGH, LOW = ACCEPTANCE_LENGTH, LOW_ACCEPTANCE  # 3 drafts: rates (1, .75, 0) and (.75, 0, 0)
TOLERANCE = 0.2
STREAMS = 2
MAX_TOKENS = 24
READINGS = 3  # fresh window readings averaged: a window holds a few dozen drafts at this speed
SCRAPE_S = 8.0  # the load scrape's interval: one acceptance window (a few dozen drafts at this speed)
WAIT_S = 600.0
# A synthetic table benched at HIGH: plain catches up at 22.4 (16: -200, 32: +300).
LEVELS = {"eagle": ((1, 100), (4, 380), (16, 1200), (32, 1600), (64, 1800)),
          "plain": ((1, 60), (4, 240), (16, 1000), (32, 1900), (64, 2600))}  # fmt: skip


@pytest.fixture
def two_acceptances(real_vllm, gated_vllm) -> dict[float, VLLMServer]:
    """accept length -> its server; the gated one with its gate off (the gate's test may have moved it)."""
    headers = {"Authorization": f"Bearer {GATE_ADMIN_KEY}"}
    off = {"zero_spec_tokens_above_batch_size": None}
    answer = httpx.post(gated_vllm.url + vllm.GATE_PATH, json=off, headers=headers, timeout=30, trust_env=False)
    assert answer.status_code == 200, answer.text
    return {HIGH: real_vllm.servers[SPECULATIVE], LOW: gated_vllm}


def table_file(path: Path) -> Path:
    levels = [
        {"target": target, "concurrency": c, "completed": 20, "output_throughput": tok}
        for target, points in LEVELS.items()
        for c, tok in points
    ]
    path.write_text(json.dumps({"levels": levels, "crossover": {"speculative": "eagle", "plain": "plain"}}))
    return path


class Traffic:
    """STREAMS clients sending back to back through a gateway until stopped; tokens and time counted."""

    def __init__(self, url: str) -> None:
        self.url, self.done = url, threading.Event()
        self.tokens, self.errors = 0, []
        self.threads = [threading.Thread(target=self._client, daemon=True) for _ in range(STREAMS)]
        self.started = time.monotonic()
        for thread in self.threads:
            thread.start()

    def _client(self) -> None:
        body = {"model": MODEL_NAME, "prompt": "Count:", "max_tokens": MAX_TOKENS, "ignore_eos": True}
        with httpx.Client(timeout=120, trust_env=False) as client:
            while not self.done.is_set():
                answer = client.post(self.url + "/v1/completions", json=body)
                if answer.status_code != 200:
                    self.errors.append(answer.text[:200])
                    return
                self.tokens += answer.json()["usage"]["completion_tokens"]

    def stop(self) -> float:
        """Tok/s over the run."""
        elapsed = time.monotonic() - self.started
        self.done.set()
        for thread in self.threads:
            thread.join(180)
        return self.tokens / elapsed


def counters(server: VLLMServer) -> tuple[float, float]:
    """(drafts, accepted drafts) since the engine started."""
    return (
        server.metric("vllm:spec_decode_num_drafts_total"),
        server.metric("vllm:spec_decode_num_accepted_tokens_total"),
    )


def ttft_s(url: str) -> float:
    body = {"model": MODEL_NAME, "prompt": "Count:", "max_tokens": 2, "ignore_eos": True, "stream": True}
    began = time.monotonic()
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120, trust_env=False) as answer:
        for line in answer.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                return time.monotonic() - began
    raise AssertionError("no token")


def test_the_gateway_reads_each_acceptance_and_the_threshold_is_lower_at_the_lower_one(
    two_acceptances,
    gateway,
    tmp_path,
):
    table = table_file(tmp_path / "results.json")
    gateways = {}
    for accept, server in two_acceptances.items():
        pools = {mode: {"backends": [server.url], "engine": "vllm"} for mode in ("speculative", "plain")}
        gateways[accept] = gateway(
            [],
            [],
            pools=pools,
            threshold=16,
            health={"interval": 1.0, "timeout": 30.0, "load_interval": SCRAPE_S},
            adaptive={"enabled": True, "table": str(table), "bench_accept_length": HIGH, "window": 1.0,
                      "max_step": 64, "min": 1, "max": 64,
                      # The table's throughput is not this CPU's: the acceptance alone moves the threshold here.
                      "correct": False},
        )  # fmt: skip
    prefill = {accept: ttft_s(gw.url) for accept, gw in gateways.items()}  # one request alone: the prefill
    counted = {accept: counters(server) for accept, server in two_acceptances.items()}
    traffic = {accept: Traffic(gw.url) for accept, gw in gateways.items()}
    readings: dict[float, list[float]] = {accept: [] for accept in gateways}
    try:
        for accept, gw in gateways.items():
            (backend,) = gw.state.pools.pool("speculative")

            def fresh(backend=backend, seen=readings[accept]) -> bool:
                reading = backend.acceptance
                at = backend.acceptance_at
                if reading is not None and reading.accept_length is not None and at != getattr(fresh, "at", None):
                    fresh.at = at  # type: ignore[attr-defined]
                    seen.append(reading.accept_length)
                return len(seen) >= READINGS

            wait_until(fresh, timeout=WAIT_S, what=f"{READINGS} acceptance readings at {accept}")
            controller = gw.state.adaptive
            wait_until(
                lambda c=controller: (
                    c.last is not None and c.last.target is not None and c.routing.threshold == c.last.target
                ),
                timeout=WAIT_S,
                what=f"the threshold at its target at {accept}",
            )
    finally:
        rates = {accept: t.stop() for accept, t in traffic.items()}
    for t in traffic.values():
        assert not t.errors, t.errors
    means = {accept: sum(seen) / len(seen) for accept, seen in readings.items()}
    # The engine's own count over the whole run, beside the gateway's windows.
    overall = {}
    for accept, server in two_acceptances.items():
        drafts, accepted = (b - a for a, b in zip(counted[accept], counters(server), strict=True))
        overall[accept] = 1 + accepted / drafts if drafts else None
    thresholds = {accept: gw.state.routing.threshold for accept, gw in gateways.items()}
    # The model: the lower server's tok/s at C=STREAMS predicted from the higher's.
    model = BenchTable.from_results(
        {
            "levels": [
                {"target": "eagle", "concurrency": STREAMS, "completed": 10, "output_throughput": rates[HIGH],
                 "mean_ttft_ms": prefill[HIGH] * 1000, "total_output_tokens": 10 * MAX_TOKENS},
                {"target": "plain", "concurrency": STREAMS, "completed": 10, "output_throughput": rates[HIGH]},
            ],
            "crossover": {"speculative": "eagle", "plain": "plain"},
        },
        accept_length=HIGH,
    )  # fmt: skip
    predicted = model.speculative_at(LOW).throughput("speculative", STREAMS)
    print(
        f"readings {readings}; means {means}; the engines' counts over the run {overall}; thresholds {thresholds}; "
        f"tok/s measured {rates}; TTFT alone {prefill}; predicted at {LOW}: {predicted:.2f} tok/s "
        f"(proportional {rates[HIGH] * LOW / HIGH:.2f})"
    )
    for accept, mean in means.items():
        assert mean == pytest.approx(accept, abs=TOLERANCE), (accept, readings[accept], overall)
    assert thresholds[LOW] < thresholds[HIGH], thresholds
    assert predicted == pytest.approx(rates[LOW], rel=0.5), (
        predicted,
        rates,
    )  # a sanity bound: the figures are the report's
