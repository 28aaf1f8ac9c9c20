"""The import-only stand-ins (`import_standins/`: sgl_kernel, torchvision) were loaded by the real server and
nothing in them ever ran: every test before this one passed on SGLang's own CPU code.

Runs after the contract and signal tests (MODULE_ORDER in conftest.py); the restart test checks again for the
server it starts.
"""

from __future__ import annotations

import os
import subprocess
import sys

from tests.real_sglang.engine_env import STANDINS

STOOD_IN = ("sgl_kernel", "torchvision")


def standin_lines(path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


def assert_loaded_and_never_called(lines: list[str]) -> None:
    imported = {line.split()[1] for line in lines if line.startswith("import ")}
    assert set(STOOD_IN) <= imported, lines[:20]
    assert [line for line in lines if line.startswith("call ")] == []


def test_the_real_server_imported_the_standins_and_never_called_them(real_sglang):
    assert_loaded_and_never_called(standin_lines(real_sglang.standin_log))


def test_calling_anything_in_a_standin_raises_and_is_recorded(tmp_path):
    log = tmp_path / "standins.log"
    script = (
        "import sgl_kernel, torchvision.transforms as T\n"
        "for op in (sgl_kernel.copy_all_layer_kv_cache_cpu, T.Resize):\n"
        "    try:\n"
        "        op(1)\n"
        "    except RuntimeError as exc:\n"
        "        print(type(exc).__name__, exc)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(STANDINS), "CROSSOVER_STANDIN_LOG": str(log)}
    ran = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60, check=False
    )
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.count("StandInCalled") == 2, ran.stdout
    calls = [line.split()[1] for line in standin_lines(log) if line.startswith("call ")]
    assert calls == ["sgl_kernel.copy_all_layer_kv_cache_cpu", "torchvision.transforms.Resize"]
