"""A peer's venv made from a directory of wheels alone (`--no-index`), as on a host without a registry."""

from __future__ import annotations

import base64
import hashlib
import subprocess
import zipfile
from pathlib import Path

import pytest

from crossover.loadtest.proxybench.peers import InstallFailed, Peer

NAME, VERSION = "proxybench_fake_peer", "1.0"
# A peer whose executable only says it ran: what the venv is made of is what this test is about.
PEER = Peer("fake", f"{NAME}=={VERSION}", "fake-peer", (), "warning")


def _record_line(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def make_wheel(directory: Path) -> Path:
    """A pure-Python wheel with one console script, written by hand (no build backend, no network)."""
    info = f"{NAME}-{VERSION}.dist-info"
    files = {
        f"{NAME}/__init__.py": b"def main():\n    print('fake peer ran')\n",
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {NAME}\nVersion: {VERSION}\n".encode(),
        f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
        f"{info}/entry_points.txt": f"[console_scripts]\nfake-peer = {NAME}:main\n".encode(),
    }
    record = [_record_line(name, data) for name, data in files.items()] + [f"{info}/RECORD,,"]
    path = directory / f"{NAME}-{VERSION}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as wheel:
        for name, data in files.items():
            wheel.writestr(name, data)
        wheel.writestr(f"{info}/RECORD", "\n".join(record) + "\n")
    return path


@pytest.mark.timeout(300)
def test_a_peer_installs_from_a_directory_of_wheels_without_the_registry(tmp_path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    make_wheel(wheels)
    exe = PEER.installed(tmp_path / "venvs", wheels)
    assert exe == tmp_path / "venvs" / ".venv-fake" / "bin" / "fake-peer"
    ran = subprocess.run([str(exe)], capture_output=True, text=True, timeout=60, check=True)
    assert ran.stdout == "fake peer ran\n"
    # Installed and at the pinned version: the next run uses it as it is.
    stamp = exe.stat().st_mtime_ns
    assert PEER.installed(tmp_path / "venvs", wheels) == exe and exe.stat().st_mtime_ns == stamp


@pytest.mark.timeout(300)
def test_a_wheel_directory_without_the_peer_fails_saying_where_it_looked(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(InstallFailed, match=f"could not install {NAME}=={VERSION} from the wheels in .*empty"):
        PEER.installed(tmp_path / "venvs", tmp_path / "empty")
