"""`crossover advise --url`: a running gateway's live rate table and acceptance (GET /admin/state), alone or beside
a bench results file. A real gateway in front of two stand-ins, traffic at one stream to each pool in turn, the real
CLI."""

from __future__ import annotations

import json
import subprocess
import sys

import httpx

from crossover.loadtest.advise_live import MIN_REQUESTS, parse_live
from tests.gateway.conftest import gateway, sims  # noqa: F401  (the gateway's fixtures)
from tests.gateway.gateway_helpers import chat

TOKEN = "advise-token"
ADMIN = {"Authorization": f"Bearer {TOKEN}"}


def advise(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "crossover.gateway.cli", "advise", *argv],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_advise_reads_a_live_gateways_rate_table_and_acceptance(gateway, sims):  # noqa: F811
    speculative, plain = sims
    # The load scrape reads the acceptance (load_signal scraped).
    gw = gateway([speculative.url], [plain.url], admin_token=TOKEN, threshold=64, load_signal="scraped",
                 health={"interval": 0.5, "timeout": 2.0, "load_interval": 0.2})  # fmt: skip
    with httpx.Client(timeout=60, trust_env=False) as client:
        for threshold in (64, 0):  # one stream on the speculative pool, then on the plain pool
            client.put(gw.url + "/admin/threshold", headers=ADMIN, json={"threshold": threshold}).raise_for_status()
            for _ in range(MIN_REQUESTS):
                client.post(gw.url + "/v1/chat/completions", json=chat(max_tokens=16)).raise_for_status()
        state = client.get(gw.url + "/admin/state", headers=ADMIN).json()
    live = parse_live(gw.url, state)
    assert [row.level for row in live.curves["speculative"]] == ["1"] == [row.level for row in live.curves["plain"]]
    assert live.curves["speculative"][0].requests == MIN_REQUESTS and live.accept_length is not None
    assert abs(live.accept_length - 2.4) < 0.5  # the k25-eagle3 stand-in's profile

    alone = advise("--url", gw.url, "--admin-token", TOKEN, "--json")
    assert alone.returncode == 0, alone.stderr
    body = json.loads(alone.stdout)
    assert body["source"] == "live gateway" and body["ranking"][0]["option"] in ("nothing", "always-plain")
    assert {row["option"] for row in body["ranking"]} >= {"nothing", "always-plain"}
    assert any(line.startswith("acceptance: ") for line in body["live"])
    assert any(line.startswith("level 1: speculative") for line in body["live"]), body["live"]
    text = advise("--url", gw.url, "--admin-token", TOKEN)
    assert text.returncode == 0 and "live (the running gateway's rate table):" in text.stdout

    refused = advise("--url", gw.url, "--admin-token", "wrong")
    assert refused.returncode == 2 and "admin token" in refused.stderr
    nobody = advise("--url", "http://127.0.0.1:9")
    assert nobody.returncode == 2 and "no answer" in nobody.stderr
