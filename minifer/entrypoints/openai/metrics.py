"""The server's Prometheus metrics, under vLLM's names, so that dashboards and alerts written for ``vllm serve``
read minifer's ``/metrics`` unchanged.

Two kinds, as their sources differ:

- the engine's state and its running totals (requests running / waiting, KV-cache usage, prefix-cache queries
  and hits, preemptions, speculative drafts and accepted tokens, prompt and generation tokens) are read when
  Prometheus scrapes, on the engine thread between two steps (``EngineLoop.stats``): nothing is added to a
  step, and no other thread reads structures a step is changing;
- latencies (time to first token, inter-token latency, end-to-end latency) are histograms observed by the
  engine thread as tokens come and requests finish, since a scrape would only see the latest value.

Each server has its own ``CollectorRegistry`` (several servers can live in one process, as in the tests).
Units follow vLLM: seconds, and the prefix cache counted in tokens (minifer's block manager counts blocks; one
block holds ``block_size`` tokens). ``vllm:kv_cache_usage_perc`` is the fraction (0-1) of KV blocks not free.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import (
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
FINISH_REASONS = ("stop", "length", "abort")
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class ServerMetrics:
    """The metrics of one server of ``model_name``. ``attach(loop)`` names the engine loop whose state a scrape
    reads; ``token_step`` and ``request_finished`` are called by that loop; ``render()`` is the scrape."""

    def __init__(self, model_name: str) -> None:
        disable_created_metrics()  # as vLLM's server does: no "_created" series beside every histogram
        self.model_name = model_name
        self.registry = CollectorRegistry(auto_describe=True)
        labels = {"labelnames": ["model_name"], "registry": self.registry}
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              buckets=TTFT_BUCKETS, **labels).labels(model_name)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                             buckets=ITL_BUCKETS, **labels).labels(model_name)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                             buckets=E2E_BUCKETS, **labels).labels(model_name)
        self.finished = dict.fromkeys(FINISH_REASONS, 0)
        self._loop = None
        self._last: dict[str, Any] = {}  # the last state read, served if the engine loop has stopped
        self.registry.register(_EngineCollector(self))

    def attach(self, loop) -> None:
        self._loop = loop

    # called on the engine thread
    def token_step(self, seconds: float, first: bool) -> None:
        (self.ttft if first else self.itl).observe(seconds)

    def request_finished(self, reason: str | None, route, now: float) -> None:
        self.finished[reason if reason in self.finished else "stop"] += 1
        if route is not None:
            self.e2e.observe(now - route.arrival)

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
        name = [m.model_name]

        def gauge(metric: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(metric, doc, labels=["model_name"])
            g.add_metric(name, value)
            return g

        def counter(metric: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(metric, doc, labels=["model_name"])
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
                                      labels=["model_name", "finished_reason"])
        for reason, count in m.finished.items():
            success.add_metric([*name, reason], count)
        yield success
        if "spec_num_proposed" in s:
            yield counter("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.", s["spec_num_drafts"])
            yield counter("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.", s["spec_num_proposed"])
            yield counter("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.",
                          s["spec_num_accepted"])


__all__ = ["CONTENT_TYPE", "ServerMetrics"]
