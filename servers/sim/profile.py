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

from crossover.servers.sim.fields import REQUIRED, ProfileError, Table, check
from crossover.servers.sim.results import measured_profile_data

Kind = Literal["parametric", "steptable", "measured"]
KINDS: tuple[Kind, ...] = ("parametric", "steptable", "measured")

# SGLang's own defaults where a profile says nothing (python/sglang/srt/server_args.py).
DEFAULT_MAX_PREFILL_TOKENS = 16384
DEFAULT_CONTEXT_LENGTH = 131072
# A measured profile has no memory model: make the pool large enough never to bind.
UNBOUNDED_TOKENS = 1 << 40
UNBOUNDED_REQUESTS = 1 << 20


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
    release_s: float
    resume_s: float


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
            return _build(f"{path.stem}:{data['target']}", data, where)
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
        check(max_running_requests >= 1, "--max-running-requests", "must be >= 1", max_running_requests)
        limits = dataclasses.replace(limits, max_running_requests=max_running_requests)
    if max_queued_requests is not None:
        check(max_queued_requests >= 0, "--max-queued-requests", "must be >= 0", max_queued_requests)
        limits = dataclasses.replace(limits, max_queued_requests=max_queued_requests)
    spec = profile.speculative
    if accept_length is not None:
        if spec is None:
            raise ProfileError(f"--accept-length: profile {profile.name!r} is not speculative")
        _check_accept_length(accept_length, spec.num_steps, "--accept-length")
        spec = dataclasses.replace(spec, accept_length=accept_length)
    return dataclasses.replace(profile, limits=limits, speculative=spec, model_name=model_name or profile.model_name)


def _from_toml(name: str, text: str, where: str, *, base: Path | None, target: str | None) -> Profile:
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ProfileError(f"{where}: not valid TOML: {exc}") from None
    if data.get("kind") == "measured" and "results" in data:
        results = Path(Table(data, where).text("results"))
        if not results.is_absolute() and base is not None:
            results = base / results
        measured = measured_profile_data(results, target or Table(data, where).opt_text("target"))
        data = {**measured, **{k: v for k, v in data.items() if k not in ("results", "target")}}
    elif target is not None:
        raise ProfileError(f"--target only applies to a measured profile built from results.json, not {where}")
    return _build(name, data, where)


def _build(name: str, data: dict[str, Any], where: str) -> Profile:
    doc = Table(data, where)
    kind = doc.text("kind")
    if kind not in KINDS:
        raise ProfileError(f"{where}: kind must be one of {', '.join(KINDS)}, got {kind!r}")
    measured = kind == "measured"
    spec = _speculative(doc.section("speculative")) if "speculative" in data else None
    return Profile(
        name=name,
        kind=kind,
        description=doc.opt_text("description") or "",
        model_name=doc.text("model_name"),
        tp_size=doc.int_("tp_size", default=1, minimum=1),
        limits=_limits(doc.section("limits", required=not measured), measured=measured),
        speculative=spec,
        prefill=_prefill(doc.section("prefill", required=not measured)),
        memory=_memory(doc.section("memory", required=False)),
        step_overhead_s=doc.number("step_overhead_s", default=0.0, minimum=0.0),
        parametric=_parametric(doc, spec) if kind == "parametric" else None,
        tables=_tables(doc, spec) if kind == "steptable" else (),
        points=_points(doc.list_("points"), where) if measured else (),
        source=where,
    )


def _limits(doc: Table, *, measured: bool) -> Limits:
    # A measured curve already contains the server's queueing: nothing else may bind unless asked to.
    return Limits(
        max_running_requests=doc.int_(
            "max_running_requests", default=UNBOUNDED_REQUESTS if measured else REQUIRED, minimum=1
        ),
        max_queued_requests=doc.int_("max_queued_requests", default=None, minimum=0),
        max_total_num_tokens=doc.int_(
            "max_total_num_tokens", default=UNBOUNDED_TOKENS if measured else REQUIRED, minimum=1
        ),
        max_prefill_tokens=doc.int_("max_prefill_tokens", default=DEFAULT_MAX_PREFILL_TOKENS, minimum=1),
        context_length=doc.int_("context_length", default=DEFAULT_CONTEXT_LENGTH, minimum=2),
    )


def _speculative(doc: Table) -> Speculative:
    num_steps = doc.int_("num_steps", minimum=1)
    if doc.int_("eagle_topk", default=1, minimum=1) != 1:
        raise ProfileError(f"{doc.where}: eagle_topk must be 1 (the stand-in models chain drafts only)")
    # SGLang forces num_draft_tokens = num_steps + 1 when topk == 1.
    draft_tokens = doc.int_("num_draft_tokens", default=num_steps + 1, minimum=2)
    check(
        draft_tokens == num_steps + 1,
        f"{doc.where}: num_draft_tokens",
        "must be num_steps + 1 with topk 1",
        draft_tokens,
    )
    accept = doc.number("accept_length")
    _check_accept_length(accept, num_steps, f"{doc.where}: accept_length")
    return Speculative(doc.opt_text("algorithm") or "EAGLE3", num_steps, 1, draft_tokens, accept)


def _check_accept_length(value: float, num_steps: int, where: str) -> None:
    # Accept length counts the bonus token, so it lies in [1, num_steps + 1].
    check(1.0 <= value <= num_steps + 1, where, f"must be between 1 and num_steps + 1 = {num_steps + 1}", value)


def _prefill(doc: Table) -> Prefill:
    return Prefill(doc.number("fixed_s", default=0.0, minimum=0.0), doc.number("per_token_s", default=0.0, minimum=0.0))


def _memory(doc: Table) -> Memory:
    return Memory(doc.number("release_s", default=0.0, minimum=0.0), doc.number("resume_s", default=0.0, minimum=0.0))


def _parametric(doc: Table, spec: Speculative | None) -> Parametric:
    decode = doc.section("decode")
    draft = doc.section("draft", required=spec is not None)
    params = Parametric(
        fixed_s=decode.number("fixed_s", minimum=0.0),
        per_request_s=decode.number("per_request_s", default=0.0, minimum=0.0),
        per_query_token_s=decode.number("per_query_token_s", default=0.0, minimum=0.0),
        per_context_token_s=decode.number("per_context_token_s", default=0.0, minimum=0.0),
        draft_fixed_s=draft.number("fixed_s", default=0.0, minimum=0.0),
        draft_per_request_s=draft.number("per_request_s", default=0.0, minimum=0.0),
    )
    if params.fixed_s + params.per_request_s + params.per_query_token_s <= 0:
        raise ProfileError(f"{decode.where}: a decode step must take some time")
    return params


def _tables(doc: Table, spec: Speculative | None) -> tuple[StepTable, ...]:
    tables = []
    for i, raw in enumerate(doc.list_("steps")):
        t = Table(raw, f"{doc.where}: steps[{i}]")
        batch = tuple(t.int_list("batch"))
        if not batch or any(b < 1 for b in batch) or list(batch) != sorted(set(batch)):
            raise ProfileError(f"{t.where}: batch must be increasing positive integers")
        columns = {}
        for key in ("decode_ms", "verify_ms", "draft_ms"):
            if key in raw:
                values = t.number_list(key)
                if len(values) != len(batch) or any(v <= 0 for v in values):
                    raise ProfileError(f"{t.where}: {key} needs {len(batch)} positive values, one per batch size")
                columns[key] = tuple(v / 1000.0 for v in values)
        for key in ("verify_ms", "draft_ms") if spec is not None else ("decode_ms",):
            if key not in columns:
                kind = "speculative" if spec is not None else "plain"
                raise ProfileError(f"{t.where}: {key} is required for a {kind} profile")
        tables.append(
            StepTable(
                t.int_("context", minimum=1),
                batch,
                columns.get("decode_ms"),
                columns.get("verify_ms"),
                columns.get("draft_ms"),
            )
        )
    if not tables:
        raise ProfileError(f"{doc.where}: a steptable profile needs at least one [[steps]] table")
    contexts = [t.context for t in tables]
    if contexts != sorted(set(contexts)):
        raise ProfileError(f"{doc.where}: [[steps]] tables must have increasing, distinct contexts")
    return tuple(tables)


def _points(raw_points: list[Any], where: str) -> tuple[MeasuredPoint, ...]:
    points = []
    for i, raw in enumerate(raw_points):
        p = Table(raw, f"{where}: points[{i}]")
        points.append(
            MeasuredPoint(
                concurrency=p.number("concurrency", minimum=1.0),
                per_request_throughput=p.number("per_request_throughput", minimum=1e-9),
                ttft_s=p.number("ttft_s", minimum=0.0),
            )
        )
    points.sort(key=lambda p: p.concurrency)
    if not points:
        raise ProfileError(f"{where}: a measured profile needs at least one point")
    if len({p.concurrency for p in points}) != len(points):
        raise ProfileError(f"{where}: two points have the same concurrency")
    return tuple(points)
