"""The Rust gateways crossover is measured against: pinned releases, each in its own venv made on first use.

    peer = PEERS["smg"]
    exe = peer.installed(venvs)                     # .venv-smg/bin/smg, installed from the registry if missing
    exe = peer.installed(venvs, wheels=Path("w"))   # ... or from a directory of wheels (no registry on the host)
    argv = peer.argv(exe, backend_url, host, port, metrics_port)

Every peer starts the way a real deployment would run it and the comparison needs: round-robin to the one
worker, health checks every `HEALTH_INTERVAL_S` (crossover's default interval), Prometheus metrics on, no
authentication, logs at warning. Flags as each release's own `--help` lists them.
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from crossover.gateway.config import DEFAULT_HEALTH_INTERVAL_S

SMG, VLLM_ROUTER, SGLANG_ROUTER = "smg", "vllm-router", "sglang-router"
VENV_INSTALL_TIMEOUT_S = 600.0
HEALTH_INTERVAL_S = DEFAULT_HEALTH_INTERVAL_S


class InstallFailed(Exception):
    """A peer's venv could not be made."""


@dataclass(frozen=True)
class Peer:
    name: str
    requirement: str  # pinned, as pip reads it
    executable: str  # in the venv's bin/
    launch: tuple[str, ...]  # what follows the executable, before the common flags
    log_level: str  # each spells "warning" its own way

    def venv(self, venvs: Path) -> Path:
        return venvs / f".venv-{self.name}"

    def installed(self, venvs: Path, wheels: Path | None = None) -> Path:
        """The peer's executable, installing the pinned release into its own venv first if it is not there: from
        the registry, or with `wheels` from that directory alone (a host without a registry: `pip download
        REQUIREMENT -d DIR` where there is one, carry DIR over)."""
        venv = self.venv(venvs)
        exe = venv / "bin" / self.executable
        python = venv / "bin" / "python"
        name, version = self.requirement.split("==")
        probe = [str(python), "-c", f"import importlib.metadata as m; print(m.version({name!r}))"]
        if exe.exists():
            shown = subprocess.run(probe, capture_output=True, text=True, check=False).stdout
            if shown.strip() == version:
                return exe
        source = f"the wheels in {wheels}" if wheels else "the registry"
        print(f"proxybench: installing {self.requirement} into {venv} from {source}", file=sys.stderr)
        offline = ["--no-index", "--find-links", str(wheels.absolute())] if wheels else []
        # No pip in the venv: this Python's pip installs into it (`--python`), so a Python without ensurepip (a
        # distribution's, without its venv package) makes one all the same.
        try:
            venv_argv = [sys.executable, "-m", "venv", "--clear", "--without-pip", str(venv)]
            subprocess.run(venv_argv, check=True, stdout=sys.stderr)
            subprocess.run(
                [sys.executable, "-m", "pip", "--python", str(python), "install", "-q", *offline, self.requirement],
                check=True,
                timeout=VENV_INSTALL_TIMEOUT_S,
                stdout=sys.stderr,
            )
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
            raise InstallFailed(f"could not install {self.requirement} from {source}: {exc}") from exc
        return exe

    def argv(self, exe: Path, backend_url: str, host: str, port: int, metrics_port: int) -> list[str]:
        return [
            str(exe),
            *self.launch,
            "--worker-urls",
            backend_url,
            "--policy",
            "round_robin",
            "--host",
            host,
            "--port",
            str(port),
            "--prometheus-host",
            host,
            "--prometheus-port",
            str(metrics_port),
            "--health-check-interval-secs",
            f"{HEALTH_INTERVAL_S:g}",
            "--log-level",
            self.log_level,
        ]


PEERS = {
    peer.name: peer
    for peer in (
        # Shepherd Model Gateway: the SGLang router's continuation.
        Peer(SMG, "smg==1.13.0", "smg", ("launch",), "warn"),
        # vLLM's fork of the SGLang router.
        Peer(VLLM_ROUTER, "vllm-router==0.1.17", "vllm-router", (), "warning"),
        # The January release the benchmark used to measure against; smg supersedes it (not run by default).
        Peer(SGLANG_ROUTER, "sglang-router==0.3.2", "python", ("-m", "sglang_router.launch_router"), "warn"),
    )
}
