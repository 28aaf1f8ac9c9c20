"""The bar is checked line by line from rows alone: PASS, FAIL, or SKIP when something was not measured."""

from __future__ import annotations

from crossover.loadtest.proxybench.report import (
    CROSSOVER_ONE,
    CROSSOVER_REDIS,
    check_bar,
    combine,
    render_markdown,
    render_summary,
    render_text,
    summary_table,
)


def row(kind, c, target, rps=100.0, lat=1.0, ttfc=0.5, errors=0, ratio=1.0, cpu=0.2):
    return {
        "kind": kind,
        "concurrency": c,
        "target": target,
        "rps": rps,
        "ratio": ratio,
        "latency_p50_ms": lat,
        "latency_p99_ms": lat * 2,
        "ttfc_p50_ms": ttfc,
        "ttfc_p99_ms": ttfc * 2,
        "errors": errors,
        "sent": 10 + errors,
        "cpu_ms_per_request": cpu,
    }


CELLS = [("stream", 1), ("non-stream", 1), ("stream", 32), ("non-stream", 32), ("paced", 256)]
PEERS = ("smg", "vllm-router")


def full_run(**crossover) -> list[dict]:
    """A run that meets the bar unless `crossover` overrides a figure: {cell name: row kwargs}."""
    base = {
        ("stream", 1): dict(lat=0.40, ttfc=0.10),
        ("non-stream", 1): dict(lat=0.10, ttfc=0.10),
        ("paced", 256): dict(rps=190, ttfc=1.0),
    }
    peers = {
        "smg": {
            ("stream", 1): dict(lat=1.6, ttfc=1.2, cpu=0.8),
            ("non-stream", 1): dict(lat=0.6, ttfc=0.6, cpu=0.3),
            ("stream", 32): dict(cpu=0.9),
            ("non-stream", 32): dict(cpu=0.25),
            ("paced", 256): dict(rps=190, ttfc=4.0, cpu=0.7),
        },
        "vllm-router": {
            ("stream", 1): dict(lat=1.0, ttfc=0.8, cpu=0.6),
            ("non-stream", 1): dict(lat=0.4, ttfc=0.4, cpu=0.12),
            ("stream", 32): dict(cpu=0.6),
            ("non-stream", 32): dict(cpu=0.11),
            ("paced", 256): dict(rps=190, ttfc=3.0, cpu=0.5),
        },
    }
    ours = {
        ("stream", 1): dict(lat=0.8, ttfc=0.5, cpu=0.35),
        ("non-stream", 1): dict(lat=0.35, ttfc=0.35, cpu=0.11),
        ("stream", 32): dict(cpu=0.35),
        ("non-stream", 32): dict(cpu=0.10),
        ("paced", 256): dict(rps=189, ttfc=3.0, cpu=0.3),
    }
    for name, figures in crossover.items():
        kind, c = name.rsplit("_", 1)
        ours[(kind.replace("_", "-"), int(c))].update(figures)
    rows = []
    for cell in CELLS:
        direct = base.get(cell, {})
        rows.append(row(*cell, "direct", **direct))
        rows.append(row(*cell, "crossover", **ours[cell], ratio=ours[cell].get("rps", 100) / direct.get("rps", 100)))
        rows += [row(*cell, name, **peers[name][cell]) for name in PEERS]
    return rows


def verdicts(rows) -> dict[str, str]:
    return {bar.line: bar.verdict for bar in check_bar(rows)}


def test_a_run_that_meets_the_bar_passes_every_line():
    result = verdicts(full_run())
    assert len(result) == len(CELLS) + 6
    assert set(result.values()) == {"PASS"}, result


def test_each_line_can_fail():
    cases = {
        "stream C=1: crossover's CPU per request": dict(stream_1=dict(cpu=0.61)),  # vllm-router's is 0.6
        "non-stream C=32: crossover's CPU per request": dict(non_stream_32=dict(cpu=0.111)),
        "paced C=256: crossover's CPU per request": dict(paced_256=dict(cpu=0.51)),
        "stream C=1: crossover's added p50 latency": dict(stream_1=dict(lat=1.01)),  # +0.61 > vllm-router's +0.6
        "non-stream C=1: crossover's added p50 latency": dict(non_stream_1=dict(lat=0.41)),
        "stream C=1: crossover's added p50 time to first chunk": dict(stream_1=dict(ttfc=2.2, lat=0.9)),
        "paced C=256: crossover passes": dict(paced_256=dict(rps=180)),
        "paced C=256: crossover's p50 time to first chunk": dict(paced_256=dict(ttfc=11.5)),
        "no failed requests": dict(stream_32=dict(errors=1)),
    }
    for prefix, override in cases.items():
        failed = [line for line, verdict in verdicts(full_run(**override)).items() if verdict == "FAIL"]
        assert len(failed) == 1 and failed[0].startswith(prefix), (prefix, failed)


def test_each_peer_counts():
    """The CPU line holds against every peer: one peer cheaper than crossover is enough to fail it."""
    rows = full_run()
    for r in rows:
        if (r["kind"], r["concurrency"], r["target"]) == ("stream", 32, "smg"):
            r["cpu_ms_per_request"] = 0.34
    failed = [line for line, verdict in verdicts(rows).items() if verdict == "FAIL"]
    assert failed == ["stream C=32: crossover's CPU per request <= every peer's"]


def test_a_cpu_line_shows_each_rounds_ratio_to_the_cheapest_peer():
    rows = full_run()
    rounds = {"crossover": [0.10, 0.13, None], "vllm-router": [0.11, 0.10, 0.12], "smg": [0.3, 0.3, 0.3]}
    for r in rows:
        if (r["kind"], r["concurrency"]) == ("non-stream", 32) and r["target"] in rounds:
            r["cpu_rounds"] = rounds[r["target"]]
    details = {bar.line: bar.detail for bar in check_bar(rows)}
    # vllm-router (0.11 ms) is the cheaper peer; the round crossover's CPU was not read in has no ratio.
    assert details["non-stream C=32: crossover's CPU per request <= every peer's"] == (
        "crossover 0.100 ms; smg 0.250 ms, vllm-router 0.110 ms; over vllm-router, round by round: 0.91, 1.30"
    )
    assert "round by round" not in details["stream C=32: crossover's CPU per request <= every peer's"]


def test_lines_without_their_targets_are_skipped_not_failed():
    rows = [r for r in full_run() if r["target"] in ("direct", "crossover")]
    result = verdicts(rows)
    assert [line for line, verdict in result.items() if verdict == "SKIP"] == [
        *(f"{kind} C={c}: crossover's CPU per request <= every peer's" for kind, c in CELLS),
        "stream C=1: crossover's added p50 latency <= the best peer's",
        "non-stream C=1: crossover's added p50 latency <= the best peer's",
    ]
    assert "FAIL" not in result.values()


def test_renderings_carry_every_row_and_line():
    rows = full_run(stream_32=dict(rps=10))  # req/s is shown, not judged
    bars = check_bar(rows)
    text = render_text(rows, bars)
    started = {"smg": "smg launch --worker-urls http://127.0.0.1:1 --policy round_robin"}
    markdown = render_markdown(rows, bars, "python -m crossover.loadtest.proxybench", started)
    assert len(text.splitlines()) == 1 + len(rows) + 1 + len(bars)
    assert markdown.startswith("`python -m crossover.loadtest.proxybench`")
    assert "- smg: `smg launch --worker-urls http://127.0.0.1:1 --policy round_robin`" in markdown
    assert markdown.count("\n| ") == len(summary_table(rows)) + 1 + len(rows) + 1 + len(bars)
    assert "| stream | 32 | crossover | 0.350 | - | 10 |" in markdown
    rows[0]["cpu_rounds"] = [0.2, None, 0.31, 0.25]  # a round whose CPU could not be read has no say in the range
    assert "| stream | 1 | direct | 0.200 | 0.200-0.310 | 100 |" in render_markdown(rows, bars, "-")


def test_rounds_combine_as_medians_and_sums():
    rounds = [
        row("non-stream", 32, "crossover", rps=900.0, lat=2.0, cpu=0.12, errors=1),
        row("non-stream", 32, "crossover", rps=1000.0, lat=1.0, cpu=0.10),
        row("non-stream", 32, "crossover", rps=1100.0, lat=3.0, cpu=None, errors=2),
    ]
    rounds[0]["error_kinds"], rounds[2]["error_kinds"] = {"http_503": 1}, {"http_503": 1, "timeout": 1}
    combined = combine(rounds)
    assert (combined["rps"], combined["latency_p50_ms"], combined["latency_p99_ms"]) == (1000.0, 2.0, 4.0)
    assert combined["cpu_ms_per_request"] == 0.11  # the median of the rounds that measured it
    assert combined["cpu_rounds"] == [0.12, 0.10, None] and combined["rounds"] == 3
    assert (combined["sent"], combined["errors"]) == (33, 3)
    assert combined["error_kinds"] == {"http_503": 2, "timeout": 1}
    assert (combined["kind"], combined["concurrency"], combined["target"]) == ("non-stream", 32, "crossover")
    assert combine([rounds[2]])["cpu_ms_per_request"] is None


def test_a_run_without_the_paced_cell_names_no_concurrency_for_it():
    rows = [r for r in full_run() if r["kind"] != "paced"]
    skipped = [line for line, verdict in verdicts(rows).items() if verdict == "SKIP"]
    assert skipped == [
        "paced: crossover passes >= 97% of direct's req/s",
        "paced: crossover's p50 time to first chunk <= direct's + 10 ms",
    ]


def test_the_summary_is_issue_31s_table_with_crossover_over_the_best_peer():
    rows = [
        row("non-stream", 96, "direct", rps=40000, ratio=1.0, cpu=0.05),
        row("non-stream", 96, "crossover", rps=20000, ratio=0.5, cpu=0.1),
        row("non-stream", 96, "smg", rps=25000, ratio=0.625, cpu=0.2),
        row("non-stream", 96, "vllm-router", rps=10000, ratio=0.25, cpu=0.4),
        row("paced", 3072, "direct", ttfc=15.0, cpu=0.01),
        row("paced", 3072, "crossover", ttfc=20.0, cpu=0.03),
        row("paced", 3072, "smg", ttfc=10.0, cpu=0.06),
        row("paced", 3072, "vllm-router", ttfc=40.0, cpu=None),
    ]
    for r in rows[4:]:
        r["max_tokens"] = 64
    assert summary_table(rows) == [
        ["cell", "direct", "crossover", "smg", "vllm-router", "crossover / best peer"],
        ["non-stream, C=96: req/s", "40000", "20000 (0.50x)", "25000 (0.62x)", "10000 (0.25x)", "0.80"],
        ["paced 64 tokens, C=3072: req/s", "100", "100 (1.00x)", "100 (1.00x)", "100 (1.00x)", "1.00"],
        ["paced 64 tokens, C=3072: TTFT p50 ms", "15.0", "20.0", "10.0", "40.0", "2.00"],
        ["CPU ms per request, non-stream C=96", "0.050", "0.100", "0.200", "0.400", "0.50"],
        ["CPU ms per request, paced C=3072", "0.010", "0.030", "0.060", "-", "0.50"],
    ]
    assert render_summary(rows).splitlines()[2] == (
        "| non-stream, C=96: req/s | 40000 | 20000 (0.50x) | 25000 (0.62x) | 10000 (0.25x) | 0.80 |"
    )


def test_crossover_with_redis_is_judged_against_crossover_and_is_no_peer():
    rows = [row(kind, 32, target) for kind in ("stream", "non-stream") for target in ("direct", "crossover")]
    rows += [row("stream", 32, CROSSOVER_REDIS, cpu=0.208), row("non-stream", 32, CROSSOVER_REDIS, cpu=0.22)]
    bars = {bar.line: bar for bar in check_bar(rows)}
    within = bars["stream C=32: crossover's CPU per request with Redis <= 1.05x without"]
    assert within.passed is True and within.detail == "0.208 / 0.200 ms = 1.040"
    assert bars["non-stream C=32: crossover's CPU per request with Redis <= 1.05x without"].passed is False
    # crossover-redis is not a peer: with no peer in the run, the peer lines are not measured.
    assert bars["stream C=32: crossover's CPU per request <= every peer's"].passed is None
    assert not any("with Redis" in line for line in (bar.line for bar in check_bar(rows[:4])))


def test_crossover_with_workers_is_judged_against_one_process_and_is_no_peer():
    rows = [row("non-stream", 256, "direct"), row("non-stream", 256, "crossover", rps=180.0)]
    rows.append(row("non-stream", 256, CROSSOVER_ONE, rps=150.0))
    bars = {bar.line: bar for bar in check_bar(rows)}
    line = bars["non-stream C=256: crossover's req/s with its workers >= with one process"]
    assert line.passed is True and line.detail.startswith("180 / 150 req/s = 1.200")
    assert bars["non-stream C=256: crossover's CPU per request <= every peer's"].passed is None
    rows[-1]["rps"] = 200.0
    assert [bar.passed for bar in check_bar(rows) if "one process" in bar.line] == [False]
