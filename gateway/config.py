"""Gateway settings: one TOML file plus `CROSSOVER_...` environment variables (nested with `__`).

    settings = load_settings(Path("crossover.toml"))    # env overrides the file
    settings = Settings(pools={"speculative": {"backends": [...]}, "plain": {"backends": [...]}})

Every default is named here; `gateway/example.toml` documents each field.
"""

from __future__ import annotations

import contextlib
import json
import os
import tomllib
from pathlib import Path
from typing import Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from crossover.gateway.cli import LogLevel
from crossover.gateway.engines import DEFAULT_ENGINE, TOKEN_ENV, EngineName
from crossover.gateway.modes import MODES as POOL_NAMES
from crossover.gateway.modes import PLAIN, SPECULATIVE, Mode
from crossover.gateway.policies import (
    DEFAULT_ADVANTAGE,
    DEFAULT_MIN_DWELL_S,
    DEFAULT_PRIOR_PHASE_S,
    DEFAULT_WINDOW_S,
    AdaptiveLimits,
    BenchTable,
    PolicySettings,
    SwitchCost,
    Switcher,
    TableError,
    ThresholdRates,
    Tier,
)
from crossover.gateway.policies import PolicyName as Policy

# Re-exported: the rest of the gateway reads the words from here or from modes.py, never types them again.
__all__ = ["PLAIN", "POOL_NAMES", "SPECULATIVE", "Mode"]

LoadSignal = Literal["local", "scraped", "max"]
TopologyName = Literal["partitioned", "time-shared", "in-engine"]
Mechanism = Literal["restart", "sleep", "manual"]

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000
DEFAULT_POLICY: Policy = "spillover"
DEFAULT_THRESHOLD = 32
DEFAULT_HYSTERESIS = 4
# `service_tier: "priority"` requests go to the speculative pool while its load is below this many requests per
# speculative server, whatever the threshold. The gateway does not know the servers' running cap
# (SGLang's --max-running-requests, which depends on memory): set it to that; the default is twice the default
# threshold, a cap a speculative server usually has room for.
DEFAULT_PRIORITY_HEADROOM = 2 * DEFAULT_THRESHOLD
# Spillover: the share of the requests in flight the speculative pool also takes above the threshold (its own
# capacity at high load; gateway/policies/route.py). 0: the threshold alone, as before the share existed.
DEFAULT_SPILLOVER_SHARE = 0.0
# A crossover is a concurrency: anything beyond this is a typo, and it must stay an exact float for /metrics.
MAX_THRESHOLD = 1_000_000
# `crossover serve --workers N`: processes serving one port as one gateway.
MAX_WORKERS = 256
# A worker whose event loop has not turned for this long is killed and replaced (gunicorn's --timeout). The floor:
# a loop beats every 50 ms, and a busy one can miss a few hundred ms of beats; less would kill healthy workers.
DEFAULT_WORKER_TIMEOUT_S = 30.0
MIN_WORKER_TIMEOUT_S = 1.0

DEFAULT_CONNECT_TIMEOUT_S = 5.0
# Until a stream's first event: a request queued in the engine waits here too.
DEFAULT_FIRST_BYTE_TIMEOUT_S = 300.0
# A non-streaming answer arrives whole when generation ends: at ~7 tok/s per request (the reference
# deployment at full load) a 4,096-token answer takes ~10 min and a long reasoning answer more, so by default
# only `total` bounds it (None).
DEFAULT_NON_STREAM_TIMEOUT_S: float | None = None
DEFAULT_BETWEEN_CHUNKS_TIMEOUT_S = 60.0
DEFAULT_TOTAL_TIMEOUT_S = 3600.0
DEFAULT_QUEUE_TIMEOUT_S = 30.0
# A client that takes none of its response (no byte acknowledged) this long: then the stream is the client's loss.
DEFAULT_CLIENT_WRITE_TIMEOUT_S = 60.0
# A request head (and a body) must arrive within these: a connection that trickles holds memory and a slot.
DEFAULT_REQUEST_HEAD_TIMEOUT_S = 10.0
DEFAULT_REQUEST_BODY_TIMEOUT_S = 30.0
# On SIGTERM /health answers 503 this long before the gateway stops accepting, so load balancers notice first.
DEFAULT_SHUTDOWN_DELAY_S = 5.0
# Below uvicorn's (and so SGLang's) 5 s idle close, so we never reuse a connection the backend is closing.
DEFAULT_BACKEND_KEEPALIVE_S = 2.0
# Above the 5 s keep-alive of common client pools (httpx, the OpenAI SDK) for the same reason, mirrored.
DEFAULT_CLIENT_KEEPALIVE_S = 65.0
DEFAULT_GRACEFUL_SHUTDOWN_S = 30.0

DEFAULT_MAX_BODY_BYTES = 16 * 1024 * 1024
# Request line and headers together; nginx's large_client_header_buffers allow 4 x 8 KiB.
DEFAULT_MAX_HEAD_BYTES = 64 * 1024
DEFAULT_MAX_INFLIGHT = 1024
DEFAULT_MAX_QUEUED = 1024
DEFAULT_MAX_FAILOVERS = 2

DEFAULT_HEALTH_PATH = "/health"
DEFAULT_HEALTH_INTERVAL_S = 5.0
# SGLang's /health runs a one-token generation and answers after at least a second.
DEFAULT_HEALTH_TIMEOUT_S = 5.0
DEFAULT_FAILURE_THRESHOLD = 3
DEFAULT_EJECT_S = 30.0
# Passive signals (failed requests) may eject at most this share of a pool, and never its last healthy backend;
# beyond it only a failed probe ejects (Envoy's max_ejection_percent).
DEFAULT_MAX_EJECTION_PERCENT = 50
DEFAULT_LOAD_INTERVAL_S = 1.0

DEFAULT_TOPOLOGY: TopologyName = "partitioned"
# Time-shared switching ([switching]). Restart figures are the reference model's (Kimi-K2.5: minutes to load).
DEFAULT_MECHANISM: Mechanism = "sleep"
DEFAULT_INITIAL_MODE: Mode = "speculative"
DEFAULT_SWITCH_INTERVAL_S = 1.0
DEFAULT_DWELL_S = DEFAULT_MIN_DWELL_S
DEFAULT_DRAIN_DEADLINE_S = 30.0
DEFAULT_SWITCH_QUEUE_MAX = 1024
DEFAULT_SWITCH_QUEUE_TIMEOUT_S = 600.0
DEFAULT_SWITCH_TIMEOUT_S = 900.0
DEFAULT_CONTROL_TIMEOUT_S = 120.0
DEFAULT_VERIFY_TIMEOUT_S = 60.0
# What a switch costs (seconds without service) until one has been measured.
DEFAULT_RESTART_COST_S = 300.0
DEFAULT_SLEEP_COST_S = 30.0
DEFAULT_MANUAL_COST_S = 0.0
INITIAL_COSTS_S = {"restart": DEFAULT_RESTART_COST_S, "sleep": DEFAULT_SLEEP_COST_S, "manual": DEFAULT_MANUAL_COST_S}
DEFAULT_AGENT_TOKEN_ENV = TOKEN_ENV
# Self-healing: the serving mode with no usable backend for this many health intervals is recovered.
DEFAULT_DEAD_AFTER_PROBES = 3
# Failed switch attempts are spaced by a capped exponential backoff.
DEFAULT_BACKOFF_S = 5.0
DEFAULT_BACKOFF_MAX_S = 300.0
# An operator's PUT /admin/mode at most this often (a script in a loop must not thrash the GPU set).
DEFAULT_OPERATOR_INTERVAL_S = 10.0
# [adaptive]: the threshold follows the live acceptance in bounded, explained steps (gateway/policies/adaptive.py).
DEFAULT_ADAPTIVE_WINDOW_S = 30.0
DEFAULT_ADAPTIVE_MAX_STEP = 4
DEFAULT_ADAPTIVE_MIN = 1
DEFAULT_ADAPTIVE_MAX = 256
DEFAULT_ADAPTIVE_DEADBAND = 1
# A change of acceptance this large (tokens per step) since the last decision decides at once, not at the window's end.
DEFAULT_ADAPTIVE_REACT = 0.2
# Explore: the switchback's arms sit this far either side of the adaptive threshold.
DEFAULT_ADAPTIVE_EXPLORE_DELTA = 4
# A window's move may reach the next bench level toward the target where that is farther than max_step (0: off).
DEFAULT_ADAPTIVE_MAX_LEVELS = 1
# How often the controller looks at the acceptance between windows (seconds; the load scrape's order).
ADAPTIVE_LOOK_S = 1.0


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def read_key_file(path: Path, what: str) -> str:
    """A key kept in a file (so it is not on a command line); ValueError, naming `what`, when there is none."""
    try:
        key = path.read_text().strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"{what} {path} cannot be read: {exc}") from None
    if not key:
        raise ValueError(f"{what} {path} is empty")
    return key


def check_token(token: str, what: str, *, empty_ok: bool) -> str:
    """A bearer token as HTTP can carry it: a header value loses surrounding whitespace on the way, so a token
    that is blank or has any would never match, and nothing could authenticate."""
    if not token and empty_ok:
        return token
    if not token.strip():
        raise ValueError(f"{what} is blank, which nothing can match" if token else f"{what} must not be empty")
    if token != token.strip():
        raise ValueError(f"{what} has leading or trailing whitespace, which no Authorization header can carry")
    return token


class PoolSettings(_Section):
    backends: list[str] = Field(min_length=1)
    # What its servers run (gateway/engines/adapters.py): where load is read, how a time-shared server sleeps and wakes.
    engine: EngineName = DEFAULT_ENGINE
    # The pool's SGLang --api-key: sent on every call the gateway makes to these backends, in place of the client's.
    api_key: str = ""
    # Its SGLang --admin-api-key (vLLM patched: VLLM_SPECULATION_GATE_ADMIN_KEY), for control calls only (the
    # speculation gate, release, resume); generation keeps api_key. Empty: control calls send api_key (SGLang's admin
    # endpoints take it when it has no admin key). Or read from admin_api_key_file (one line; the key stays off the
    # command line and out of the TOML).
    admin_api_key: str = ""
    admin_api_key_file: Path | None = None

    @model_validator(mode="before")
    @classmethod
    def _read_admin_key(cls, data: object) -> object:
        if not isinstance(data, dict) or data.get("admin_api_key_file") in (None, ""):
            return data
        if data.get("admin_api_key"):
            raise ValueError("give admin_api_key or admin_api_key_file, not both")
        return {**data, "admin_api_key": read_key_file(Path(data["admin_api_key_file"]), "admin_api_key_file")}

    @property
    def control_key(self) -> str | None:
        """The bearer token for control calls."""
        return self.admin_api_key or self.api_key or None

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
            if parts.username is not None or parts.password is not None:
                # Never sent (the backend key goes as a bearer token) and the URL is public: /metrics labels it.
                raise ValueError(
                    f"{parts.scheme}://...@{parts.hostname}: a backend URL takes no credentials; set the pool's "
                    "api_key (sent as 'Authorization: Bearer') instead"
                )
            try:
                port = parts.port  # None when not given
            except ValueError:  # not a number, or past 65535
                port = 0
            if port == 0 or (port is None and ":" in parts.netloc.rpartition("@")[2].rpartition("]")[2]):
                raise ValueError(f"{url!r}: the port must be a number from 1 to 65535")
            cleaned.append(url.rstrip("/"))
        return cleaned

    @field_validator("api_key")
    @classmethod
    def _api_key(cls, key: str) -> str:
        return check_token(key, "api_key", empty_ok=True)

    @field_validator("admin_api_key")
    @classmethod
    def _admin_api_key(cls, key: str) -> str:
        return check_token(key, "admin_api_key", empty_ok=True)


class PoolsSettings(_Section):
    speculative: PoolSettings
    # Absent only in topology 'in-engine' (one pool of patched speculative servers; Settings checks).
    plain: PoolSettings | None = None

    # One server in both pools is allowed (benchmarks, a single-GPU trial); each pool counts its own requests.
    @model_validator(mode="after")
    def _no_repeats(self) -> PoolsSettings:
        for name in POOL_NAMES:
            backends = getattr(self, name).backends if getattr(self, name) is not None else []
            if len(set(backends)) != len(backends):
                raise ValueError(f"pool {name!r} lists a backend twice")
        return self


class TimeoutSettings(_Section):
    connect: float = Field(DEFAULT_CONNECT_TIMEOUT_S, gt=0)
    first_byte: float = Field(DEFAULT_FIRST_BYTE_TIMEOUT_S, gt=0)
    non_stream: float | None = Field(DEFAULT_NON_STREAM_TIMEOUT_S, gt=0)
    between_chunks: float = Field(DEFAULT_BETWEEN_CHUNKS_TIMEOUT_S, gt=0)
    total: float = Field(DEFAULT_TOTAL_TIMEOUT_S, gt=0)
    queue: float = Field(DEFAULT_QUEUE_TIMEOUT_S, gt=0)
    client_write: float = Field(DEFAULT_CLIENT_WRITE_TIMEOUT_S, gt=0)
    request_head: float = Field(DEFAULT_REQUEST_HEAD_TIMEOUT_S, gt=0)
    request_body: float = Field(DEFAULT_REQUEST_BODY_TIMEOUT_S, gt=0)
    shutdown_delay: float = Field(DEFAULT_SHUTDOWN_DELAY_S, ge=0)
    backend_keepalive: float = Field(DEFAULT_BACKEND_KEEPALIVE_S, ge=0)
    client_keepalive: float = Field(DEFAULT_CLIENT_KEEPALIVE_S, gt=0)
    graceful_shutdown: float = Field(DEFAULT_GRACEFUL_SHUTDOWN_S, ge=0)


class LimitSettings(_Section):
    max_body_bytes: int = Field(DEFAULT_MAX_BODY_BYTES, gt=0)
    max_head_bytes: int = Field(DEFAULT_MAX_HEAD_BYTES, ge=1024)
    max_inflight: int = Field(DEFAULT_MAX_INFLIGHT, gt=0)
    max_queued: int = Field(DEFAULT_MAX_QUEUED, ge=0)
    max_failovers: int = Field(DEFAULT_MAX_FAILOVERS, ge=0)


class HealthSettings(_Section):
    path: str = DEFAULT_HEALTH_PATH
    interval: float = Field(DEFAULT_HEALTH_INTERVAL_S, gt=0)
    timeout: float = Field(DEFAULT_HEALTH_TIMEOUT_S, gt=0)
    failure_threshold: int = Field(DEFAULT_FAILURE_THRESHOLD, ge=1)
    eject_seconds: float = Field(DEFAULT_EJECT_S, ge=0)
    max_ejection_percent: int = Field(DEFAULT_MAX_EJECTION_PERCENT, ge=0, le=100)
    load_interval: float = Field(DEFAULT_LOAD_INTERVAL_S, gt=0)

    @field_validator("path")
    @classmethod
    def _path(cls, path: str) -> str:
        if not path.startswith("/"):
            raise ValueError(f"{path!r} must start with '/'")
        return path


class _SwitchRun(_Section):
    """What [switching] says about when a switch is decided and how it drains: read by the switch controller and,
    through SwitchSettings, by the replay."""

    mechanism: Mechanism = DEFAULT_MECHANISM
    initial_mode: Mode = DEFAULT_INITIAL_MODE
    interval: float = Field(DEFAULT_SWITCH_INTERVAL_S, gt=0)
    dwell: float = Field(DEFAULT_DWELL_S, ge=0)
    window: float = Field(DEFAULT_WINDOW_S, gt=0)
    drain_deadline: float = Field(DEFAULT_DRAIN_DEADLINE_S, ge=0)
    # A fixed expected phase length; 0: learned from the load's phases, starting from prior_phase.
    expected_phase: float = Field(0.0, ge=0)
    prior_phase: float = Field(DEFAULT_PRIOR_PHASE_S, gt=0)
    advantage: float = Field(DEFAULT_ADVANTAGE, gt=0)


class SwitchingSettings(_SwitchRun):
    """How a time-shared GPU set moves between its two modes (`topology = "time-shared"`)."""

    queue_max: int = Field(DEFAULT_SWITCH_QUEUE_MAX, ge=0)
    queue_timeout: float = Field(DEFAULT_SWITCH_QUEUE_TIMEOUT_S, gt=0)
    switch_timeout: float = Field(DEFAULT_SWITCH_TIMEOUT_S, gt=0)
    control_timeout: float = Field(DEFAULT_CONTROL_TIMEOUT_S, gt=0)
    verify_timeout: float = Field(DEFAULT_VERIFY_TIMEOUT_S, gt=0)
    # Seconds a switch costs before one has been measured; left out: the mechanism's prior (INITIAL_COSTS_S).
    initial_cost: float = Field(DEFAULT_SLEEP_COST_S, ge=0)
    agent_url: str = ""
    agent_token: str = ""
    agent_servers: dict[Mode, str] = {}
    dead_after_probes: int = Field(DEFAULT_DEAD_AFTER_PROBES, ge=1)
    backoff: float = Field(DEFAULT_BACKOFF_S, gt=0)
    backoff_max: float = Field(DEFAULT_BACKOFF_MAX_S, gt=0)
    operator_interval: float = Field(DEFAULT_OPERATOR_INTERVAL_S, ge=0)

    @field_validator("agent_url")
    @classmethod
    def _agent_url(cls, url: str) -> str:
        if not url:
            return url
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname or parts.path.strip("/"):
            raise ValueError(f"{url!r} is not an agent URL like http://10.0.0.5:9000 (scheme, host, port, no path)")
        return url.rstrip("/")

    @model_validator(mode="after")
    def _timeouts_fit(self) -> SwitchingSettings:
        if "initial_cost" not in self.model_fields_set:
            object.__setattr__(self, "initial_cost", INITIAL_COSTS_S[self.mechanism])
        if self.queue_timeout < self.interval:
            raise ValueError(
                f"queue_timeout ({self.queue_timeout:g} s) must be at least interval ({self.interval:g} s)"
            )
        return self


def fit_hysteresis(threshold: int, hysteresis: int) -> int:
    """The largest band up to `hysteresis` that fits under `threshold` (for when no hysteresis was asked for)."""
    return min(hysteresis, max(threshold - 1, 0))


# A lease longer than this keeps a dead leader's GPU set unattended too long; a sync rarer than this, stale counts.
MAX_LEASE_S = 300.0
MAX_SYNC_INTERVAL_S = 60.0
MIN_CLUSTER_KEY_CHARS = 32


class ClusterSettings(_Section):
    """Several gateway replicas (hosts) acting as one: the live state, the in-flight counts and the lease that lets
    one replica act on a GPU set, kept in Redis. Empty `redis_url`: this gateway is the whole cluster."""

    redis_url: str = ""
    # The Redis key prefix: every replica in front of the same pools (one GPU set) names the same cluster.
    name: str = Field("crossover", min_length=1, pattern=r"^[A-Za-z0-9_.:-]+$")
    # Seconds a leader's lease lasts unless renewed (at every sync); a leader gone longer is replaced.
    lease: float = Field(5.0, gt=0, le=MAX_LEASE_S, allow_inf_nan=False)
    # Seconds between reads of the shared state and publications of this replica's in-flight counts.
    sync_interval: float = Field(0.25, gt=0, le=MAX_SYNC_INTERVAL_S, allow_inf_nan=False)
    # A secret every replica shares (one line, at least MIN_CLUSTER_KEY_CHARS characters; group-readable at most):
    # the control state and in-flight counts in Redis carry its HMAC, so write access to Redis alone moves nothing.
    key_file: Path | None = None
    key: str = Field("", repr=False)

    @model_validator(mode="before")
    @classmethod
    def _read_key(cls, data: object) -> object:
        if not isinstance(data, dict) or data.get("key_file") in (None, ""):
            return data
        if data.get("key"):
            raise ValueError("give key or key_file, not both")
        path = Path(data["key_file"])
        with contextlib.suppress(OSError):
            if path.stat().st_mode & 0o007:
                raise ValueError(f"key_file {path} is open to every user of the host: run `chmod 600 {path}`")
        return {**data, "key": read_key_file(path, "key_file")}

    @field_validator("key")
    @classmethod
    def _long_enough(cls, key: str) -> str:
        if key and len(key) < MIN_CLUSTER_KEY_CHARS:
            raise ValueError(
                f"the cluster's key has {len(key)} characters; use at least {MIN_CLUSTER_KEY_CHARS} "
                "(`openssl rand -hex 32`)"
            )
        return key

    @field_validator("redis_url")
    @classmethod
    def _a_url_the_client_takes(cls, url: str) -> str:
        """What the Redis client would refuse at start (a scheme, a query argument it has no such option for) is
        refused here, in the settings' words. Without the client installed, start-up says what to install."""
        if not url:
            return url
        try:
            from redis.asyncio import Redis
        except ImportError:
            return url
        try:
            Redis.from_url(url).connection_pool.make_connection()  # no socket yet: only its options are checked
        except (TypeError, ValueError) as exc:
            raise ValueError(f"not a Redis URL the client takes: {exc}") from None
        return url

    @model_validator(mode="after")
    def _renewed_well_before_it_lapses(self) -> ClusterSettings:
        if self.sync_interval > self.lease / 3:
            raise ValueError(
                f"sync_interval ({self.sync_interval:g} s) renews the lease: it must be at most lease / 3 "
                f"({self.lease / 3:g} s), or the lease lapses between renewals and the leader changes"
            )
        return self


class AdaptiveSettings(_Section):
    """`[adaptive]`: every `window` seconds the threshold moves toward the crossover predicted at the speculative
    backends' live acceptance from a bench table, at most `max_step` or one bench level (`max_levels`), within
    [min, max], holding within `deadband`;
    at once (a look every ADAPTIVE_LOOK_S) when the acceptance moved by `react` or more since the last decision."""

    enabled: bool = False
    # A `crossover bench` rate-table.json (or its results.json): both pools' throughput by concurrency, the acceptance
    # the engine reported during each level. None: the controller holds.
    table: Path | None = None
    # The accept length the engine reported during that bench, where the file does not record it.
    bench_accept_length: float | None = Field(None, ge=1, allow_inf_nan=False)
    window: float = Field(DEFAULT_ADAPTIVE_WINDOW_S, gt=0, allow_inf_nan=False)
    max_step: int = Field(DEFAULT_ADAPTIVE_MAX_STEP, ge=1, le=MAX_THRESHOLD)
    min: int = Field(DEFAULT_ADAPTIVE_MIN, ge=0, le=MAX_THRESHOLD)
    max: int = Field(DEFAULT_ADAPTIVE_MAX, ge=0, le=MAX_THRESHOLD)
    deadband: int = Field(DEFAULT_ADAPTIVE_DEADBAND, ge=0, le=MAX_THRESHOLD)
    max_levels: int = Field(DEFAULT_ADAPTIVE_MAX_LEVELS, ge=0, le=64)
    react: float = Field(DEFAULT_ADAPTIVE_REACT, gt=0, allow_inf_nan=False)
    # The live rate table corrects the model per level (false: the bench table alone predicts).
    correct: bool = True
    # Check itself (partitioned only): windows alternate at threshold + and - explore_delta; realized against
    # predicted tok/s in /admin/state; it holds where they disagree beyond the prediction's interval.
    explore: bool = False
    explore_delta: int = Field(DEFAULT_ADAPTIVE_EXPLORE_DELTA, ge=1, le=MAX_THRESHOLD)

    @model_validator(mode="after")
    def _bounds_and_table(self) -> AdaptiveSettings:
        if self.min > self.max:
            raise ValueError(f"min ({self.min}) must be at most max ({self.max})")
        if self.table is not None:
            self.bench_table()  # refused at load, in the settings' words, not at the first window
        return self

    def limits(self) -> AdaptiveLimits:
        return AdaptiveLimits(self.max_step, self.min, self.max, self.deadband, self.max_levels)

    def bench_table(self) -> BenchTable | None:
        """The table `table` names (None: none named); ValueError saying what is wrong with the file."""
        if self.table is None:
            return None
        try:
            results = json.loads(self.table.read_text())
        except OSError as exc:
            raise ValueError(f"table {self.table} cannot be read: {exc.strerror or exc}") from None
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(f"table {self.table} is not JSON (a `crossover bench` results.json): {exc}") from None
        try:
            return BenchTable.from_file(results, accept_length=self.bench_accept_length)
        except TableError as exc:
            raise ValueError(f"table {self.table} is not a bench table: {exc}") from None


class ThresholdError(ValueError):
    """A threshold or hysteresis that cannot route; `field` names the one at fault."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


def check_threshold(threshold: int, hysteresis: int) -> None:
    """The hysteresis band sits below the threshold; it must leave room to come back."""
    if not 0 <= threshold <= MAX_THRESHOLD:
        raise ThresholdError("threshold", f"threshold must be between 0 and {MAX_THRESHOLD}, got {threshold}")
    if not 0 <= hysteresis <= MAX_THRESHOLD:
        raise ThresholdError("hysteresis", f"hysteresis must be between 0 and {MAX_THRESHOLD}, got {hysteresis}")
    if hysteresis and hysteresis >= threshold:
        raise ThresholdError("hysteresis", f"hysteresis ({hysteresis}) must be less than threshold ({threshold}), or 0")


class Settings(BaseSettings):
    """Everything `crossover serve` needs; validated once at start."""

    model_config = SettingsConfigDict(env_prefix="CROSSOVER_", env_nested_delimiter="__", extra="forbid")

    host: str = DEFAULT_HOST
    port: int = Field(DEFAULT_PORT, ge=0, le=65535)
    log_level: LogLevel = "info"

    policy: Policy = DEFAULT_POLICY
    threshold: int = Field(DEFAULT_THRESHOLD, ge=0, le=MAX_THRESHOLD)
    hysteresis: int = Field(DEFAULT_HYSTERESIS, ge=0, le=MAX_THRESHOLD)
    priority_headroom: int = Field(DEFAULT_PRIORITY_HEADROOM, ge=0, le=MAX_THRESHOLD)
    spillover_share: float = Field(DEFAULT_SPILLOVER_SHARE, ge=0.0, le=1.0, allow_inf_nan=False)
    load_signal: LoadSignal = "local"
    topology: TopologyName = DEFAULT_TOPOLOGY
    admin_token: str = ""
    # Keys clients must present (`Authorization: Bearer KEY`, as the OpenAI SDK sends api_key); empty: open.
    api_keys: list[str] = []
    # The service tier of a key's requests that name none (`{"sk-batch" = "flex"}`); a request's own tier wins.
    api_key_tiers: dict[str, Tier] = {}
    served_model_names: list[str] = []
    state_file: Path | None = None
    # Processes serving the one port (`crossover serve --workers N`), acting as one gateway.
    workers: int = Field(1, ge=1, le=MAX_WORKERS)
    # Seconds a worker's event loop may stay silent before the supervisor kills and replaces it (workers > 1).
    worker_timeout: float = Field(DEFAULT_WORKER_TIMEOUT_S, ge=MIN_WORKER_TIMEOUT_S, allow_inf_nan=False)

    pools: PoolsSettings
    timeouts: TimeoutSettings = TimeoutSettings()
    limits: LimitSettings = LimitSettings()
    health: HealthSettings = HealthSettings()
    switching: SwitchingSettings = SwitchingSettings()
    cluster: ClusterSettings = ClusterSettings()
    adaptive: AdaptiveSettings = AdaptiveSettings()

    @field_validator("api_keys")
    @classmethod
    def _keys(cls, keys: list[str]) -> list[str]:
        for key in keys:
            check_token(key, "an API key", empty_ok=False)
        return keys

    @model_validator(mode="after")
    def _tiers_of_known_keys(self) -> Settings:
        unknown = [key for key in self.api_key_tiers if key not in self.api_keys]
        if unknown:
            # At most a key's last four characters (of a long one): the message goes to logs.
            named = ", ".join(f"'...{key[-4:] if len(key) > 8 else ''}'" for key in unknown)
            raise ValueError(
                f"api_key_tiers names keys that are not in api_keys ({named}): add them there, or drop them"
            )
        return self

    @field_validator("admin_token")
    @classmethod
    def _admin_token(cls, token: str) -> str:
        return check_token(token, "admin_token", empty_ok=True)

    @model_validator(mode="after")
    def _threshold(self) -> Settings:
        if "hysteresis" not in self.model_fields_set:
            self.hysteresis = fit_hysteresis(self.threshold, self.hysteresis)
        check_threshold(self.threshold, self.hysteresis)
        return self

    @model_validator(mode="after")
    def _explore_partitioned(self) -> Settings:
        if self.adaptive.explore and self.topology != "partitioned":
            raise ValueError(
                f"adaptive.explore runs switchback windows on two pools serving at once: topology 'partitioned' "
                f"only, not '{self.topology}' (set adaptive.explore = false)"
            )
        return self

    @model_validator(mode="after")
    def _pools_of_topology(self) -> Settings:
        if self.topology == "in-engine" and self.pools.plain is not None:
            raise ValueError(
                "topology 'in-engine' has one pool, pools.speculative (patched EAGLE-3 servers whose zero-step gate "
                "is the threshold): remove pools.plain"
            )
        if self.topology != "in-engine" and self.pools.plain is None:
            raise ValueError(f"topology {self.topology!r} needs pools.plain")
        return self

    @model_validator(mode="after")
    def _time_shared(self) -> Settings:
        if self.topology != "time-shared":
            return self
        for name in POOL_NAMES:
            backends = getattr(self.pools, name).backends
            if len(backends) != 1:
                raise ValueError(
                    f"topology 'time-shared' takes exactly one backend per pool (the server of that mode on the "
                    f"shared GPU set); pools.{name} lists {len(backends)}"
                )
        switching = self.switching
        # restart always goes through the agent; sleep does when agent_url is set (the agent then fences it).
        if switching.mechanism == "restart" or (switching.mechanism == "sleep" and switching.agent_url):
            needs = f"switching.mechanism {switching.mechanism!r}" + (" with agent_url" if switching.agent_url else "")
            token = switching.agent_token or os.environ.get(DEFAULT_AGENT_TOKEN_ENV, "")
            missing = [name for name in POOL_NAMES if not switching.agent_servers.get(name)]
            if not switching.agent_url:
                raise ValueError(f"{needs} needs switching.agent_url (the GPU-host agent)")
            if not token:
                raise ValueError(f"{needs} needs switching.agent_token or ${DEFAULT_AGENT_TOKEN_ENV}")
            if missing:
                raise ValueError(
                    f"{needs} needs switching.agent_servers to name the agent's server for each mode; missing: "
                    f"{', '.join(missing)}"
                )
            if switching.agent_servers["speculative"] == switching.agent_servers["plain"]:
                raise ValueError("switching.agent_servers names the same server for both modes")
            self.switching = switching.model_copy(update={"agent_token": token})
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


class SwitchSettings(_SwitchRun):
    """What decides a time-shared GPU set's switches, and when: the gateway's own settings (`threshold`,
    `hysteresis`, [switching]) as its switch controller runs them, and as `crossover sim replay
    --gateway-config FILE` replays them - one set of defaults, one gain rule, one `Switcher`.

        switch = SwitchSettings.of(load_settings(path))
        switcher = switch.switcher()                    # the policy's stepper, its switch cost at the prior
        policy = switch.policy()                         # or .policy(threshold, hysteresis): the live values
    """

    threshold: int = Field(DEFAULT_THRESHOLD, ge=0, le=MAX_THRESHOLD)
    hysteresis: int = Field(DEFAULT_HYSTERESIS, ge=0, le=MAX_THRESHOLD)
    # None: the mechanism's prior (INITIAL_COSTS_S), whichever mechanism runs.
    initial_cost: float | None = Field(None, ge=0)

    @classmethod
    def of(cls, settings: Settings) -> SwitchSettings:
        switching = settings.switching
        given = "initial_cost" in switching.model_fields_set
        return cls(
            threshold=settings.threshold,
            hysteresis=settings.hysteresis,
            **switching.model_dump(include=set(_SwitchRun.model_fields)),
            initial_cost=switching.initial_cost if given else None,
        )

    @model_validator(mode="after")
    def _band(self) -> SwitchSettings:
        check_threshold(self.threshold, self.hysteresis)
        return self

    def prior_s(self, mechanism: Mechanism | None = None) -> float:
        """What a switch by `mechanism` (default: this one) is believed to cost until one is measured."""
        return self.initial_cost if self.initial_cost is not None else INITIAL_COSTS_S[mechanism or self.mechanism]

    def switcher(self, mechanism: Mechanism | None = None) -> Switcher:
        return Switcher(SwitchCost(prior_s=self.prior_s(mechanism)))

    def policy(self, threshold: int | None = None, hysteresis: int | None = None) -> PolicySettings:
        """The policy's inputs; `threshold` and `hysteresis`: the live ones where an operator changed them."""
        threshold = self.threshold if threshold is None else threshold
        return PolicySettings(
            threshold=threshold,
            hysteresis=self.hysteresis if hysteresis is None else hysteresis,
            min_dwell_s=self.dwell,
            window_s=self.window,
            expected_phase_s=self.expected_phase or None,
            prior_phase_s=self.prior_phase,
            rates=ThresholdRates(threshold, self.advantage),
        )


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
        raise SettingsError(describe(exc, source=str(path) if path else "settings", environ=os.environ)) from exc


# What an unknown key most likely is; the stand-in's profile loader says the same (servers/sim/profile_file.py).
UNKNOWN_KEY_HINT = "misspelt, or in the wrong section?"


def describe(exc: ValidationError, source: str, environ: dict[str, str] | None = None) -> str:
    """One line per problem, each blamed where it came from: the file, or a CROSSOVER_* variable that
    overrides it (`environ`: the environment the settings were read from)."""
    upper = {name.upper() for name in environ or {}}
    lines = []
    from_env = False
    for error in exc.errors():
        loc = [str(part) for part in error["loc"]]
        field = ".".join(loc) or "(top level)"
        variable = "CROSSOVER_" + "__".join(loc).upper()
        if loc and variable in upper:
            field, from_env = f"{field} (from ${variable})", True
        if error["type"] == "extra_forbidden":
            message = f"unknown key ({UNKNOWN_KEY_HINT})"
        else:
            message = error["msg"].removeprefix("Value error, ")
        lines.append(f"  {field}: {message}")
    where = f"{source} or the environment" if from_env else source
    return "\n".join([f"invalid settings in {where}:", *lines])
