"""The server's Prometheus metrics, under vLLM's names, so that dashboards and alerts written for ``vllm serve``
read minifer's ``/metrics`` unchanged.

Two kinds, as their sources differ:

- the engine's state and its running totals (requests running / waiting, KV-cache usage, prefix-cache queries
  and hits, preemptions, speculative drafts and accepted tokens, prompt and generation tokens) are read when
  Prometheus scrapes, on the engine thread between two steps (``EngineLoop.stats``): nothing is added to a
  step, and no other thread reads structures a step is changing;
- latencies (time to first token, inter-token latency, end-to-end latency, and a request's time queued, in
  prefill, in decode, running) and sizes (prompt and generated tokens, ``n``, ``max_tokens``, tokens per step) are
  histograms observed by the engine thread as tokens come and requests finish, since a scrape would only see the
  latest value. As in vLLM v1, which runs the ``n`` completions of a request as ``n`` child requests, each
  completion counts as a request of its own (its finish reason, its latencies); only ``n`` counts per request.

Every metric carries vLLM's labels ``model_name`` and ``engine`` (always ``"0"``: one engine per server);
``vllm:cache_config_info`` is a gauge at 1 whose labels are the engine's ``CacheConfig``.

Each server has its own ``CollectorRegistry`` (several servers can live in one process, as in the tests), with
prometheus_client's ``process_*``, ``python_info`` and ``python_gc_*`` collectors that its default registry has.
Units follow vLLM: seconds, and the prefix cache counted in tokens (minifer's block manager counts blocks; one
block holds ``block_size`` tokens). ``vllm:kv_cache_usage_perc`` is the fraction (0-1) of KV blocks not free.
"""

from __future__ import annotations

from typing import Any

from dataclasses import asdict

from prometheus_client import (
    GC_COLLECTOR,
    PLATFORM_COLLECTOR,
    PROCESS_COLLECTOR,
    CollectorRegistry,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

# vLLM's buckets (vllm/v1/metrics/loggers.py)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)
ITERATION_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
FINISH_REASONS = ("stop", "length", "abort")
LABELS = ["model_name", "engine"]
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class ServerMetrics:
    """The metrics of one server of ``model_name``. ``attach(loop)`` names the engine loop whose state a scrape
    reads; ``token_step`` and ``completion_finished`` are called by that loop; ``render()`` is the scrape."""

    def __init__(self, model_name: str, max_model_len: int = 2048) -> None:
        disable_created_metrics()  # as vLLM's server does: no "_created" series beside every histogram
        self.model_name = model_name
        self.registry = CollectorRegistry(auto_describe=True)
        for collector in (PROCESS_COLLECTOR, PLATFORM_COLLECTOR, GC_COLLECTOR):  # process-wide: shared
            self.registry.register(collector)

        def histogram(name: str, doc: str, buckets) -> Histogram:
            return Histogram(f"vllm:{name}", doc, LABELS, buckets=buckets, registry=self.registry).labels(
                model_name, "0")

        sizes = tuple(m * 10**e for e in range(len(str(max_model_len))) for m in (1, 2, 5)
                      if m * 10**e <= max_model_len)  # vLLM's 1-2-5 buckets up to max_model_len
        self.ttft = histogram("time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                             ITL_BUCKETS)
        self.e2e, self.queue, self.prefill, self.decode, self.inference = (histogram(
            f"{name}_seconds", doc, E2E_BUCKETS) for name, doc in (
            ("e2e_request_latency", "Histogram of e2e request latency in seconds."),
            ("request_queue_time", "Histogram of time spent in WAITING phase for request."),
            ("request_prefill_time", "Histogram of time spent in PREFILL phase for request."),
            ("request_decode_time", "Histogram of time spent in DECODE phase for request."),
            ("request_inference_time", "Histogram of time spent in RUNNING phase for request.")))
        self.prompt_tokens = histogram("request_prompt_tokens", "Number of prefill tokens processed.", sizes)
        self.generation_tokens = histogram("request_generation_tokens", "Number of generation tokens processed.",
                                           sizes)
        self.max_tokens = histogram("request_params_max_tokens", "Histogram of the max_tokens request parameter.",
                                    sizes)
        self.n = histogram("request_params_n", "Histogram of the n request parameter.", (1, 2, 5, 10, 20))
        self.iteration_tokens = histogram("iteration_tokens_total", "Histogram of number of tokens per engine_step.",
                                          ITERATION_BUCKETS)
        self.finished = dict.fromkeys(FINISH_REASONS, 0)
        self.cache_info: dict[str, str] = {}
        self._loop = None
        self._last: dict[str, Any] = {}  # the last state read, served if the engine loop has stopped
        self.registry.register(_EngineCollector(self))

    def attach(self, loop) -> None:
        self._loop = loop
        engine = loop.engine
        self.cache_info = {k: str(v) for k, v in {**asdict(engine.cache_config),
                                                  "num_gpu_blocks": engine.kv_cache_manager.num_blocks}.items()}

    # called on the engine thread
    def token_step(self, seconds: float, first: bool) -> None:
        (self.ttft if first else self.itl).observe(seconds)

    def completion_finished(self, seq, reason: str | None, now: float, arrival: float) -> None:
        """One completion (a ``Request``) ended: ``reason`` ("abort" if its client left), ``arrival`` when its HTTP
        request came. A phase it never reached counts 0 s, as in vLLM."""
        m = seq.metrics
        scheduled = m.first_scheduled_time or now
        first = m.first_token_time or scheduled
        last = m.token_times[-1] if m.token_times else first
        self.finished[reason if reason in self.finished else "stop"] += 1
        for histogram, value in ((self.e2e, now - arrival), (self.queue, scheduled - m.arrival_time),
                                 (self.prefill, first - scheduled), (self.decode, last - first),
                                 (self.inference, last - scheduled), (self.prompt_tokens, len(seq.prompt_token_ids)),
                                 (self.generation_tokens, len(seq.output_token_ids)),
                                 (self.max_tokens, seq.max_tokens)):
            histogram.observe(max(value, 0))

    # the scrape
    def state(self) -> dict[str, Any]:
        if self._loop is not None:
            try:
                self._last = self._loop.stats()
            except Exception:  # noqa: BLE001 - a stopped loop: its last state still describes what it did
                pass
        return self._last

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _EngineCollector:
    """The engine's gauges and counters, read at scrape time (``ServerMetrics.state``)."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self.metrics = metrics

    def describe(self):  # no scrape at registration (auto_describe would otherwise call collect)
        return []

    def collect(self):
        m = self.metrics
        s = m.state()
        name = [m.model_name, "0"]

        def gauge(metric: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(metric, doc, labels=LABELS)
            g.add_metric(name, value)
            return g

        def counter(metric: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(metric, doc, labels=LABELS)
            c.add_metric(name, value)
            return c

        total = s.get("kv_blocks_total", 0)
        block = s.get("block_size", 1)
        yield gauge("vllm:num_requests_running", "Number of requests in model execution batches.",
                    s.get("num_running", 0))
        yield gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
                    s.get("num_waiting", 0))
        yield gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
                    1 - s.get("kv_blocks_free", 0) / total if total else 0.0)
        yield counter("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.",
                      s.get("prefix_cache_queries_blocks", 0) * block)
        yield counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
                      s.get("prefix_cache_hits_blocks", 0) * block)
        yield counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.",
                      s.get("num_preemptions", 0))
        yield counter("vllm:prompt_tokens", "Number of prefill tokens processed.", s.get("prompt_tokens", 0))
        yield counter("vllm:generation_tokens", "Number of generation tokens processed.",
                      s.get("generation_tokens", 0))
        success = CounterMetricFamily("vllm:request_success", "Count of successfully processed requests.",
                                      labels=[*LABELS, "finished_reason"])
        for reason, count in m.finished.items():
            success.add_metric([*name, reason], count)
        yield success
        info = GaugeMetricFamily("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
                                 labels=[*m.cache_info, "engine"])
        info.add_metric([*m.cache_info.values(), "0"], 1)
        yield info
        if "spec_num_proposed" in s:
            yield counter("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.", s["spec_num_drafts"])
            yield counter("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.", s["spec_num_proposed"])
            yield counter("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.",
                          s["spec_num_accepted"])


__all__ = ["CONTENT_TYPE", "ServerMetrics"]
