"""Does a profile fit this box? Checked by `plan` and before `up` starts anything.

    report = check_fit(profile)          # probes nvidia-smi, /proc/meminfo and the ports
    if report.problems: refuse(report.problems)

- GPU ids exist (when `nvidia-smi` is there; without it only disjointness is checked, and the report says so)
  and no GPU is held by two servers that run at the same time;
- every port is free to bind (as the servers bind: with SO_REUSEADDR);
- with sleep/wake, the host can hold the released configuration's weights: the reference box has no swap,
  and running out of host memory takes the whole machine down. Sizes come from a local model folder's
  safetensors index, else from the profile's `weights_gb`.

The probes are injectable (`gpus=`, `available_gb=`, `port_free=`) so the rules are testable on any box.
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from crossover.servers.profile import Profile, Server

GB = 1e9
NVIDIA_SMI_TIMEOUT_S = 15.0
SAFETENSORS_INDEX = "model.safetensors.index.json"


@dataclass
class FitReport:
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def fits(self) -> bool:
        return not self.problems


@dataclass(frozen=True)
class GpuProcess:
    pid: int
    gpu: int
    used_mib: int


def nvidia_smi() -> str | None:
    return shutil.which("nvidia-smi")


def gpu_inventory() -> list[int] | None:
    """Indices of the GPUs nvidia-smi sees, or None when there is no nvidia-smi."""
    smi = nvidia_smi()
    if smi is None:
        return None
    out = subprocess.run(
        [smi, "--query-gpu=index", "--format=csv,noheader,nounits"],
        capture_output=True,
        text=True,
        timeout=NVIDIA_SMI_TIMEOUT_S,
        check=True,
    ).stdout
    return [int(line) for line in out.split() if line.strip()]


def gpu_processes(gpus: list[int]) -> list[GpuProcess] | None:
    """Processes holding memory on `gpus` (nvidia-smi), or None when there is no nvidia-smi."""
    smi = nvidia_smi()
    if smi is None:
        return None

    def query(what: str) -> list[list[str]]:
        out = subprocess.run(
            [smi, f"--query-{what}", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=NVIDIA_SMI_TIMEOUT_S,
            check=True,
        ).stdout
        return [[part.strip() for part in line.split(",")] for line in out.splitlines() if line.strip()]

    index_of = {uuid: int(index) for index, uuid in query("gpu=index,uuid")}
    held = []
    for pid, uuid, used in query("compute-apps=pid,gpu_uuid,used_memory"):
        gpu = index_of.get(uuid)
        if gpu in gpus:
            held.append(GpuProcess(pid=int(pid), gpu=gpu, used_mib=int(used) if used.isdigit() else 0))
    return held


def host_available_gb() -> float:
    """MemAvailable: what the host can still hand out without swapping (there may be no swap)."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024 / GB
    raise RuntimeError("/proc/meminfo has no MemAvailable")


def port_is_free(host: str, port: int) -> bool:
    """Whether a server could bind `host:port` now, as SGLang's uvicorn will: with SO_REUSEADDR, so a port
    left in TIME_WAIT by a server just stopped (`servers down`, then `up`) counts as free, as it is to them."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def folder_weights_gb(path: str) -> float | None:
    """Weight bytes of a local model folder: the safetensors index's total_size, else the files' sizes."""
    folder = Path(path).expanduser()
    if not folder.is_dir():
        return None
    index = folder / SAFETENSORS_INDEX
    if index.is_file():
        try:
            total = json.loads(index.read_text())["metadata"]["total_size"]
            return float(total) / GB
        except (ValueError, KeyError, TypeError):
            pass
    files = list(folder.glob("*.safetensors"))
    return sum(f.stat().st_size for f in files) / GB if files else None


def server_weights_gb(server: Server) -> tuple[float | None, str]:
    """(GB, where the figure comes from) of the weights a sleeping server keeps in host memory."""
    target = folder_weights_gb(server.model_path) if server.model_path else None
    if target is not None:
        draft = 0.0
        if server.speculative is not None:
            draft = folder_weights_gb(server.speculative.draft_model_path) or 0.0
        return target + draft, f"safetensors in {server.model_path}"
    if server.weights_gb is not None:
        return server.weights_gb, "weights_gb"
    return None, "unknown"


def check_fit(
    profile: Profile,
    *,
    gpus: Callable[[], list[int] | None] = gpu_inventory,
    available_gb: Callable[[], float] = host_available_gb,
    port_free: Callable[[str, int], bool] = port_is_free,
) -> FitReport:
    report = FitReport()
    _check_gpus(profile, gpus, report)
    for server in profile.servers:
        if not port_free(server.host, server.port):
            report.problems.append(f"server {server.name!r}: port {server.host}:{server.port} is in use")
        spec = server.speculative
        if spec is not None and spec.adaptive_config and not Path(spec.adaptive_config).is_file():
            report.problems.append(
                f"server {server.name!r}: adaptive config {spec.adaptive_config} does not exist "
                f"({_slots_remedy(profile, spec.adaptive_config)})"
            )
    if profile.sleeps:
        _check_host_memory(profile, available_gb, report)
    report.notes.extend(profile.warnings())
    return report


def _check_gpus(profile: Profile, gpus: Callable[[], list[int] | None], report: FitReport) -> None:
    for group in profile.concurrent_groups():
        holder: dict[int, str] = {}
        for server in group:
            for gpu in server.gpus:
                if gpu in holder:
                    report.problems.append(
                        f"GPU {gpu} is given to both {holder[gpu]!r} and {server.name!r}, which run at the same time"
                    )
                holder[gpu] = server.name
    real = [s for s in profile.servers if s.engine != "sim"]
    if not real:
        report.notes.append("stand-in servers only: their GPU ids are simulated and not checked against the box")
        return
    present = gpus()
    if present is None:
        report.notes.append("no nvidia-smi on this machine: GPU ids checked for disjointness only, not existence")
        return
    for server in real:
        missing = sorted(set(server.gpus) - set(present))
        if missing:
            report.problems.append(
                f"server {server.name!r}: GPU {', '.join(map(str, missing))} not present "
                f"(nvidia-smi sees {present or 'none'})"
            )


def _check_host_memory(profile: Profile, available_gb: Callable[[], float], report: FitReport) -> None:
    sizes: dict[str, float] = {}
    for server in profile.servers:
        if server.engine == "sim":
            continue
        size, source = server_weights_gb(server)
        if size is None:
            report.problems.append(
                f"server {server.name!r}: weight size unknown (model_path is not a local folder and there is no "
                "weights_gb); sleep keeps it in host memory, so it must be known"
            )
            continue
        sizes[server.name] = size
        report.notes.append(f"server {server.name!r}: {size:.1f} GB of weights ({source})")
    if not sizes:
        return
    # Whichever mode is active, every other one sleeps with its weights in host memory.
    total = sum(sizes.values())
    need = max(total - size for size in sizes.values()) + profile.host_memory_headroom_gb
    have = available_gb()
    if need > have:
        report.problems.append(
            f"host memory: sleep needs {need:.1f} GB (released weights + {profile.host_memory_headroom_gb:g} GB "
            f"headroom) but only {have:.1f} GB is available - {need - have:.1f} GB short; use mechanism "
            "'restart' or a host with more memory (there may be no swap to fall back on)"
        )


def _slots_remedy(profile: Profile, wanted: str) -> str:
    """What the profile's own comment says to do: copy the slots file shipped beside it, where there is one."""
    shipped = resources.files("crossover.servers").joinpath("profiles", f"{profile.name}.slots.json")
    if shipped.is_file():
        return f"copy the shipped one: cp servers/profiles/{profile.name}.slots.json {wanted}"
    return f"write it with `crossover servers adaptive-config {profile.name}`"
