"""Profiles: what a simulated server is, read from TOML (or from a load tester's results.json).

    profile = load_profile("k25-eagle3")                     # shipped in servers/sim/profiles/
    profile = load_profile("my-gpus.toml")                   # any TOML file
    profile = load_profile("run1/results.json", target="plain")   # replay a measured curve

Three kinds describe one forward pass of the engine (see the shipped files for every key, commented):
`parametric` (fitted constants), `steptable` (measured step times per batch size, interpolated) and
`measured` (per-request speed and TTFT per concurrency, as a load test reports them).
"""

from __future__ import annotations

import dataclasses
import tomllib
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, Literal

from crossover.servers.sim.profile_file import (
    KINDS,
    DraftTable,
    MeasuredFile,
    ParametricFile,
    ProfileError,
    SteptableFile,
    check_accept_length,
    parse_profile_file,
)
from crossover.servers.sim.results import measured_profile_data

__all__ = [
    "KINDS",
    "Limits",
    "MeasuredPoint",
    "Memory",
    "Parametric",
    "Prefill",
    "Profile",
    "ProfileError",
    "Speculative",
    "StepTable",
    "available_profiles",
    "load_profile",
    "with_overrides",
]

Kind = Literal["parametric", "steptable", "measured"]
ProfileFileModel = ParametricFile | SteptableFile | MeasuredFile


@dataclass(frozen=True)
class Limits:
    max_running_requests: int
    max_queued_requests: int | None
    # KV pool in tokens; a request reserves input + max_new_tokens of it while it runs.
    max_total_num_tokens: int
    max_prefill_tokens: int
    context_length: int


@dataclass(frozen=True)
class Speculative:
    algorithm: str
    num_steps: int
    eagle_topk: int
    num_draft_tokens: int
    accept_length: float


@dataclass(frozen=True)
class Prefill:
    fixed_s: float
    per_token_s: float


@dataclass(frozen=True)
class Parametric:
    """One target-model pass = fixed + per_request x B + per_query_token x Q + per_context_token x sum(ctx)."""

    fixed_s: float
    per_request_s: float
    per_query_token_s: float
    per_context_token_s: float
    draft_fixed_s: float
    draft_per_request_s: float


@dataclass(frozen=True)
class StepTable:
    """Step times (seconds) measured at one context length, per batch size."""

    context: int
    batch: tuple[int, ...]
    decode_s: tuple[float, ...] | None
    verify_s: tuple[float, ...] | None
    draft_s: tuple[float, ...] | None


@dataclass(frozen=True)
class MeasuredPoint:
    concurrency: float
    per_request_throughput: float  # tok/s one request sees after its first token
    ttft_s: float


@dataclass(frozen=True)
class Memory:
    """Switch costs in profile seconds (the live stand-in divides them by its time scale)."""

    startup_s: float = 0.0  # weight loading at start-up
    release_s: float = 0.0  # /release_memory_occupation
    resume_s: float = 0.0  # /resume_memory_occupation


@dataclass(frozen=True)
class Profile:
    name: str
    kind: Kind
    description: str
    model_name: str
    tp_size: int
    limits: Limits
    speculative: Speculative | None
    prefill: Prefill
    memory: Memory
    step_overhead_s: float = 0.0
    parametric: Parametric | None = None
    tables: tuple[StepTable, ...] = ()
    points: tuple[MeasuredPoint, ...] = ()
    source: str = ""


def available_profiles() -> list[str]:
    folder = resources.files("crossover.servers.sim").joinpath("profiles")
    return sorted(p.name.removesuffix(".toml") for p in folder.iterdir() if p.name.endswith(".toml"))


def load_profile(name_or_path: str, *, target: str | None = None) -> Profile:
    """A shipped profile by name, or a TOML / results.json file by path."""
    path = Path(name_or_path)
    if path.suffix in (".toml", ".json") or path.exists():
        if not path.is_file():
            raise ProfileError(f"profile file {str(path)!r} does not exist")
        if path.suffix == ".json":
            data, where = measured_profile_data(path, target), str(path)
            name = f"{path.stem}:{data.pop('target')}"
            return _build(name, parse_profile_file(data, where), where)
        return _from_toml(path.stem, path.read_text(), str(path), base=path.parent, target=target)
    shipped = resources.files("crossover.servers.sim").joinpath("profiles", f"{name_or_path}.toml")
    if not shipped.is_file():
        names = ", ".join(available_profiles())
        raise ProfileError(f"no profile named {name_or_path!r}; shipped profiles: {names} (or give a file path)")
    return _from_toml(name_or_path, shipped.read_text(), f"profiles/{name_or_path}.toml", base=None, target=target)


def with_overrides(
    profile: Profile,
    *,
    accept_length: float | None = None,
    max_running_requests: int | None = None,
    max_queued_requests: int | None = None,
    model_name: str | None = None,
) -> Profile:
    """The profile with command-line overrides applied (each checked like the file's own value)."""
    limits = profile.limits
    if max_running_requests is not None:
        if max_running_requests < 1:
            raise ProfileError(f"--max-running-requests must be >= 1, got {max_running_requests}")
        limits = dataclasses.replace(limits, max_running_requests=max_running_requests)
    if max_queued_requests is not None:
        if max_queued_requests < 0:
            raise ProfileError(f"--max-queued-requests must be >= 0, got {max_queued_requests}")
        limits = dataclasses.replace(limits, max_queued_requests=max_queued_requests)
    spec = profile.speculative
    if accept_length is not None:
        if spec is None:
            raise ProfileError(f"--accept-length: profile {profile.name!r} is not speculative")
        check_accept_length(accept_length, spec.num_steps, "--accept-length")
        spec = dataclasses.replace(spec, accept_length=accept_length)
    return dataclasses.replace(profile, limits=limits, speculative=spec, model_name=model_name or profile.model_name)


def _from_toml(name: str, text: str, where: str, *, base: Path | None, target: str | None) -> Profile:
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ProfileError(f"{where}: not valid TOML: {exc}") from None
    if data.get("kind") == "measured" and "results" in data:
        results, chosen = data.pop("results"), data.pop("target", None)
        if not isinstance(results, str) or not results:
            raise ProfileError(f"{where}: results must be the path of a results.json, got {results!r}")
        if chosen is not None and not isinstance(chosen, str):
            raise ProfileError(f"{where}: target must be a string, got {chosen!r}")
        path = Path(results)
        if not path.is_absolute() and base is not None:
            path = base / path
        data = {**measured_profile_data(path, target or chosen), **data}
        data.pop("target", None)
    elif target is not None:
        raise ProfileError(f"--target only applies to a measured profile built from results.json, not {where}")
    return _build(name, parse_profile_file(data, where), where)


def _build(name: str, spec: ProfileFileModel, source: str) -> Profile:
    """The engine's frozen dataclasses from a checked profile file."""
    s = spec.speculative
    common: dict[str, Any] = {
        "name": name,
        "kind": spec.kind,
        "description": spec.description,
        "model_name": spec.model_name,
        "tp_size": spec.tp_size,
        "limits": Limits(**spec.limits.model_dump()),
        "speculative": Speculative(s.algorithm, s.num_steps, 1, s.num_steps + 1, s.accept_length) if s else None,
        "prefill": Prefill(**spec.prefill.model_dump()),
        "memory": Memory(**spec.memory.model_dump()),
        "step_overhead_s": spec.step_overhead_s,
        "source": source,
    }
    if isinstance(spec, ParametricFile):
        d, draft = spec.decode, spec.draft or DraftTable()
        parametric = Parametric(
            d.fixed_s, d.per_request_s, d.per_query_token_s, d.per_context_token_s, draft.fixed_s, draft.per_request_s
        )
        return Profile(**common, parametric=parametric)
    if isinstance(spec, SteptableFile):

        def seconds(values: list[float] | None) -> tuple[float, ...] | None:
            return None if values is None else tuple(v / 1000.0 for v in values)

        tables = tuple(
            StepTable(t.context, tuple(t.batch), seconds(t.decode_ms), seconds(t.verify_ms), seconds(t.draft_ms))
            for t in spec.steps
        )
        return Profile(**common, tables=tables)
    points = sorted(spec.points, key=lambda p: p.concurrency)
    return Profile(
        **common, points=tuple(MeasuredPoint(p.concurrency, p.per_request_throughput, p.ttft_s) for p in points)
    )
