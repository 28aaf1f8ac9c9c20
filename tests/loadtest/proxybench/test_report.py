"""The bar is checked line by line from rows alone: PASS, FAIL, or SKIP when something was not measured."""

from __future__ import annotations

from crossover.loadtest.proxybench.report import check_bar, render_markdown, render_text


def row(kind, c, target, rps=100.0, lat=1.0, ttfc=0.5, errors=0, ratio=1.0):
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
    }


def full_run(**crossover) -> list[dict]:
    """A run that meets the bar unless `crossover` overrides a figure: {cell name: row kwargs}."""
    rows = []
    base = {
        ("stream", 1): dict(lat=0.40, ttfc=0.10),
        ("non-stream", 1): dict(lat=0.10, ttfc=0.10),
        ("stream", 32): dict(rps=3000),
        ("stream", 256): dict(rps=3000),
        ("paced", 256): dict(rps=190, ttfc=1.0),
    }
    router = {
        ("stream", 1): dict(lat=44.0, ttfc=44.0),
        ("non-stream", 1): dict(lat=0.25, ttfc=0.25),
        ("stream", 32): dict(rps=1000),
        ("stream", 256): dict(rps=2000),
        ("paced", 256): dict(rps=190, ttfc=45.0),
    }
    ours = {
        ("stream", 1): dict(lat=0.9, ttfc=0.6),
        ("non-stream", 1): dict(lat=0.30, ttfc=0.30),
        ("stream", 32): dict(rps=2000),
        ("stream", 256): dict(rps=2500),
        ("paced", 256): dict(rps=189, ttfc=3.0),
    }
    for name, figures in crossover.items():
        kind, c = name.rsplit("_", 1)
        ours[(kind.replace("_", "-"), int(c))].update(figures)
    for cell, direct in base.items():
        rows.append(row(*cell, "direct", **direct))
        rows.append(row(*cell, "crossover", **ours[cell], ratio=ours[cell].get("rps", 100) / direct.get("rps", 100)))
        rows.append(row(*cell, "sglang-router", **router[cell]))
    return rows


def verdicts(rows) -> dict[str, str]:
    return {bar.line: bar.verdict for bar in check_bar(rows)}


def test_a_run_that_meets_the_bar_passes_every_line():
    result = verdicts(full_run())
    assert len(result) == 8
    assert set(result.values()) == {"PASS"}, result


def test_each_line_can_fail():
    cases = {
        "non-stream C=1: crossover's added p50 latency": dict(non_stream_1=dict(lat=0.5)),  # +0.4 > 2 x 0.15
        "stream C=1: crossover's added p50 time to first chunk": dict(stream_1=dict(ttfc=2.2)),
        "stream C=32: crossover's req/s": dict(stream_32=dict(rps=999)),
        "stream C=256: crossover's req/s": dict(stream_256=dict(rps=1999)),
        "paced C=256: crossover passes": dict(paced_256=dict(rps=180)),
        "paced C=256: crossover's p50 time to first chunk": dict(paced_256=dict(ttfc=11.5)),
        "no failed requests": dict(stream_32=dict(errors=1)),
    }
    for prefix, override in cases.items():
        failed = [line for line, verdict in verdicts(full_run(**override)).items() if verdict == "FAIL"]
        assert len(failed) == 1 and failed[0].startswith(prefix), (prefix, failed)


def test_lines_without_their_targets_are_skipped_not_failed():
    rows = [r for r in full_run() if r["target"] != "sglang-router"]
    result = verdicts(rows)
    assert [line for line, verdict in result.items() if verdict == "SKIP"] == [
        "stream C=1: crossover's added p50 latency <= 2x sglang-router's",
        "non-stream C=1: crossover's added p50 latency <= 2x sglang-router's",
        "stream C=32: crossover's req/s >= sglang-router's",
        "stream C=256: crossover's req/s >= sglang-router's",
    ]
    assert "FAIL" not in result.values()


def test_renderings_carry_every_row_and_line():
    rows = full_run(stream_32=dict(rps=10))
    bars = check_bar(rows)
    text = render_text(rows, bars)
    markdown = render_markdown(rows, bars, "python -m crossover.loadtest.proxybench")
    assert len(text.splitlines()) == 1 + len(rows) + 1 + len(bars)
    assert "FAIL  stream C=32" in text
    assert markdown.startswith("`python -m crossover.loadtest.proxybench`")
    assert markdown.count("\n| ") == 1 + len(rows) + 1 + len(bars)
    assert "| stream | 32 | crossover | 10 |" in markdown
