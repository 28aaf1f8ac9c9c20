"""What a run is pointed at and how hard it pushes: the bench plan, validated once when it is built.

The CLI parses flags into a `BenchPlan`; everything after that trusts it. Built directly (from Python),
the same checks apply:

    BenchPlan(targets=[Target(name="plain", url="http://127.0.0.1:30002")], concurrencies=[1, 4], ...)
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from crossover.loadtest.config import (
    DEFAULT_CONNECT_TIMEOUT_S,
    DEFAULT_INPUT_LEN,
    DEFAULT_OUTPUT_LEN,
    DEFAULT_PASSES,
    DEFAULT_READ_TIMEOUT_S,
    DEFAULT_REQUEST_TIMEOUT_S,
    DEFAULT_WARMUP_ROUNDS,
    default_requests,
)


class Target(BaseModel):
    """A named OpenAI-compatible server; `url` is its base (with or without a trailing /v1)."""

    model_config = ConfigDict(frozen=True)

    name: str = Field(min_length=1)
    url: str

    @field_validator("url")
    @classmethod
    def _http_url(cls, url: str) -> str:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"{url!r}: expected http(s)://HOST:PORT")
        return url

    @property
    def base_url(self) -> str:
        return self.url.rstrip("/").removesuffix("/v1")

    @property
    def chat_url(self) -> str:
        return f"{self.base_url}/v1/chat/completions"


class LoadSettings(BaseModel):
    """How hard and how long to push each level."""

    model_config = ConfigDict(frozen=True)

    # Measured per level; None -> default_requests(C) unless duration_s is set.
    requests: int | None = Field(None, gt=0)
    duration_s: float | None = Field(None, gt=0)  # measurement window instead of a request count
    warmup_rounds: int = Field(DEFAULT_WARMUP_ROUNDS, ge=0)  # per pass
    passes: int = Field(DEFAULT_PASSES, ge=1)  # each level measured in this many passes, the targets alternating
    lockstep: bool = False  # every worker starts with a full-length request at the same moment
    request_timeout_s: float = Field(DEFAULT_REQUEST_TIMEOUT_S, gt=0)
    connect_timeout_s: float = Field(DEFAULT_CONNECT_TIMEOUT_S, gt=0)
    read_timeout_s: float = Field(DEFAULT_READ_TIMEOUT_S, gt=0)
    headers: dict[str, str] = Field(default_factory=dict)
    seed: int = 0

    @model_validator(mode="after")
    def _one_amount(self) -> LoadSettings:
        if self.requests is not None and self.duration_s is not None:
            raise ValueError("give a request count or a duration per level, not both")
        return self

    def planned(self, concurrency: int) -> int | None:
        """Measured requests a level waits for; None when it measures for `duration_s` instead."""
        if self.requests is not None:
            return self.requests
        return None if self.duration_s is not None else default_requests(concurrency)

    def one_pass(self, concurrency: int) -> LoadSettings:
        """What one of `passes` passes of level `concurrency` measures: its share of the requests or seconds."""
        if self.passes == 1:
            return self
        if self.duration_s is not None:
            return self.model_copy(update={"passes": 1, "duration_s": self.duration_s / self.passes})
        planned = self.planned(concurrency)
        assert planned is not None
        return self.model_copy(update={"passes": 1, "requests": -(-planned // self.passes)})


class BenchPlan(BaseModel):
    """One `crossover bench` run, from the targets to what happens with the recommendation."""

    model_config = ConfigDict(frozen=True)

    targets: list[Target] = Field(min_length=1)
    concurrencies: list[int] = Field(min_length=1)  # run in ascending order, each once
    workload_model: str | None = None  # None: the first model of the first target's /v1/models
    output_len: int = Field(DEFAULT_OUTPUT_LEN, gt=0)
    input_len: int = Field(DEFAULT_INPUT_LEN, gt=0)
    ignore_eos: bool = True
    extra_body: dict[str, Any] = Field(default_factory=dict)
    load: LoadSettings = Field(default_factory=LoadSettings)
    speculative: str = "speculative"
    plain: str = "plain"
    out_dir: Path
    plots: bool = True
    apply_url: str | None = None
    admin_token: str | None = None
    # --in-engine: the patched engine that the gate-off and gate-0 targets point at, and its admin key.
    in_engine_url: str | None = None
    in_engine_admin_key: str | None = Field(None, repr=False)

    @field_validator("concurrencies")
    @classmethod
    def _ascending_positive(cls, levels: list[int]) -> list[int]:
        if any(level < 1 for level in levels):
            raise ValueError(f"expected positive integers, got {levels}")
        return sorted(set(levels))

    @field_validator("targets")
    @classmethod
    def _unique_names(cls, targets: list[Target]) -> list[Target]:
        names = [t.name for t in targets]
        if len(set(names)) != len(names):
            raise ValueError(f"target names must be unique, got {names}")
        return targets

    @field_validator("extra_body", mode="before")
    @classmethod
    def _json_object(cls, value: Any) -> Any:
        # The CLI passes the flag's text; Python callers pass a dict.
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as exc:
                raise ValueError(f"not JSON: {exc}") from None
        if not isinstance(value, dict):
            raise ValueError("must be a JSON object")
        return value

    @model_validator(mode="after")
    def _apply_needs_a_token(self) -> BenchPlan:
        if self.apply_url and not self.admin_token:
            raise ValueError("--apply needs --admin-token (or $CROSSOVER_ADMIN_TOKEN)")
        return self
