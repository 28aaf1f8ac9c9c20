"""SGLang's Prometheus metrics (`sglang:` names and labels), or vLLM's (`vllm:`, `--engine vllm`), on an
injectable registry.

    metrics = SimMetrics(CollectorRegistry(), live, model_name="moonshotai/Kimi-K2.5")
    metrics = SimMetrics(CollectorRegistry(), live, model_name="meta-llama/...", engine="vllm", num_spec_steps=3)
    generate_latest(metrics.registry)

vLLM (0.32, vllm/v1/metrics/loggers.py and v1/spec_decode/metrics.py): the scheduler gauges
`vllm:num_requests_running` / `vllm:num_requests_waiting` and `vllm:kv_cache_usage_perc`, labels `model_name` and
`engine` (one per DP rank); the speculative counters `vllm:spec_decode_num_drafts_total`,
`vllm:spec_decode_num_draft_tokens_total` and `vllm:spec_decode_num_accepted_tokens_total` (accepted drafts,
without the bonus token each verify adds).

Scheduler gauges are computed at scrape time from the engine (labels model_name, engine_type, tp_rank,
pp_rank, moe_ep_rank); request histograms and counters are observed by the HTTP layer in real seconds
(label model_name), as SGLang's tokenizer manager does. Extra labels (`--extra-metric-labels`) go on all.
The stand-in's own account of itself (no SGLang counterpart) is named `crossover_sim_*`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from crossover.gateway.engines import DEFAULT_ENGINE, EngineName
from crossover.servers.sim.live import LiveEngine

# SGLang's buckets (srt/metrics/collector.py), seconds.
TTFT_BUCKETS = (0.1, 0.2, 0.4, 0.6, 0.8, 1.0, 2.0, 4.0, 6.0, 8.0, 10.0, 20.0, 40.0, 60.0, 80.0, 100.0, 200.0, 400.0)
ITL_BUCKETS = (
    0.002, 0.004, 0.006, 0.008, 0.01, 0.015, 0.02, 0.025, 0.03, 0.035, 0.04,
    0.06, 0.08, 0.1, 0.2, 0.4, 0.6, 0.8, 1.0, 2.0, 4.0, 6.0, 8.0
)  # fmt: skip
E2E_BUCKETS = (
    0.1, 0.2, 0.4, 0.6, 0.8, 1.0, 2.0, 4.0, 6.0, 8.0, 10.0,
    20.0, 40.0, 60.0, 80.0, 100.0, 200.0, 400.0, 600.0, 1200.0, 1800.0, 2400.0
)  # fmt: skip
QUEUE_BUCKETS = (
    0.0, 0.1, 0.2, 0.5, 1.0, 2.0, 3.0, 4.0, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 70.0, 80.0, 90.0,
    100.0, 200.0, 300.0, 400.0, 500.0, 600.0, 700.0, 800.0, 900.0, 1000.0, 1200.0, 1400.0, 1600.0, 1800.0, 2000.0,
    2500.0
)  # fmt: skip


SGLANG_NAMES = {
    "ttft": "sglang:time_to_first_token_seconds",
    "itl": "sglang:inter_token_latency_seconds",
    "e2e": "sglang:e2e_request_latency_seconds",
    "queue": "sglang:queue_time_seconds",
    "prompt": "sglang:prompt_tokens_total",
    "generation": "sglang:generation_tokens_total",
    "requests": "sglang:num_requests_total",
    "aborted": "sglang:num_aborted_requests_total",
}
VLLM_NAMES = {
    "ttft": "vllm:time_to_first_token_seconds",
    "itl": "vllm:inter_token_latency_seconds",
    "e2e": "vllm:e2e_request_latency_seconds",
    "queue": "vllm:request_queue_time_seconds",
    "prompt": "vllm:prompt_tokens_total",
    "generation": "vllm:generation_tokens_total",
    "requests": "vllm:request_success_total",
    # vLLM counts aborts as a finished_reason of request_success; the stand-in keeps its own count.
    "aborted": "crossover_sim_aborted_requests_total",
}


class SimMetrics:
    def __init__(
        self,
        registry: CollectorRegistry,
        live: LiveEngine,
        *,
        model_name: str,
        extra_labels: dict[str, str] | None = None,
        num_spec_steps: int = 0,
        engine: EngineName = DEFAULT_ENGINE,
    ):
        self.registry = registry
        dialect = DIALECTS[engine]
        labels = {"model_name": model_name, **dialect.labels, **(extra_labels or {})}
        names = list(labels)
        name = dialect.names.__getitem__

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, names, buckets=buckets, registry=registry).labels(**labels)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, names, registry=registry).labels(**labels)

        self.ttft = histogram(name("ttft"), "Histogram of time to first token in seconds.", TTFT_BUCKETS)
        self.itl = histogram(name("itl"), "Histogram of inter-token latency in seconds.", ITL_BUCKETS)
        self.e2e = histogram(name("e2e"), "Histogram of End-to-end request latency in seconds", E2E_BUCKETS)
        self.queue_time = histogram(name("queue"), "Histogram of queueing time in seconds.", QUEUE_BUCKETS)
        self.prompt_tokens = counter(name("prompt"), "Number of prefill tokens processed.")
        self.generation_tokens = counter(name("generation"), "Number of generation tokens processed.")
        self.requests = counter(name("requests"), "Number of requests processed.")
        self.aborted = counter(name("aborted"), "Number of requests aborted.")
        registry.register(dialect.gauges(live, labels, extra_labels or {}, num_spec_steps))
        registry.register(_StandInMetrics(live, labels))

    def observe_chunk(self, interval_s: float, tokens: int) -> None:
        """A chunk of `tokens` tokens after `interval_s`: each token gets the per-token share (as SGLang)."""
        per_token = interval_s / tokens
        for _ in range(tokens):
            self.itl.observe(per_token)

    def observe_finished(self, *, prompt_tokens: int, completion_tokens: int, e2e_s: float) -> None:
        self.e2e.observe(e2e_s)
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(completion_tokens)
        self.requests.inc()


class _VllmGauges(Collector):
    """vLLM's scheduler gauges and speculative counters, computed at scrape time from the engine."""

    def __init__(self, live: LiveEngine, labels: dict[str, str], num_spec_steps: int):
        self._live, self._names, self._values, self._steps = live, list(labels), list(labels.values()), num_spec_steps

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        engine = self._live.engine
        gauges = {
            "num_requests_running": ("Number of requests in model execution batches.", engine.num_running),
            "num_requests_waiting": ("Number of requests waiting to be processed.", engine.num_waiting),
            "kv_cache_usage_perc": (
                "KV-cache usage. 1 means 100 percent usage.",
                engine.num_used_tokens / engine.limits.max_total_num_tokens,
            ),
        }
        for key, (doc, value) in gauges.items():
            family = GaugeMetricFamily(f"vllm:{key}", doc, labels=self._names)
            family.add_metric(self._values, float(value))
            yield family
        if not self._steps:
            return
        drafts = engine.spec_verify_total
        counters = {
            "spec_decode_num_drafts": ("Number of spec decoding drafts.", drafts),
            "spec_decode_num_draft_tokens": ("Number of draft tokens.", drafts * self._steps),
            # Each verify yields the accepted drafts plus one token of the target's own.
            "spec_decode_num_accepted_tokens": ("Number of accepted tokens.", engine.spec_accepted_total - drafts),
        }
        for key, (doc, value) in counters.items():
            family = CounterMetricFamily(f"vllm:{key}", doc, labels=self._names)
            family.add_metric(self._values, float(value))
            yield family


class _SchedulerGauges(Collector):
    def __init__(self, live: LiveEngine, labels: dict[str, str], num_spec_steps: int):
        self._live, self._labels, self._steps = live, labels, num_spec_steps

    @classmethod
    def of(cls, live: LiveEngine, labels: dict[str, str], extra: dict[str, str], num_spec_steps: int) -> Collector:
        """SGLang's gauges carry the scheduler's labels, not the request metrics' (`labels`)."""
        ranks = {"engine_type": "unified", "tp_rank": "0", "pp_rank": "0", "moe_ep_rank": "0"}
        return cls(live, {"model_name": labels["model_name"], **ranks, **extra}, num_spec_steps)

    def collect(self) -> Iterator[GaugeMetricFamily]:
        engine = self._live.engine
        pool = engine.limits.max_total_num_tokens
        accept = engine.window_accept_length
        values = {
            "num_running_reqs": ("The number of running requests.", engine.num_running),
            "num_queue_reqs": ("The number of requests in the waiting queue.", engine.num_waiting),
            "num_used_tokens": ("The number of used tokens.", engine.num_used_tokens),
            "token_usage": ("The token usage.", engine.num_used_tokens / pool),
            "max_total_num_tokens": ("Maximum total number of tokens in the KV cache pool.", pool),
            "gen_throughput": ("The generation throughput (token/s).", self._live.gen_throughput()),
            "cache_hit_rate": ("The prefix cache hit rate (the stand-in has no prefix cache).", 0.0),
            "spec_accept_length": ("The average acceptance length of speculative decoding.", accept),
            "spec_accept_rate": (
                "The average acceptance rate of speculative decoding.",
                (accept - 1) / self._steps if self._steps and accept else 0.0,
            ),
            "spec_num_steps": (
                "The number of speculative decoding steps (0 while the run-time gate holds the batch).",
                0 if engine.gated(engine.num_running) else self._steps,
            ),
            "spec_adaptive_zero_steps_above_bs": (
                "Live gate: batches above this many running requests run 0 draft steps (-1: no gate).",
                -1 if engine.zero_steps_above_bs is None else engine.zero_steps_above_bs,
            ),
        }
        names, label_values = list(self._labels), list(self._labels.values())
        for name, (doc, value) in values.items():
            family = GaugeMetricFamily(f"sglang:{name}", doc, labels=names)
            family.add_metric(label_values, float(value))
            yield family


@dataclass(frozen=True)
class Dialect:
    """How one engine names its metrics: the names of the request metrics, the labels it adds to model_name, and its
    scheduler gauges (live, the request metrics' labels, the extra labels, speculative steps) -> collector."""

    names: dict[str, str]
    labels: dict[str, str]
    gauges: Callable[[LiveEngine, dict[str, str], dict[str, str], int], Collector]


DIALECTS: dict[EngineName, Dialect] = {
    "sglang": Dialect(SGLANG_NAMES, {}, _SchedulerGauges.of),
    # `engine`: vLLM's DP rank; one here.
    "vllm": Dialect(VLLM_NAMES, {"engine": "0"}, lambda live, labels, _, steps: _VllmGauges(live, labels, steps)),
}


class _StandInMetrics(Collector):
    """What the stand-in says about itself, read from the live engine at scrape time."""

    def __init__(self, live: LiveEngine, labels: dict[str, str]):
        self._live, self._names, self._values = live, list(labels), list(labels.values())

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        refused = CounterMetricFamily(
            "crossover_sim_release_refused",
            "Calls of /release_memory_occupation refused because requests were in flight (SGLang would crash).",
            labels=self._names,
        )
        refused.add_metric(self._values, float(self._live.memory_stats.release_refused_total))
        yield refused
        lag = GaugeMetricFamily(
            "crossover_sim_schedule_lag_seconds",
            "How far (wall seconds) the stand-in's step loop is behind its schedule; above 0 for long, its "
            "throughput is below its profile's.",
            labels=self._names,
        )
        lag.add_metric(self._values, self._live.schedule_lag_s())
        yield lag
        ratio = GaugeMetricFamily(
            "crossover_sim_schedule_ratio",
            "Simulated seconds advanced / (wall seconds x time scale) over the stand-in's recent window (its "
            "/server_info schedule.speed_ratio): 1 keeps its schedule; below 0.9 its throughput is this "
            "machine's, not its profile's.",
            labels=self._names,
        )
        ratio.add_metric(self._values, self._live.schedule_ratio())
        yield ratio
