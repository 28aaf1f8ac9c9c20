"""What a run is pointed at and how hard it pushes: plain settings, built once by the CLI and passed in.

Kept free of I/O libraries so `crossover --help` does not pay for importing them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

DEFAULT_CONNECT_TIMEOUT_S = 10.0
# Longest silence within one stream: a request queued behind SGLang's running cap can wait minutes for
# its first token at C=250 on real hardware.
DEFAULT_READ_TIMEOUT_S = 600.0
DEFAULT_REQUEST_TIMEOUT_S = 1800.0  # whole request, first byte to [DONE]
DEFAULT_WARMUP_ROUNDS = 1
DEFAULT_ROUNDS = 3  # default measured requests per level: this many per worker...
# ...and at least this many: a speculative server's accepted-token draws need a sample to average out.
DEFAULT_MIN_REQUESTS = 16


def default_requests(concurrency: int) -> int:
    return max(DEFAULT_ROUNDS * concurrency, DEFAULT_MIN_REQUESTS)


@dataclass(frozen=True)
class Target:
    """A named OpenAI-compatible server; `url` is its base (with or without a trailing /v1)."""

    name: str
    url: str

    @property
    def base_url(self) -> str:
        return self.url.rstrip("/").removesuffix("/v1")

    @property
    def chat_url(self) -> str:
        return f"{self.base_url}/v1/chat/completions"


@dataclass(frozen=True)
class LoadSettings:
    """How hard and how long to push each level."""

    requests: int | None = None  # measured per level; None -> default_requests(C) unless duration_s is set
    duration_s: float | None = None  # measurement window instead of a request count
    warmup_rounds: int = DEFAULT_WARMUP_ROUNDS
    lockstep: bool = False  # every worker starts with a full-length request at the same moment
    request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S
    connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S
    read_timeout_s: float = DEFAULT_READ_TIMEOUT_S
    headers: dict[str, str] = field(default_factory=dict)
    seed: int = 0

    def planned(self, concurrency: int) -> int | None:
        """Measured requests a level waits for; None when it measures for `duration_s` instead."""
        if self.requests is not None:
            return self.requests
        return None if self.duration_s is not None else default_requests(concurrency)
