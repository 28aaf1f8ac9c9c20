"""Gateway settings: one TOML file plus `CROSSOVER_...` environment variables (nested with `__`).

    settings = load_settings(Path("crossover.toml"))    # env overrides the file
    settings = Settings(pools={"speculative": {"backends": [...]}, "plain": {"backends": [...]}})

Every default is named here; `gateway/example.toml` documents each field.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

SPECULATIVE = "speculative"
PLAIN = "plain"
POOL_NAMES = (SPECULATIVE, PLAIN)

Policy = Literal["switch", "spillover"]
LoadSignal = Literal["local", "scraped", "max"]

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000
DEFAULT_POLICY: Policy = "spillover"
DEFAULT_THRESHOLD = 32
DEFAULT_HYSTERESIS = 4

DEFAULT_CONNECT_TIMEOUT_S = 5.0
# Non-streaming requests get their first byte only when generation is done; queued streams wait too.
DEFAULT_FIRST_BYTE_TIMEOUT_S = 300.0
DEFAULT_BETWEEN_CHUNKS_TIMEOUT_S = 60.0
DEFAULT_TOTAL_TIMEOUT_S = 1800.0
DEFAULT_QUEUE_TIMEOUT_S = 30.0
# Below uvicorn's (and so SGLang's) 5 s idle close, so we never reuse a connection the backend is closing.
DEFAULT_BACKEND_KEEPALIVE_S = 2.0
# Above the 5 s keep-alive of common client pools (httpx, the OpenAI SDK) for the same reason, mirrored.
DEFAULT_CLIENT_KEEPALIVE_S = 65.0
DEFAULT_GRACEFUL_SHUTDOWN_S = 30.0

DEFAULT_MAX_BODY_BYTES = 16 * 1024 * 1024
DEFAULT_MAX_INFLIGHT = 1024
DEFAULT_MAX_QUEUED = 1024
DEFAULT_MAX_FAILOVERS = 2

DEFAULT_HEALTH_PATH = "/health"
DEFAULT_HEALTH_INTERVAL_S = 5.0
# SGLang's /health runs a one-token generation and answers after at least a second.
DEFAULT_HEALTH_TIMEOUT_S = 5.0
DEFAULT_FAILURE_THRESHOLD = 3
DEFAULT_EJECT_S = 30.0
DEFAULT_LOAD_INTERVAL_S = 1.0


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class PoolSettings(_Section):
    backends: list[str] = Field(min_length=1)

    @field_validator("backends")
    @classmethod
    def _urls(cls, urls: list[str]) -> list[str]:
        cleaned = []
        for url in urls:
            parts = urlsplit(url)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise ValueError(f"{url!r} is not an http(s) URL like http://127.0.0.1:30000")
            if parts.query or parts.fragment:
                raise ValueError(f"{url!r}: a backend URL takes no query or fragment")
            cleaned.append(url.rstrip("/"))
        return cleaned


class PoolsSettings(_Section):
    speculative: PoolSettings
    plain: PoolSettings

    # One server in both pools is allowed (benchmarks, a single-GPU trial); each pool counts its own requests.
    @model_validator(mode="after")
    def _no_repeats(self) -> PoolsSettings:
        for name in POOL_NAMES:
            backends = getattr(self, name).backends
            if len(set(backends)) != len(backends):
                raise ValueError(f"pool {name!r} lists a backend twice")
        return self


class TimeoutSettings(_Section):
    connect: float = Field(DEFAULT_CONNECT_TIMEOUT_S, gt=0)
    first_byte: float = Field(DEFAULT_FIRST_BYTE_TIMEOUT_S, gt=0)
    between_chunks: float = Field(DEFAULT_BETWEEN_CHUNKS_TIMEOUT_S, gt=0)
    total: float = Field(DEFAULT_TOTAL_TIMEOUT_S, gt=0)
    queue: float = Field(DEFAULT_QUEUE_TIMEOUT_S, gt=0)
    backend_keepalive: float = Field(DEFAULT_BACKEND_KEEPALIVE_S, ge=0)
    client_keepalive: float = Field(DEFAULT_CLIENT_KEEPALIVE_S, gt=0)
    graceful_shutdown: float = Field(DEFAULT_GRACEFUL_SHUTDOWN_S, ge=0)


class LimitSettings(_Section):
    max_body_bytes: int = Field(DEFAULT_MAX_BODY_BYTES, gt=0)
    max_inflight: int = Field(DEFAULT_MAX_INFLIGHT, gt=0)
    max_queued: int = Field(DEFAULT_MAX_QUEUED, ge=0)
    max_failovers: int = Field(DEFAULT_MAX_FAILOVERS, ge=0)


class HealthSettings(_Section):
    path: str = DEFAULT_HEALTH_PATH
    interval: float = Field(DEFAULT_HEALTH_INTERVAL_S, gt=0)
    timeout: float = Field(DEFAULT_HEALTH_TIMEOUT_S, gt=0)
    failure_threshold: int = Field(DEFAULT_FAILURE_THRESHOLD, ge=1)
    eject_seconds: float = Field(DEFAULT_EJECT_S, ge=0)
    load_interval: float = Field(DEFAULT_LOAD_INTERVAL_S, gt=0)

    @field_validator("path")
    @classmethod
    def _path(cls, path: str) -> str:
        if not path.startswith("/"):
            raise ValueError(f"{path!r} must start with '/'")
        return path


def fit_hysteresis(threshold: int, hysteresis: int) -> int:
    """The largest band up to `hysteresis` that fits under `threshold` (for when no hysteresis was asked for)."""
    return min(hysteresis, max(threshold - 1, 0))


def check_threshold(threshold: int, hysteresis: int) -> None:
    """The hysteresis band sits below the threshold; it must leave room to come back."""
    if threshold < 0:
        raise ValueError(f"threshold must be >= 0, got {threshold}")
    if hysteresis < 0:
        raise ValueError(f"hysteresis must be >= 0, got {hysteresis}")
    if hysteresis and hysteresis >= threshold:
        raise ValueError(f"hysteresis ({hysteresis}) must be less than threshold ({threshold}), or 0")


class Settings(BaseSettings):
    """Everything `crossover serve` needs; validated once at start."""

    model_config = SettingsConfigDict(env_prefix="CROSSOVER_", env_nested_delimiter="__", extra="forbid")

    host: str = DEFAULT_HOST
    port: int = Field(DEFAULT_PORT, ge=0, le=65535)
    log_level: Literal["critical", "error", "warning", "info", "debug"] = "info"

    policy: Policy = DEFAULT_POLICY
    threshold: int = Field(DEFAULT_THRESHOLD, ge=0)
    hysteresis: int = Field(DEFAULT_HYSTERESIS, ge=0)
    load_signal: LoadSignal = "local"
    admin_token: str = ""
    served_model_names: list[str] = []
    state_file: Path | None = None

    pools: PoolsSettings
    timeouts: TimeoutSettings = TimeoutSettings()
    limits: LimitSettings = LimitSettings()
    health: HealthSettings = HealthSettings()

    @model_validator(mode="after")
    def _threshold(self) -> Settings:
        if "hysteresis" not in self.model_fields_set:
            self.hysteresis = fit_hysteresis(self.threshold, self.hysteresis)
        check_threshold(self.threshold, self.hysteresis)
        return self

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # The file's values arrive as init arguments (see load_settings); the environment overrides them.
        return env_settings, init_settings


class SettingsError(Exception):
    """Settings that cannot start a gateway; the message names the field."""


def load_settings(path: Path | None = None) -> Settings:
    """Read `path` (TOML) if given, then let the environment override it; raise SettingsError."""
    data: dict = {}
    if path is not None:
        try:
            data = tomllib.loads(path.read_text())
        except OSError as exc:
            raise SettingsError(f"cannot read config file {path}: {exc.strerror or exc}") from exc
        except tomllib.TOMLDecodeError as exc:
            raise SettingsError(f"{path} is not valid TOML: {exc}") from exc
    try:
        return Settings(**data)
    except ValidationError as exc:
        raise SettingsError(describe(exc, source=str(path) if path else "settings")) from exc


def describe(exc: ValidationError, source: str) -> str:
    lines = [f"invalid settings in {source}:"]
    for error in exc.errors():
        field = ".".join(str(part) for part in error["loc"]) or "(top level)"
        message = error["msg"].removeprefix("Value error, ")
        lines.append(f"  {field}: {message}")
    return "\n".join(lines)
