"""Fixtures for the load tester's tests."""

from __future__ import annotations

import pytest

from tests.loadtest.scripted_backend import ScriptedBackend

# adaptive-config (loadtest/adaptive.py) is checked against SGLang and the stand-ins the servers tests set up.
from tests.servers.conftest import sglang_python, standin_profile, state_dir  # noqa: F401 - fixtures


@pytest.fixture
def scripted(serve):
    """The scripted backend on real uvicorn: -> (base URL, app with its counters)."""
    app = ScriptedBackend()
    return serve(app).url, app


@pytest.fixture
def backend(scripted):
    """Base URL of the scripted backend."""
    return scripted[0]
