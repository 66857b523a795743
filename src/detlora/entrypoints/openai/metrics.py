"""``GET /metrics``: Prometheus metrics of one server (its own registry, not the global one).

Counters of HTTP requests by route and status, prompt and output tokens, finished requests
by reason and adapter loads; histograms of time to first token and inter-token latency (per
request, measured where the front end receives the engine's tokens) and of the engine's step
times (measured in the engine process); gauges of running and
waiting sequences and of KV-cache use, from the engine's latest step.
"""

from __future__ import annotations

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from detlora.audit.writer import LATENCY_BUCKETS, AuditStats
from detlora.engine.async_llm import AsyncLLM, RequestStream

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
                    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)

_STEP_BUCKETS = (0.001, 0.002, 0.003, 0.004, 0.005, 0.006, 0.008, 0.01, 0.015, 0.02, 0.03, 0.05,
                 0.1, 0.25, 0.5, 1.0, 2.5)


class _EngineIdle(Collector):
    """``detlora:engine_idle_seconds``: a counter read at scrape time, the wait going on
    included."""

    def __init__(self, llm: AsyncLLM) -> None:
        self.llm = llm

    def collect(self) -> list[CounterMetricFamily]:
        return [CounterMetricFamily(
            "detlora:engine_idle_seconds", "Time the engine process waited with no request "
            "to run (under load: the clients or the front end, not the engine, were the "
            "limit)", value=self.llm.engine_idle_seconds())]


class _AuditLog(Collector):
    """The audit log writer's counters, read at scrape time: lines and bytes written, lines
    dropped (a full queue; must stay 0), entries waiting, and the time from a request's end
    to its line being written."""

    def __init__(self, stats: AuditStats) -> None:
        self.stats = stats

    def collect(self) -> list:
        s = self.stats
        buckets, total = [], 0
        for bound, count in zip((*LATENCY_BUCKETS, float("inf")), s.latency_counts,
                                strict=True):
            total += count
            buckets.append((str(bound) if bound != float("inf") else "+Inf", total))
        return [
            CounterMetricFamily("detlora:audit_lines_written", "Audit log lines written",
                                value=s.lines_written),
            CounterMetricFamily("detlora:audit_bytes_written", "Audit log bytes written",
                                value=s.bytes_written),
            CounterMetricFamily("detlora:audit_lines_dropped", "Audit log lines dropped (the "
                                "writer's queue was full, or a line could not be written)",
                                value=s.lines_dropped),
            GaugeMetricFamily("detlora:audit_files", "Audit log files opened", value=s.files),
            HistogramMetricFamily("detlora:audit_write_seconds", "From a request's end to its "
                                  "audit log line being written", buckets=buckets,
                                  sum_value=s.latency_sum),
        ]


class ServerMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self, llm: AsyncLLM, model_name: str, audit: AuditStats | None = None) -> None:
        self.llm = llm
        r = self.registry = CollectorRegistry()
        if audit is not None:
            r.register(_AuditLog(audit))
        labels = {"model_name": model_name}
        self.http_requests = Counter("detlora:http_requests", "HTTP requests by route and status",
                                     ["route", "status"], registry=r)
        self.prompt_tokens = Counter("detlora:prompt_tokens", "Prompt tokens of admitted "
                                     "requests", registry=r)
        self.generation_tokens = Counter("detlora:generation_tokens", "Output tokens generated",
                                         registry=r)
        self.finished = Counter("detlora:request_finished", "Sequences finished, by reason",
                                ["finished_reason"], registry=r)
        self.ttft = Histogram("detlora:time_to_first_token_seconds", "Time to first token",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.admission = Histogram("detlora:request_admission_seconds", "From a request's "
                                   "arrival at the front end to the engine process taking it "
                                   "(the rest of the time to first token is the engine's)",
                                   buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("detlora:inter_token_latency_seconds", "Time between tokens",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.step = Histogram("detlora:engine_step_seconds", "Wall time of each engine step "
                              "in the engine process (schedule, launch, read the tokens): "
                              "its sum over a span of time is how busy the engine was",
                              buckets=_STEP_BUCKETS, registry=r)
        self.send = Histogram("detlora:engine_output_send_seconds", "Time the engine process "
                              "took to hand each step's outputs to the front end (long when "
                              "the front end reads them late and the pipe is full)",
                              buckets=_STEP_BUCKETS, registry=r)
        self.dispatch_delay = Histogram("detlora:frontend_step_delay_seconds", "From the "
                                        "engine process sending a step's outputs to the front "
                                        "end's event loop handling them (long when the loop "
                                        "is busy)",
                                        buckets=_STEP_BUCKETS, registry=r)
        # Labelled children by their labels: ``labels()`` looks them up under a lock per call.
        self._finished_by_reason: dict[str, Counter] = {}
        self._responses: dict[tuple[str, int], Counter] = {}
        r.register(_EngineIdle(llm))
        self.running = Gauge("detlora:num_requests_running", "Sequences running", registry=r)
        self.waiting = Gauge("detlora:num_requests_waiting", "Sequences waiting", registry=r)
        self.kv_usage = Gauge("detlora:kv_cache_usage_perc", "Fraction of KV pages in use "
                              "(1 = full)", registry=r)
        self.kv_free = Gauge("detlora:kv_cache_free_blocks", "KV pages free (cached pages "
                             "nobody uses count as free)", registry=r)
        self.adapter_loads = Gauge("detlora:lora_adapter_loads", "Adapters read from disk so "
                                   "far", registry=r)
        self.lora = Gauge("detlora:lora_events", "Adapter traffic so far, by counter: GPU slot "
                          "and host-cache hits and misses, disk loads, swaps (prefetched "
                          "ones too), evictions; *_seconds are summed times", ["counter"],
                          registry=r)
        self.preemptions = Gauge("detlora:num_preemptions", "Sequences preempted so far",
                                 registry=r)
        self.aborted = Gauge("detlora:num_aborted_requests", "Unfinished sequences aborted so "
                             "far (clients gone, streams left)", registry=r)
        self.info = Gauge("detlora:engine_info", "The engine's fingerprint and level",
                          ["model_name", "fingerprint", "determinism"], registry=r)
        self.info.labels(**labels, fingerprint=llm.info.base_fingerprint,
                         determinism=llm.info.determinism).set(1)
        llm.on_delta = self.on_delta
        llm.on_step = self.step.observe
        llm.on_send = self.send.observe
        llm.on_dispatch_delay = self.dispatch_delay.observe

    def on_delta(self, stream: RequestStream, num_tokens: int) -> None:
        """Called for every delta the engine sends (on the event loop)."""
        self.generation_tokens.inc(num_tokens)
        times = stream.times
        if times.first_token is not None and not times.first_token_reported:
            times.first_token_reported = True
            self.ttft.observe(times.first_token - times.arrival)
            if times.accepted is not None:
                self.admission.observe(times.accepted - times.arrival)
        for gap in times.inter_token:
            self.itl.observe(gap)
        times.inter_token.clear()

    def observe_finish(self, reason: str) -> None:
        counter = self._finished_by_reason.get(reason)
        if counter is None:
            counter = self._finished_by_reason[reason] = self.finished.labels(
                finished_reason=reason)
        counter.inc()

    def count_response(self, route: str, status: int) -> None:
        """One more HTTP response of ``route`` with ``status``."""
        counter = self._responses.get((route, status))
        if counter is None:
            counter = self._responses[route, status] = self.http_requests.labels(
                route=route, status=str(status))
        counter.inc()

    def render(self) -> bytes:
        stats = self.llm.stats
        if stats is not None:
            self.running.set(stats.num_running)
            self.waiting.set(stats.num_waiting)
            self.kv_free.set(stats.num_free_blocks)
            self.kv_usage.set(1.0 - stats.num_free_blocks / max(1, stats.num_kv_blocks))
            self.adapter_loads.set(stats.adapter_loads)
            self.preemptions.set(stats.num_preemptions)
            self.aborted.set(stats.num_aborted)
            for name, value in stats.lora.items():
                self.lora.labels(counter=name).set(value)
        return generate_latest(self.registry)


__all__ = ["ServerMetrics"]
