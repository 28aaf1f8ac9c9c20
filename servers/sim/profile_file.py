"""What a profile file may say: pydantic models of the TOML (or results.json-derived) table, one per `kind`.

    spec = parse_profile_file(tomllib.loads(text), "profiles/k25-eagle3.toml")   # ProfileError if it is wrong

The models check the file; profile.py turns a checked file into the plain frozen dataclasses the engine runs
on (cheap attribute reads in the step loop, and `dataclasses.replace` for command-line overrides). Every error
names the file and the key as the file spells it (`limits.max_running_requests must be >= 1, got 0`). Unknown
keys are refused, so a misspelt key cannot silently fall back to a default.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from crossover.gateway.config import UNKNOWN_KEY_HINT

KINDS = ("parametric", "steptable", "measured")
# Keys whose value is a table: a missing one is reported as a missing section, not a missing key.
SECTIONS = frozenset({"limits", "speculative", "decode", "draft", "prefill", "memory"})

# SGLang's own defaults where a profile says nothing (python/sglang/srt/server_args.py).
DEFAULT_MAX_PREFILL_TOKENS = 16384
DEFAULT_CONTEXT_LENGTH = 131072
# A measured profile has no memory model: make the pool large enough never to bind.
UNBOUNDED_TOKENS = 1 << 40
UNBOUNDED_REQUESTS = 1 << 20

Seconds = Annotated[float, Field(ge=0.0)]


class ProfileError(ValueError):
    """A profile that cannot be found or does not make sense; the message names the file and the key."""


def check_accept_length(value: float, num_steps: int, where: str) -> None:
    # Accept length counts the bonus token, so it lies in [1, num_steps + 1].
    if not 1.0 <= value <= num_steps + 1:
        raise ProfileError(f"{where} must be between 1 and num_steps + 1 = {num_steps + 1}, got {value!r}")


class _Table(BaseModel):
    # strict: no "3" for 3 and no true for 1; an integer is still a valid float. No inf/nan anywhere.
    model_config = ConfigDict(strict=True, extra="forbid", frozen=True, allow_inf_nan=False)


class LimitsTable(_Table):
    max_running_requests: int = Field(ge=1)
    max_queued_requests: int | None = Field(default=None, ge=0)
    max_total_num_tokens: int = Field(ge=1)  # KV pool in tokens; a request reserves input + max_new_tokens
    max_prefill_tokens: int = Field(default=DEFAULT_MAX_PREFILL_TOKENS, ge=1)
    context_length: int = Field(default=DEFAULT_CONTEXT_LENGTH, ge=2)


class MeasuredLimitsTable(LimitsTable):
    # A measured curve already contains the server's queueing: nothing else binds unless asked to.
    max_running_requests: int = Field(default=UNBOUNDED_REQUESTS, ge=1)
    max_total_num_tokens: int = Field(default=UNBOUNDED_TOKENS, ge=1)


class SpeculativeTable(_Table):
    algorithm: str = Field(default="EAGLE3", min_length=1)
    num_steps: int = Field(ge=1)
    eagle_topk: Literal[1] = 1  # the stand-in models chain drafts only
    num_draft_tokens: int | None = Field(default=None, ge=2)
    accept_length: float

    @model_validator(mode="after")
    def _consistent(self) -> SpeculativeTable:
        # SGLang forces num_draft_tokens = num_steps + 1 when topk == 1.
        if self.num_draft_tokens is not None and self.num_draft_tokens != self.num_steps + 1:
            raise ValueError(f"num_draft_tokens must be num_steps + 1 with topk 1, got {self.num_draft_tokens}")
        check_accept_length(self.accept_length, self.num_steps, "accept_length")
        return self


class PrefillTable(_Table):
    fixed_s: Seconds = 0.0
    per_token_s: Seconds = 0.0


class MemoryTable(_Table):
    """Switch costs, in the profile's (simulated) seconds: the live stand-in divides them by --time-scale."""

    startup_s: Seconds = 0.0  # weight loading at start-up: /health answers 503 until it is done
    release_s: Seconds = 0.0  # /release_memory_occupation: weights out to pinned host memory
    resume_s: Seconds = 0.0  # /resume_memory_occupation: weights back onto the GPUs


class DecodeTable(_Table):
    fixed_s: Seconds
    per_request_s: Seconds = 0.0
    per_query_token_s: Seconds = 0.0
    per_context_token_s: Seconds = 0.0

    @model_validator(mode="after")
    def _takes_time(self) -> DecodeTable:
        if self.fixed_s + self.per_request_s + self.per_query_token_s <= 0:
            raise ValueError("a decode step must take some time")
        return self


class DraftTable(_Table):
    fixed_s: Seconds = 0.0
    per_request_s: Seconds = 0.0


class StepsTable(_Table):
    """Step times (ms) measured at one context length, one per batch size."""

    context: int = Field(ge=1)
    batch: list[int]
    decode_ms: list[float] | None = None
    verify_ms: list[float] | None = None
    draft_ms: list[float] | None = None

    @model_validator(mode="after")
    def _columns_match(self) -> StepsTable:
        batch = self.batch
        if not batch or any(b < 1 for b in batch) or batch != sorted(set(batch)):
            raise ValueError(f"batch must be increasing positive integers, got {batch}")
        for key in ("decode_ms", "verify_ms", "draft_ms"):
            values = getattr(self, key)
            if values is not None and (len(values) != len(batch) or any(v <= 0 for v in values)):
                raise ValueError(f"{key} needs {len(batch)} positive values, one per batch size")
        return self


class PointTable(_Table):
    concurrency: float = Field(ge=1.0)
    per_request_throughput: float = Field(gt=0.0)  # tok/s one request sees after its first token
    ttft_s: Seconds


class _ProfileFile(_Table):
    description: str = ""
    model_name: str = Field(min_length=1)
    tp_size: int = Field(default=1, ge=1)
    step_overhead_s: Seconds = 0.0
    speculative: SpeculativeTable | None = None
    memory: MemoryTable = MemoryTable()


class ParametricFile(_ProfileFile):
    """One target-model pass = fixed + per_request x B + per_query_token x Q + per_context_token x sum(ctx)."""

    kind: Literal["parametric"]
    limits: LimitsTable
    prefill: PrefillTable
    decode: DecodeTable
    draft: DraftTable | None = None

    @model_validator(mode="after")
    def _draft_when_speculative(self) -> ParametricFile:
        if self.speculative is not None and self.draft is None:
            raise ValueError("a speculative parametric profile needs a [draft] section")
        return self


class SteptableFile(_ProfileFile):
    kind: Literal["steptable"]
    limits: LimitsTable
    prefill: PrefillTable
    steps: list[StepsTable]

    @model_validator(mode="after")
    def _tables_fit(self) -> SteptableFile:
        if not self.steps:
            raise ValueError("a steptable profile needs at least one [[steps]] table")
        contexts = [t.context for t in self.steps]
        if contexts != sorted(set(contexts)):
            raise ValueError("[[steps]] tables must have increasing, distinct contexts")
        needed = ("verify_ms", "draft_ms") if self.speculative is not None else ("decode_ms",)
        for i, table in enumerate(self.steps):
            for key in needed:
                if getattr(table, key) is None:
                    kind = "speculative" if self.speculative is not None else "plain"
                    raise ValueError(f"steps[{i}]: {key} is required for a {kind} profile")
        return self


class MeasuredFile(_ProfileFile):
    kind: Literal["measured"]
    limits: MeasuredLimitsTable = MeasuredLimitsTable()
    prefill: PrefillTable = PrefillTable()
    points: list[PointTable]

    @model_validator(mode="after")
    def _distinct_points(self) -> MeasuredFile:
        if not self.points:
            raise ValueError("a measured profile needs at least one point")
        if len({p.concurrency for p in self.points}) != len(self.points):
            raise ValueError("two points have the same concurrency")
        return self


ProfileFile = Annotated[ParametricFile | SteptableFile | MeasuredFile, Field(discriminator="kind")]


class _Document(BaseModel):
    profile: ProfileFile


def parse_profile_file(data: Any, where: str) -> ParametricFile | SteptableFile | MeasuredFile:
    """The validated model of a profile table; ProfileError (naming `where` and the key) if it does not fit."""
    if not isinstance(data, dict):
        raise ProfileError(f"{where}: expected a table, got {type(data).__name__}")
    try:
        return _Document.model_validate({"profile": data}).profile
    except ValidationError as exc:
        problems = [_describe(error) for error in exc.errors(include_url=False)]
        raise ProfileError(f"{where}: " + "; ".join(problems)) from None


def _describe(error: Any) -> str:
    """One pydantic error as a phrase about the file: `limits.max_running_requests must be >= 1, got 0`."""
    kind, ctx = error["type"], error.get("ctx") or {}
    # loc is ("profile", <kind tag>, key, ...): the wrapper and the union's tag say nothing to the reader.
    loc = list(error["loc"][1:])
    if loc and loc[0] in KINDS:
        loc = loc[1:]
    path = _path(loc)
    if kind == "union_tag_invalid":
        return f"kind must be one of {', '.join(KINDS)}, got {ctx.get('tag')!r}"
    if kind == "union_tag_not_found":
        return f"missing key 'kind' (one of {', '.join(KINDS)})"
    if kind == "missing":
        key = loc[-1] if loc else "?"
        inside = f" in [{_path(loc[:-1])}]" if len(loc) > 1 else ""
        if key in SECTIONS:
            return f"missing [{key}] section"
        return f"missing key {key!r}{inside}"
    if kind == "extra_forbidden":
        return f"unknown key {path!r} ({UNKNOWN_KEY_HINT})"
    if kind == "value_error":
        message = str(ctx.get("error", error["msg"]))
        return f"{path}: {message}" if path else message
    rule = _RULES.get(kind)
    if rule is None:
        rule = error["msg"][0].lower() + error["msg"][1:]
    elif "{" in rule:
        rule = rule.format(**ctx)
    return f"{path} {rule}, got {error.get('input')!r}"


_RULES = {
    "greater_than_equal": "must be >= {ge}",
    "greater_than": "must be > {gt}",
    "less_than_equal": "must be <= {le}",
    "int_type": "must be an integer",
    "float_type": "must be a number",
    "finite_number": "must be a finite number",
    "string_type": "must be a string",
    "string_too_short": "must be a non-empty string",
    "list_type": "must be a list",
    "model_type": "must be a table",
    "model_attributes_type": "must be a table",
    "literal_error": "must be {expected}",
}


def _path(loc: list[Any]) -> str:
    """("steps", 0, "batch") -> "steps[0].batch", as one would address it in the TOML file."""
    text = ""
    for part in loc:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text
