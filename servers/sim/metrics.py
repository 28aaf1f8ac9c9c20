"""SGLang's Prometheus metrics (`sglang:` names and labels), on an injectable registry.

    metrics = SimMetrics(CollectorRegistry(), live, model_name="moonshotai/Kimi-K2.5")
    generate_latest(metrics.registry)

Scheduler gauges are computed at scrape time from the engine (labels model_name, engine_type, tp_rank,
pp_rank, moe_ep_rank); request histograms and counters are observed by the HTTP layer in real seconds
(label model_name), as SGLang's tokenizer manager does. Extra labels (`--extra-metric-labels`) go on all.
The stand-in's own account of itself (no SGLang counterpart) is named `crossover_sim_*`.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

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


class SimMetrics:
    def __init__(
        self,
        registry: CollectorRegistry,
        live: LiveEngine,
        *,
        model_name: str,
        extra_labels: dict[str, str] | None = None,
        num_spec_steps: int = 0,
    ):
        self.registry = registry
        labels = {"model_name": model_name, **(extra_labels or {})}
        names = list(labels)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, names, buckets=buckets, registry=registry).labels(**labels)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, names, registry=registry).labels(**labels)

        self.ttft = histogram(
            "sglang:time_to_first_token_seconds", "Histogram of time to first token in seconds.", TTFT_BUCKETS
        )
        self.itl = histogram(
            "sglang:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", ITL_BUCKETS
        )
        self.e2e = histogram(
            "sglang:e2e_request_latency_seconds", "Histogram of End-to-end request latency in seconds", E2E_BUCKETS
        )
        self.queue_time = histogram(
            "sglang:queue_time_seconds", "Histogram of queueing time in seconds.", QUEUE_BUCKETS
        )
        self.prompt_tokens = counter("sglang:prompt_tokens_total", "Number of prefill tokens processed.")
        self.generation_tokens = counter("sglang:generation_tokens_total", "Number of generation tokens processed.")
        self.requests = counter("sglang:num_requests_total", "Number of requests processed.")
        self.aborted = counter("sglang:num_aborted_requests_total", "Number of requests aborted.")
        registry.register(
            _SchedulerGauges(
                live,
                {
                    "model_name": model_name,
                    "engine_type": "unified",
                    "tp_rank": "0",
                    "pp_rank": "0",
                    "moe_ep_rank": "0",
                    **(extra_labels or {}),
                },
                num_spec_steps,
            )
        )

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


class _SchedulerGauges(Collector):
    def __init__(self, live: LiveEngine, labels: dict[str, str], num_spec_steps: int):
        self._live, self._labels, self._steps = live, labels, num_spec_steps

    def collect(self) -> Iterator[GaugeMetricFamily]:
        engine = self._live.engine
        pool = engine.limits.max_total_num_tokens
        accept = engine.avg_accept_length
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
