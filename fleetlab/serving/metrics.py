"""``/metrics``: the server's figures in Prometheus' text format, with vLLM-style names.

Every app gets its own ``prometheus_client.CollectorRegistry`` (several servers can live in one
process, as in the tests). Two kinds of figures:

- **engine state**, read from ``AsyncLLM.stats()`` at each scrape (a collector, so they are
  never stale): ``fleetlab:num_requests_running``, ``fleetlab:num_requests_waiting``,
  ``fleetlab:kv_cache_usage_perc`` (fraction of KV blocks in use, 0-1, as vLLM's),
  ``fleetlab:prefix_cache_hit_rate`` (0-1), ``fleetlab:num_preemptions_total``,
  ``fleetlab:engine_steps_total``;
- **per request**, observed by the app as requests stream (times as the server saw them, on
  the asyncio side): histograms ``fleetlab:time_to_first_token_seconds``,
  ``fleetlab:time_per_output_token_seconds``, ``fleetlab:e2e_request_latency_seconds``;
  counters ``fleetlab:prompt_tokens_total``, ``fleetlab:generation_tokens_total``,
  ``fleetlab:request_success_total{finished_reason}`` and
  ``fleetlab:request_errors_total{status}`` (requests refused with a 4xx/5xx).

Every series carries a ``model_name`` label.
"""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

CONTENT_TYPE = CONTENT_TYPE_LATEST

# Seconds. The tiny model on a CPU steps every few milliseconds; a large one on a GPU takes longer.
TTFT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0,
                20.0, 40.0, 80.0)
TPOT_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75,
                1.0, 2.5, 5.0)
E2E_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)


class _EngineCollector:
    """Reads ``AsyncLLM.stats()`` when Prometheus scrapes."""

    def __init__(self, engine, model_name: str):
        self.engine, self.model_name = engine, model_name

    def collect(self):
        s = self.engine.stats()
        gauges = (("fleetlab:num_requests_running", "Requests in the running batch.", s["num_requests_running"]),
                  ("fleetlab:num_requests_waiting", "Requests waiting to be scheduled.", s["num_requests_waiting"]),
                  ("fleetlab:kv_cache_usage_perc", "Fraction of KV-cache blocks in use (1 = full).",
                   s["kv_cache_utilization"]),
                  ("fleetlab:prefix_cache_hit_rate", "Prefix-cache hits over queries since start (0-1).",
                   s["prefix_cache_hit_rate"]))
        for name, doc, value in gauges:
            g = GaugeMetricFamily(name, doc, labels=["model_name"])
            g.add_metric([self.model_name], float(value))
            yield g
        for name, doc, key in (("fleetlab:num_preemptions", "Requests preempted since start.", "num_preemptions"),
                               ("fleetlab:engine_steps", "Engine steps run since start.", "num_steps")):
            c = CounterMetricFamily(name, doc, labels=["model_name"])
            c.add_metric([self.model_name], float(s[key]))
            yield c


class ServerMetrics:
    """The metrics of one app (see the module docstring); ``render()`` is the ``/metrics`` body."""

    def __init__(self, engine, model_name: str):
        self.model_name = model_name
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(engine, model_name))
        labels, reg = ["model_name"], self.registry
        self.ttft = Histogram("fleetlab:time_to_first_token_seconds", "Time from arrival to the first token.",
                              labels, buckets=TTFT_BUCKETS, registry=reg).labels(model_name)
        self.tpot = Histogram("fleetlab:time_per_output_token_seconds",
                              "Mean time between output tokens of a finished request (after the first).",
                              labels, buckets=TPOT_BUCKETS, registry=reg).labels(model_name)
        self.e2e = Histogram("fleetlab:e2e_request_latency_seconds", "Time from arrival to the last token.",
                             labels, buckets=E2E_BUCKETS, registry=reg).labels(model_name)
        self.prompt_tokens = Counter("fleetlab:prompt_tokens", "Prompt tokens of accepted requests.",
                                     labels, registry=reg).labels(model_name)
        self.generation_tokens = Counter("fleetlab:generation_tokens", "Output tokens sent.",
                                         labels, registry=reg).labels(model_name)
        self._success = Counter("fleetlab:request_success", "Requests finished, by finish reason.",
                                [*labels, "finished_reason"], registry=reg)
        self._errors = Counter("fleetlab:request_errors", "Requests refused, by HTTP status.",
                               [*labels, "status"], registry=reg)

    def observe_first_token(self, times) -> None:
        """A request's first token arrived (``times``: a ``StreamTimes``)."""
        self.ttft.observe(times.first_token - times.arrival)

    def observe_finished(self, times, num_prompt_tokens: int, num_output_tokens: int, finish_reason: str) -> None:
        """A request ended (``finish_reason``: stop / length / abort / error)."""
        self._success.labels(self.model_name, finish_reason).inc()
        self.prompt_tokens.inc(num_prompt_tokens)
        self.generation_tokens.inc(num_output_tokens)
        if finish_reason in ("stop", "length") and times.last_token is not None:
            self.e2e.observe(times.last_token - times.arrival)
            if num_output_tokens > 1:
                self.tpot.observe((times.last_token - times.first_token) / (num_output_tokens - 1))

    def observe_error(self, status: int) -> None:
        """A request was refused with HTTP ``status``."""
        self._errors.labels(self.model_name, str(int(status))).inc()

    def render(self) -> bytes:
        """The ``/metrics`` body (Prometheus text format)."""
        return generate_latest(self.registry)
