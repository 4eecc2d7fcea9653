"""``/metrics``: the server's figures in Prometheus' text format, with vLLM's names and meanings.

Every app gets its own ``prometheus_client.CollectorRegistry`` (several servers can live in one
process, as in the tests). Each name is vLLM's with ``fleetlab:`` for ``vllm:``, and means what
vLLM's means, except where marked *fleetlab's*. Every series carries a ``model_name`` label.

**Engine state**, read from ``AsyncLLM.stats()`` at each scrape (so never stale):

- gauges ``num_requests_running``, ``num_requests_waiting``, ``kv_cache_usage_perc`` (fraction of
  KV blocks in use, 0-1), ``prefix_cache_hit_rate`` (*fleetlab's*: hits over queries since start);
- counters ``num_preemptions``, ``prefix_cache_queries`` and ``prefix_cache_hits`` (in tokens: the
  prompt tokens looked up, and those found cached), ``engine_steps`` (*fleetlab's*);
- ``cache_config_info``: a gauge always 1 whose labels are the KV cache's settings;
- ``iteration_tokens_total``: a histogram of the tokens each engine step ran;
- with speculative decoding, counters ``spec_decode_num_drafts`` (verify rows),
  ``spec_decode_num_draft_tokens``, ``spec_decode_num_accepted_tokens`` and
  ``spec_decode_num_accepted_tokens_per_pos{position}`` (drafts accepted at position 0, 1...).

**Per request**, observed by the app from the request's :class:`~fleetlab.serving.async_llm.StreamTimes`
(engine-thread stamps, like vLLM's engine-core timestamps; ``arrival`` is when the server queued it):

- ``time_to_first_token_seconds``: arrival to the end of the step that gave the first token;
- ``inter_token_latency_seconds``: every gap between two steps that gave a request tokens;
- histograms of requests that finished (``stop`` or ``length``): ``e2e_request_latency_seconds``
  (arrival to last token), ``request_queue_time_seconds`` (queued to first scheduled),
  ``request_prefill_time_seconds`` (first scheduled to first token), ``request_decode_time_seconds``
  (first to last token), ``request_inference_time_seconds`` (first scheduled to last token),
  ``request_time_per_output_token_seconds`` (the request's mean gap), ``request_prompt_tokens``
  and ``request_generation_tokens``;
- histograms ``request_params_n`` and ``request_params_max_tokens``: each prompt's ``n`` and
  ``max_tokens`` (observed when it is queued);
- counters ``prompt_tokens``, ``generation_tokens``, ``request_success{finished_reason}`` (every
  request that ended, ``abort`` included) and ``request_errors{status}`` (*fleetlab's*: requests
  the API refused with a 4xx/5xx; an unknown path is not counted).

prometheus_client adds a ``*_created`` sample to every counter and histogram; vLLM's ``/metrics``
has none, and neither has this one (:class:`_WithoutCreated`).
"""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

CONTENT_TYPE = CONTENT_TYPE_LATEST

# Seconds. The tiny model on a CPU steps every few milliseconds; a large one on a GPU takes longer.
TTFT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0,
                20.0, 40.0, 80.0)
ITL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75,
               1.0, 2.5, 5.0)
REQUEST_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)


def one_two_five_buckets(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50... up to ``max_value`` (vLLM's buckets for token counts)."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_value:
                return out
            out.append(m * scale)
        scale *= 10


class _EngineCollector:
    """Reads ``AsyncLLM.stats()`` when Prometheus scrapes."""

    def __init__(self, engine, model_name: str):
        self.engine, self.model_name = engine, model_name
        cfg = engine.llm.config
        stats = engine.stats()
        self.cache_config = {"block_size": str(cfg.block_size), "num_blocks": str(stats["num_blocks"]),
                             "enable_prefix_caching": str(cfg.enable_prefix_caching),
                             "prefix_cache": str(cfg.prefix_cache), "bytes_per_block": str(stats["kv_bytes_per_block"])}

    def collect(self):
        s = self.engine.stats()
        for name, doc, value in (
                ("num_requests_running", "Requests in the running batch.", s["num_requests_running"]),
                ("num_requests_waiting", "Requests waiting to be scheduled.", s["num_requests_waiting"]),
                ("kv_cache_usage_perc", "Fraction of KV-cache blocks in use (1 = full).", s["kv_cache_utilization"]),
                ("prefix_cache_hit_rate", "Prefix-cache hits over queries since start (0-1).",
                 s["prefix_cache_hit_rate"])):
            yield self._family(GaugeMetricFamily, name, doc, value)
        for name, doc, value in (
                ("num_preemptions", "Requests preempted since start.", s["num_preemptions"]),
                ("prefix_cache_queries", "Prefix-cache queries, in prompt tokens looked up.",
                 s["prefix_cache_query_tokens"]),
                ("prefix_cache_hits", "Prefix-cache hits, in tokens found cached.", s["prefix_cache_hit_tokens"]),
                ("engine_steps", "Engine steps run since start.", s["num_steps"])):
            yield self._family(CounterMetricFamily, name, doc, value)
        info = GaugeMetricFamily("fleetlab:cache_config_info", "The KV cache's settings (labels); always 1.",
                                 labels=["model_name", *self.cache_config])
        info.add_metric([self.model_name, *self.cache_config.values()], 1.0)
        yield info
        yield self._iteration_tokens(s["iteration_tokens"])
        if "spec_num_drafts" in s:
            yield from self._spec_decode(s)

    def _iteration_tokens(self, h: dict) -> HistogramMetricFamily:
        family = HistogramMetricFamily("fleetlab:iteration_tokens_total", "Tokens an engine step ran.",
                                       labels=["model_name"])
        cumulative, running = [], 0
        for bound, count in zip([*(str(float(b)) for b in h["bounds"]), "+Inf"], h["counts"]):
            running += count
            cumulative.append((bound, running))
        family.add_metric([self.model_name], cumulative, h["sum"])
        return family

    def _spec_decode(self, s: dict):
        for name, doc, value in (
                ("spec_decode_num_drafts", "Verify rows (a request's drafts checked in a step).", s["spec_num_drafts"]),
                ("spec_decode_num_draft_tokens", "Draft tokens verified.", s["num_draft_tokens"]),
                ("spec_decode_num_accepted_tokens", "Draft tokens accepted.", s["num_accepted_tokens"])):
            yield self._family(CounterMetricFamily, name, doc, value)
        family = CounterMetricFamily("fleetlab:spec_decode_num_accepted_tokens_per_pos",
                                     "Draft tokens accepted at each position.", labels=["model_name", "position"])
        for position, value in enumerate(s["spec_accepted_per_position"]):
            family.add_metric([self.model_name, str(position)], float(value))
        yield family

    def _family(self, cls, name: str, doc: str, value):
        family = cls(f"fleetlab:{name}", doc, labels=["model_name"])
        family.add_metric([self.model_name], float(value))
        return family


class _WithoutCreated:
    """A registry's families without prometheus_client's ``*_created`` samples."""

    def __init__(self, registry: CollectorRegistry):
        self.registry = registry

    def collect(self):
        for family in self.registry.collect():
            family.samples = [s for s in family.samples if not s.name.endswith("_created")]
            yield family


class ServerMetrics:
    """The metrics of one app (see the module docstring); ``render()`` is the ``/metrics`` body."""

    def __init__(self, engine, model_name: str):
        self.model_name = model_name
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(engine, model_name))
        lengths = one_two_five_buckets(engine.max_model_len)

        def histogram(name, doc, buckets):
            return Histogram(f"fleetlab:{name}", doc, ["model_name"], buckets=buckets,
                             registry=self.registry).labels(model_name)

        def counter(name, doc):
            return Counter(f"fleetlab:{name}", doc, ["model_name"], registry=self.registry).labels(model_name)

        self.ttft = histogram("time_to_first_token_seconds", "Time from arrival to the first token.", TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Time between two steps that gave a request tokens.",
                             ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Time from arrival to the last token.", REQUEST_BUCKETS)
        self.queue = histogram("request_queue_time_seconds", "Time waiting before first scheduled.", REQUEST_BUCKETS)
        self.prefill = histogram("request_prefill_time_seconds", "Time from first scheduled to the first token.",
                                 REQUEST_BUCKETS)
        self.decode = histogram("request_decode_time_seconds", "Time from the first to the last token.",
                                REQUEST_BUCKETS)
        self.inference = histogram("request_inference_time_seconds", "Time from first scheduled to the last token.",
                                   REQUEST_BUCKETS)
        self.tpot = histogram("request_time_per_output_token_seconds", "A request's mean time between tokens.",
                              ITL_BUCKETS)
        self.prompt_lengths = histogram("request_prompt_tokens", "Prompt tokens of a finished request.", lengths)
        self.generation_lengths = histogram("request_generation_tokens", "Output tokens of a finished request.",
                                            lengths)
        self.params_n = histogram("request_params_n", "The n of each prompt queued.", (1, 2, 5, 10, 20))
        self.params_max_tokens = histogram("request_params_max_tokens", "The max_tokens of each prompt queued.",
                                           lengths)
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of requests that ended.")
        self.generation_tokens = counter("generation_tokens", "Output tokens sent.")
        self._success = Counter("fleetlab:request_success", "Requests ended, by finish reason.",
                                ["model_name", "finished_reason"], registry=self.registry)
        self._errors = Counter("fleetlab:request_errors", "Requests refused, by HTTP status.",
                               ["model_name", "status"], registry=self.registry)

    def observe_params(self, n: int, max_tokens: int) -> None:
        """A prompt was queued with these ``n`` and ``max_tokens``."""
        self.params_n.observe(n)
        self.params_max_tokens.observe(max_tokens)

    def observe_first_token(self, times) -> None:
        """A request's first token arrived (``times``: a ``StreamTimes``)."""
        self.ttft.observe(times.first_token - times.arrival)

    def observe_token_gaps(self, times, num_observed: int) -> int:
        """Observe the inter-token gaps a request gained after its first ``num_observed`` (called
        as each step's tokens are sent, as vLLM observes them per step); returns how many it has."""
        for gap in times.token_gaps[num_observed:]:
            self.itl.observe(gap)
        return len(times.token_gaps)

    def observe_finished(self, times, num_prompt_tokens: int, num_output_tokens: int, finish_reason: str) -> None:
        """A request ended (``finish_reason``: stop / length / abort / error); its inter-token gaps
        were observed as they came (:meth:`observe_token_gaps`)."""
        self._success.labels(self.model_name, finish_reason).inc()
        self.prompt_tokens.inc(num_prompt_tokens)
        self.generation_tokens.inc(num_output_tokens)
        if finish_reason not in ("stop", "length") or times.last_token is None or times.scheduled is None:
            return
        self.e2e.observe(times.last_token - times.arrival)
        self.queue.observe(times.scheduled - times.queued)
        self.prefill.observe(times.first_token - times.scheduled)
        self.decode.observe(times.last_token - times.first_token)
        self.inference.observe(times.last_token - times.scheduled)
        if num_output_tokens > 1:
            self.tpot.observe((times.last_token - times.first_token) / (num_output_tokens - 1))
        self.prompt_lengths.observe(num_prompt_tokens)
        self.generation_lengths.observe(num_output_tokens)

    def observe_error(self, status: int) -> None:
        """A request was refused with HTTP ``status``."""
        self._errors.labels(self.model_name, str(int(status))).inc()

    def render(self) -> bytes:
        """The ``/metrics`` body (Prometheus text format)."""
        return generate_latest(_WithoutCreated(self.registry))
