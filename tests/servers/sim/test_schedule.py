"""Falling behind the schedule: the tracker on made-up times, then a live stand-in whose loop is starved."""

import logging
import time

import httpx
import pytest

from crossover.servers.sim.schedule import (
    LAGGING_SPEED_RATIO,
    MIN_JUDGED_WINDOW_S,
    SCHEDULE_WINDOW_S,
    ScheduleTracker,
)
from tests.waiting import wait_until

SCALE = 10.0
STEP_S = 0.05  # profile seconds per step: 5 ms of wall time at SCALE


def run_steps(tracker: ScheduleTracker, start: float, clock: float, n: int, wall_per_step: float):
    """n back-to-back steps that each take `wall_per_step` wall seconds; returns (now, clock) after them."""
    now = start
    for _ in range(n):
        tracker.step_started(now, STEP_S / SCALE)
        now += wall_per_step
        clock += STEP_S
        tracker.step_done(now, clock)
    return now, clock


def test_a_stand_in_on_time_keeps_up():
    tracker = ScheduleTracker(SCALE, now=0.0)
    now, clock = run_steps(tracker, 0.0, 0.0, 2000, STEP_S / SCALE)
    report = tracker.report(now, clock)
    assert report == {"time_scale": SCALE, "lag_s": 0.0, "max_lag_s": 0.0, "speed_ratio": 1.0, "lagging": False}


def test_a_starved_stand_in_reports_its_lag_once(caplog):
    caplog.set_level(logging.WARNING, logger="crossover.servers.sim.schedule")
    tracker = ScheduleTracker(SCALE, now=0.0)
    # Every step takes twice its time: half the simulated time it should advance, and ever further behind.
    now, clock = run_steps(tracker, 0.0, 0.0, 1000, 2 * STEP_S / SCALE)
    report = tracker.report(now, clock)
    assert report["speed_ratio"] == pytest.approx(0.5) and report["lagging"] is True
    assert report["lag_s"] == pytest.approx(1000 * STEP_S / SCALE)  # 10 s of steps done in 5 s... in 10 s
    assert report["max_lag_s"] == report["lag_s"]
    warnings = [r for r in caplog.records if "falling behind" in r.getMessage()]
    assert len(warnings) == 1  # one line when it starts lagging, not one per step
    assert "--time-scale 10" in warnings[0].getMessage()


def test_idle_ends_the_lag_and_a_window_on_time_ends_lagging(caplog):
    caplog.set_level(logging.WARNING, logger="crossover.servers.sim.schedule")
    tracker = ScheduleTracker(SCALE, now=0.0)
    now, clock = run_steps(tracker, 0.0, 0.0, 500, 2 * STEP_S / SCALE)
    assert tracker.report(now, clock)["lagging"] is True
    tracker.idle()  # nothing to do: nothing to be behind; idle time advances the clock at full speed
    now, clock = now + 1.0, clock + 1.0 * SCALE
    report = tracker.report(now, clock)
    assert report["lag_s"] == 0.0 and report["max_lag_s"] > 0 and report["lagging"] is True
    # On time again: lagging ends only once a whole window has been on time.
    now, clock = run_steps(tracker, now, clock, int(2 * SCHEDULE_WINDOW_S / (STEP_S / SCALE)), STEP_S / SCALE)
    report = tracker.report(now, clock)
    assert report["lagging"] is False and report["speed_ratio"] == pytest.approx(1.0)
    messages = [r.getMessage() for r in caplog.records]
    assert sum("falling behind" in m for m in messages) == 1
    assert sum("keeps up with its schedule again" in m for m in messages) == 1


def test_too_short_a_span_is_not_judged():
    tracker = ScheduleTracker(SCALE, now=0.0)
    now, clock = run_steps(tracker, 0.0, 0.0, 10, 10 * STEP_S / SCALE)
    assert now < MIN_JUDGED_WINDOW_S
    assert tracker.report(now, clock)["speed_ratio"] == 1.0 and not tracker.lagging


def schedule(client, url):
    return client.get(url + "/server_info").json()["schedule"]


def test_a_live_stand_in_whose_loop_is_starved_says_so(sim_app, caplog):
    caplog.set_level(logging.WARNING, logger="crossover.servers.sim.schedule")
    server = sim_app("k25-eagle3", time_scale=SCALE)
    live = server.app.state.live
    loop = live._task.get_loop()  # the stand-in's event loop, in the uvicorn thread
    with httpx.Client(timeout=10.0) as client:
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 50_000, "stream": True}
        stream = client.send(client.build_request("POST", server.url + "/v1/chat/completions", json=body), stream=True)
        try:
            assert stream.status_code == 200
            lines = stream.iter_lines()  # kept: a dropped iterator would close the stream
            assert '"delta"' in next(lines)  # generating
            before = schedule(client, server.url)
            assert before["time_scale"] == SCALE and before["lagging"] is False
            # Starve it: block its loop (as a busy CPU would) far longer than its steps, again and again.
            for _ in range(4):
                loop.call_soon_threadsafe(time.sleep, 0.5)
                time.sleep(0.1)
            wait_until(lambda: schedule(client, server.url)["lagging"], timeout=10.0)
            assert live.engine.num_running == 1  # still generating: the stand-in ran slow, nothing failed
            after = schedule(client, server.url)
            assert after["speed_ratio"] < LAGGING_SPEED_RATIO and after["max_lag_s"] > 0.2
            metrics = client.get(server.url + "/metrics").text
            assert 'crossover_sim_schedule_lag_seconds{model_name="moonshotai/Kimi-K2.5"}' in metrics
            ratio = 'crossover_sim_schedule_ratio{model_name="moonshotai/Kimi-K2.5"} '
            assert float(metrics.split(ratio)[1].split()[0]) < LAGGING_SPEED_RATIO
        finally:
            stream.close()
    assert sum("falling behind" in r.getMessage() for r in caplog.records) == 1
