"""Waiting on a condition in tests. A poll, never a sleep-as-wait."""

from __future__ import annotations

import time

WAIT_S = 20.0
POLL_S = 0.02


def wait_until(condition, timeout: float = WAIT_S, what: str = "condition") -> None:
    """Poll `condition` until it is true; fail the test if it is not within `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(POLL_S)
