"""Prometheus metrics of one app, in its own registry.

Engine counters arrive as cumulative MetricsSnapshots through the queue and are exposed by a
custom collector that reads the latest one (plus everything dead engine processes had counted,
so a restart does not reset them). Latency histograms and token counts are observed here.

The serving metrics are exported twice: under our `moe_` names and under vLLM v1's `vllm:` names,
labels and buckets, so a vLLM Grafana dashboard and `vllm bench serve`'s spec-decode scrape work
unchanged. Both names are fed by the same observation (one snapshot, one `Twin` call), so they
cannot drift apart. The offload metrics (expert cache, PCIe, prefetch) have no vLLM name.
"""
from __future__ import annotations

import os
import threading
from collections.abc import Iterator, Sequence
from dataclasses import fields, replace

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector

from moe_serve.engine.messages import MetricsSnapshot

FINISH_REASONS = ("stop", "length", "abort", "error")
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1, 2.5, 5)
BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 256)
BATCH_TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
# vLLM v1's buckets (vllm/v1/metrics), not ours: its dashboards' quantiles then read as they do on vLLM
VLLM_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                     20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
VLLM_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                    40.0, 80.0)
VLLM_REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                                120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
VLLM_ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
# vLLM labels every series with the served model and the engine index; there is one engine here
VLLM_LABELS = ("model_name", "engine")
ENGINE_INDEX = "0"
_GAUGE_FIELDS = frozenset({"resident_experts", "num_running", "num_waiting", "tpot_samples", "batch_size_samples",
                           "batch_token_samples", "kv_cache_usage", "expert_format", "expert_bytes"})


def _add(a: MetricsSnapshot, b: MetricsSnapshot) -> MetricsSnapshot:
    """a + b over the cumulative counters (per-layer tuples element-wise); b's gauges."""
    summed = {}
    for f in fields(MetricsSnapshot):
        if f.name in _GAUGE_FIELDS:
            continue
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, tuple):
            width = max(len(x), len(y))
            x, y = x + (0,) * (width - len(x)), y + (0,) * (width - len(y))
            summed[f.name] = tuple(i + j for i, j in zip(x, y))
        else:
            summed[f.name] = x + y
    return replace(b, **summed)


class EngineSnapshotCollector(Collector):
    def __init__(self, served: tuple[str, str]) -> None:
        self._lock = threading.Lock()  # snapshots arrive on the supervisor thread, scrapes on the loop
        self._retired = MetricsSnapshot()  # what engine processes that have died had counted
        self._latest = MetricsSnapshot()
        self._served = served  # values of VLLM_LABELS

    def update(self, snapshot: MetricsSnapshot) -> None:
        with self._lock:
            self._latest = snapshot

    def engine_lost(self) -> None:
        with self._lock:
            self._retired, self._latest = _add(self._retired, self._latest), MetricsSnapshot()

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            s = _add(self._retired, self._latest)
        yield from _moe_families(s)
        yield from _vllm_families(s, self._served)


def _moe_families(s: MetricsSnapshot) -> Iterator[Metric]:
    yield _per_layer("moe_expert_cache_hits", "Routed-expert lookups found in a GPU expert slot.",
                     s.cache_hits_per_layer)
    yield _per_layer("moe_expert_cache_misses", "Routed-expert lookups that needed a host-to-GPU copy.",
                     s.cache_misses_per_layer)
    yield GaugeMetricFamily("moe_expert_cache_resident_experts", "Experts resident in GPU expert slots.",
                            value=s.resident_experts)
    if s.expert_format:
        info = GaugeMetricFamily("moe_expert_format_info", "The routed experts' format (1 on the one in use).",
                                 labels=["format"])
        info.add_metric([s.expert_format], 1)
        yield info
        yield GaugeMetricFamily("moe_expert_bytes", "Bytes of one expert slot: one expert in its format, the largest layer's where layers differ.",
                                value=s.expert_bytes)
    yield _labelled("moe_pcie_bytes", "Expert bytes copied host-to-GPU.", "kind",
                    {"demand": s.pcie_bytes_demand, "prefetch": s.pcie_bytes_prefetch})
    yield CounterMetricFamily("moe_pcie_wait_seconds", "Seconds compute waited on expert copies.",
                              value=s.pcie_wait_seconds)
    yield _labelled("moe_prefetch_experts", "Prefetched experts by whether they were used before eviction.",
                    "outcome", {"used": s.prefetch_used, "wasted": s.prefetch_wasted})
    yield CounterMetricFamily("moe_spec_drafts", "Speculative draft rounds.", value=s.spec_drafts)
    yield CounterMetricFamily("moe_spec_draft_tokens", "Tokens proposed by the draft.",
                              value=s.spec_draft_tokens)
    yield CounterMetricFamily("moe_spec_accepted_tokens", "Draft tokens accepted by verification.",
                              value=s.spec_accepted_tokens)
    yield CounterMetricFamily("moe_spec_verify_steps", "Target verify passes (prefill excluded).",
                              value=s.spec_verify_steps)
    yield _labelled("moe_spec_accepted_at_position", "Draft tokens kept, by position in the draft (0 = first).",
                    "position", {str(i): v for i, v in enumerate(s.spec_accepted_at_position)})
    yield _per_layer("moe_spec_needed_experts", "Experts verify passes routed to.", s.spec_needed_per_layer)
    yield _per_layer("moe_spec_predicted_experts",
                     "Experts verify passes routed to that the draft-phase predictor had predicted.",
                     s.spec_predicted_needed_per_layer)
    yield _labelled("moe_spec_phase_seconds", "Wall seconds of the draft and verify phases.", "phase",
                    {"draft": s.spec_draft_seconds, "verify": s.spec_verify_seconds})
    yield CounterMetricFamily("moe_cpu_expert_computations", "Expert computations run on the CPU.",
                              value=s.cpu_expert_computations)
    yield GaugeMetricFamily("moe_num_requests_running", "Engine requests being decoded.", value=s.num_running)
    yield GaugeMetricFamily("moe_num_requests_waiting", "Engine requests queued in the engine.",
                            value=s.num_waiting)
    yield CounterMetricFamily("moe_preemptions", "Sequences whose KV blocks were freed, to be recomputed later.",
                              value=s.preemptions)
    yield GaugeMetricFamily("moe_kv_cache_usage_ratio", "Share of the paged KV cache's blocks in use.",
                            value=s.kv_cache_usage)


def _vllm_families(s: MetricsSnapshot, served: tuple[str, str]) -> Iterator[Metric]:
    """vLLM's names for the engine-side serving series of _moe_families (same snapshot, same values)."""
    yield _vllm("vllm:num_requests_running", GaugeMetricFamily, "Requests in the engine's running batch.",
                served, s.num_running)
    yield _vllm("vllm:num_requests_waiting", GaugeMetricFamily, "Requests queued in the engine.", served,
                s.num_waiting)
    yield _vllm("vllm:kv_cache_usage_perc", GaugeMetricFamily, "Share of KV-cache blocks in use (1 = all).",
                served, s.kv_cache_usage)
    yield _vllm("vllm:num_preemptions", CounterMetricFamily, "Sequences preempted (KV freed, recomputed later).",
                served, s.preemptions)
    yield _vllm("vllm:spec_decode_num_drafts", CounterMetricFamily, "Draft phases that proposed tokens.", served,
                s.spec_drafts)
    yield _vllm("vllm:spec_decode_num_draft_tokens", CounterMetricFamily, "Tokens proposed by the draft.", served,
                s.spec_draft_tokens)
    yield _vllm("vllm:spec_decode_num_accepted_tokens", CounterMetricFamily, "Draft tokens the target accepted.",
                served, s.spec_accepted_tokens)
    per_position = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                       "Draft tokens accepted, by position in the draft (0 = first).",
                                       labels=[*VLLM_LABELS, "position"])
    for position, accepted in enumerate(s.spec_accepted_at_position):
        per_position.add_metric([*served, str(position)], accepted)
    yield per_position


def _vllm(name: str, kind: type[GaugeMetricFamily | CounterMetricFamily], doc: str,
          served: tuple[str, str], value: float) -> Metric:
    family = kind(name, doc, labels=VLLM_LABELS)
    family.add_metric(served, value)
    return family


def _per_layer(name: str, doc: str, values: tuple[int, ...]) -> CounterMetricFamily:
    return _labelled(name, doc, "layer", {str(layer): v for layer, v in enumerate(values)})


def _labelled(name: str, doc: str, label: str, values: dict[str, float]) -> CounterMetricFamily:
    family = CounterMetricFamily(name, doc, labels=[label])
    for key, value in values.items():
        family.add_metric([key], value)
    return family


class Twin:
    """One observation recorded under our moe_ name and its vLLM names, so the exports cannot disagree."""

    def __init__(self, ours: MetricWrapperBase, *theirs: MetricWrapperBase) -> None:
        self._metrics = (ours, *theirs)

    def observe(self, value: float) -> None:
        for metric in self._metrics:
            metric.observe(value)

    def inc(self, amount: float = 1) -> None:
        for metric in self._metrics:
            metric.inc(amount)


class ServerMetrics:
    def __init__(self, served_model_name: str) -> None:
        self.registry = CollectorRegistry()
        served = self._served = (served_model_name, ENGINE_INDEX)
        self.engine = EngineSnapshotCollector(served)
        self.registry.register(self.engine)
        self._exposed = self.registry
        if "PROMETHEUS_MULTIPROC_DIR" in os.environ:
            # --api-server-count > 1: this process' histograms and counters are its share, kept in files that
            # MultiProcessCollector adds up over every API server; every one of them has the whole engine view
            self._exposed = CollectorRegistry()
            MultiProcessCollector(self._exposed)
            self._exposed.register(self.engine)
        itl = ("Time between two output tokens of a request (engine step time / tokens it produced).",
               VLLM_ITL_BUCKETS)
        self.tpot = Twin(Histogram("moe_time_per_output_token_seconds", "Decode time per output token (engine).",
                                   buckets=TPOT_BUCKETS, registry=self.registry),
                         self._vllm_histogram("vllm:inter_token_latency_seconds", *itl),
                         self._vllm_histogram("vllm:time_per_output_token_seconds", *itl))  # vLLM's older name
        self.ttft = Twin(Histogram("moe_time_to_first_token_seconds", "Request arrival to first token, at the server.",
                                   buckets=LATENCY_BUCKETS, registry=self.registry),
                         self._vllm_histogram("vllm:time_to_first_token_seconds", "Request arrival to first token.",
                                              VLLM_TTFT_BUCKETS))
        self.e2e = Twin(Histogram("moe_e2e_request_latency_seconds", "Request arrival to its last token.",
                                  buckets=LATENCY_BUCKETS, registry=self.registry),
                        self._vllm_histogram("vllm:e2e_request_latency_seconds", "Request arrival to its last token.",
                                             VLLM_REQUEST_LATENCY_BUCKETS))
        self.prompt_tokens = Twin(Counter("moe_prompt_tokens", "Prompt tokens sent to the engine (n>1 counts n times).",
                                          registry=self.registry),
                                  self._vllm_counter("vllm:prompt_tokens", "Prompt tokens sent to the engine."))
        self.generation_tokens = Twin(Counter("moe_generation_tokens", "Tokens generated for clients.",
                                              registry=self.registry),
                                      self._vllm_counter("vllm:generation_tokens", "Tokens generated for clients."))
        ours = Counter("moe_requests", "Finished choices by finish reason.", ["finish_reason"], registry=self.registry)
        theirs = Counter("vllm:request_success", "Finished requests (choices) by finish reason.",
                         [*VLLM_LABELS, "finished_reason"], registry=self.registry)
        self.requests = {reason: Twin(ours.labels(reason), theirs.labels(*served, reason)) for reason in FINISH_REASONS}
        self.batch_size = Histogram("moe_batch_size", "Sequences in one engine step.", buckets=BATCH_SIZE_BUCKETS,
                                    registry=self.registry)
        self.batch_tokens = Twin(Histogram("moe_batch_tokens", "Tokens fed in one engine step (decodes and prefill "
                                           "chunks).", buckets=BATCH_TOKEN_BUCKETS, registry=self.registry),
                                 self._vllm_histogram("vllm:iteration_tokens_total", "Tokens fed in one engine step.",
                                                      VLLM_ITERATION_TOKENS_BUCKETS))

    def _vllm_histogram(self, name: str, doc: str, buckets: Sequence[float]) -> Histogram:
        return Histogram(name, doc, VLLM_LABELS, buckets=buckets, registry=self.registry).labels(*self._served)

    def _vllm_counter(self, name: str, doc: str) -> Counter:
        return Counter(name, doc, VLLM_LABELS, registry=self.registry).labels(*self._served)

    def on_snapshot(self, snapshot: MetricsSnapshot) -> None:
        self.engine.update(snapshot)
        for seconds in snapshot.tpot_samples:
            self.tpot.observe(seconds)
        for size in snapshot.batch_size_samples:
            self.batch_size.observe(size)
        for tokens in snapshot.batch_token_samples:
            self.batch_tokens.observe(tokens)

    def render(self) -> bytes:
        return generate_latest(self._exposed)
