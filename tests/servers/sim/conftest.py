"""Fixtures for the stand-in's tests: an in-process stand-in app on real uvicorn (fast to start)."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from crossover.servers.sim.app import SimSettings, create_app
from crossover.servers.sim.profile import load_profile, with_overrides

# High enough that a k25 step (25-340 ms of profile time) takes well under a millisecond of wall time.
FAST = 1000.0


@pytest.fixture
def sim_app(serve):
    """Serve a stand-in in this process: `sim_app("k25-eagle3", time_scale=1000, max_running_requests=4)`."""

    def start(
        profile: str = "k25-eagle3",
        *,
        time_scale: float = FAST,
        startup_delay_s: float | None = 0.0,
        registry: CollectorRegistry | None = None,
        engine: str = "sglang",
        sleep_mode: bool = False,
        **overrides,
    ):
        settings = SimSettings(
            profile=with_overrides(load_profile(profile), **overrides),
            time_scale=time_scale,
            startup_delay_s=startup_delay_s,
            engine=engine,
            sleep_mode=sleep_mode,
        )
        app = create_app(settings, registry=registry)
        server = serve(app)
        server.app = app
        return server

    return start
