"""Prometheus metrics of the server, in a registry of its own (served at `/metrics`).

Families (every one labelled with `model`):

| family | type | meaning |
|---|---|---|
| `mstar_requests_running` | gauge | requests admitted into the engine |
| `mstar_requests_waiting` | gauge | requests queued for admission |
| `mstar_requests_finished_total{task, status}` | counter | ended requests; status is completed, aborted (client left), invalid (rejected by the model), error (failed in the engine) or rejected (overload) |
| `mstar_e2e_request_latency_seconds{task}` | histogram | arrival to last output, completed requests |
| `mstar_time_to_first_token_seconds` | histogram | arrival to the first text output |
| `mstar_time_to_first_audio_seconds` | histogram | arrival to the first audio output (TTFA) |
| `mstar_audio_real_time_factor` | histogram | E2E latency / seconds of audio produced (below 1: faster than real time) |
| `mstar_inter_token_latency_seconds` | histogram | gap between consecutive text outputs |
| `mstar_inter_chunk_latency_seconds{modality}` | histogram | gap between consecutive outputs of another modality (audio chunks, frames, actions) |
| `mstar_generated_tokens_total` | counter | text tokens produced |
| `mstar_generated_audio_seconds_total` | counter | seconds of audio produced |
| `mstar_generated_images_total` | counter | images produced |
| `mstar_rank_up{rank}` | gauge | 1 while the rank's worker serves, 0 while it is lost (restarting) or did not answer the scrape; its engine families then keep their last values |
| `mstar_engine_steps{rank, node}` | gauge | engine steps run (cumulative) |
| `mstar_engine_step_seconds{rank, node}` | gauge | seconds in engine steps (cumulative) |
| `mstar_engine_phase_seconds{rank, node, phase}` | gauge | seconds in one phase of the steps (cumulative), for engines that time them: KV-cache nodes' `schedule`, `prepare`, `forward` (the model), `logits` (LM head and sampling), `update` |
| `mstar_engine_batch_size_mean{rank, node}` | gauge | mean inputs per engine step |
| `mstar_kv_cache_blocks_used`, `_total`, `mstar_kv_cache_usage{rank, node}` | gauge | KV-cache occupancy |
| `mstar_engine_walk_step_seconds{rank, node, walk}` | histogram | durations of the steps that served a walk; a step whose batch mixes walks is recorded in full under each of them |
| `mstar_engine_walk_inputs_total{rank, node, walk}` | counter | inputs of a walk run in engine steps |
| `mstar_transport_tensor_bytes_total{process, transport, direction}` | counter | tensor bytes that crossed between processes, by how (`ipc`/`tcp` frames, `shm` arena slots, `cuda_ipc` handles), `sent` or `received`; `process` is `conductor` (the server's own) or `rank<N>` (a worker process). In-process handoffs pass tensors by reference and count nothing |

Engine and transport families are read from the workers at each scrape (`AsyncEngine.engine_stats`);
a lost worker is not waited for.
"""  # noqa: E501 (a table or diagram)

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from itertools import accumulate

import torch
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.metrics_core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.utils import floatToGoString

from mstar.engines.step_times import STEP_TIME_BUCKETS
from mstar.runtime.engine_config import EngineStats
from mstar.runtime.model import Output

__all__ = ["RequestTracker", "ServerMetrics"]

_LATENCY_BUCKETS = (
    0.005,
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.5,
    0.75,
    1.0,
    1.5,
    2.0,
    3.0,
    5.0,
    7.5,
    10.0,
    20.0,
    30.0,
    60.0,
    120.0,
    300.0,
)
_GAP_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.02,
    0.03,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.5,
    0.75,
    1.0,
    2.0,
    5.0,
)
_RTF_BUCKETS = (
    0.05,
    0.1,
    0.2,
    0.3,
    0.4,
    0.5,
    0.6,
    0.7,
    0.8,
    0.9,
    1.0,
    1.25,
    1.5,
    2.0,
    3.0,
    5.0,
    10.0,
)


class ServerMetrics:
    """The server's metric families, bound to one model name."""

    def __init__(self, model: str, registry: CollectorRegistry | None = None) -> None:
        self.model = model
        self.registry = registry or CollectorRegistry()
        r, m = self.registry, ("model",)
        self.running = Gauge(
            "mstar_requests_running", "Requests admitted into the engine.", m, registry=r
        )
        self.waiting = Gauge(
            "mstar_requests_waiting", "Requests queued for admission.", m, registry=r
        )
        self.finished = Counter(
            "mstar_requests_finished",
            "Requests ended, by task and status.",
            (*m, "task", "status"),
            registry=r,
        )
        self.e2e = Histogram(
            "mstar_e2e_request_latency_seconds",
            "Arrival to last output of completed requests.",
            (*m, "task"),
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.ttft = Histogram(
            "mstar_time_to_first_token_seconds",
            "Arrival to the first text output.",
            m,
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.ttfa = Histogram(
            "mstar_time_to_first_audio_seconds",
            "Arrival to the first audio output.",
            m,
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.rtf = Histogram(
            "mstar_audio_real_time_factor",
            "E2E latency divided by the seconds of audio produced.",
            m,
            buckets=_RTF_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "mstar_inter_token_latency_seconds",
            "Gap between consecutive text outputs.",
            m,
            buckets=_GAP_BUCKETS,
            registry=r,
        )
        self.inter_chunk = Histogram(
            "mstar_inter_chunk_latency_seconds",
            "Gap between consecutive outputs of a non-text modality.",
            (*m, "modality"),
            buckets=_GAP_BUCKETS,
            registry=r,
        )
        self.tokens = Counter("mstar_generated_tokens", "Text tokens produced.", m, registry=r)
        self.audio_seconds = Counter(
            "mstar_generated_audio_seconds", "Seconds of audio produced.", m, registry=r
        )
        self.images = Counter("mstar_generated_images", "Images produced.", m, registry=r)

        self.rank_up = Gauge(
            "mstar_rank_up",
            "Whether the worker of a rank serves (1) or is lost or silent (0).",
            (*m, "rank"),
            registry=r,
        )
        e = (*m, "rank", "node")
        self.engine_steps = Gauge(
            "mstar_engine_steps", "Engine steps run, per node (cumulative).", e, registry=r
        )
        self.engine_step_seconds = Gauge(
            "mstar_engine_step_seconds",
            "Seconds spent in engine steps, per node (cumulative).",
            e,
            registry=r,
        )
        self.engine_phase_seconds = Gauge(
            "mstar_engine_phase_seconds",
            "Seconds spent in one phase of the engine steps, per node (cumulative).",
            (*e, "phase"),
            registry=r,
        )
        self.engine_batch_size = Gauge(
            "mstar_engine_batch_size_mean",
            "Mean inputs (sequences) per engine step, per node.",
            e,
            registry=r,
        )
        self.kv_blocks_used = Gauge(
            "mstar_kv_cache_blocks_used", "KV-cache blocks held by sequences.", e, registry=r
        )
        self.kv_blocks_total = Gauge(
            "mstar_kv_cache_blocks_total", "KV-cache blocks in all.", e, registry=r
        )
        self.kv_usage = Gauge(
            "mstar_kv_cache_usage", "Fraction of the KV cache in use.", e, registry=r
        )
        self.prefix_queried = Gauge(
            "mstar_prefix_cache_queried_tokens",
            "Tokens of new sequences looked up in the prefix cache, per node (cumulative).",
            e,
            registry=r,
        )
        self.prefix_hits = Gauge(
            "mstar_prefix_cache_hit_tokens",
            "Tokens found in the prefix cache (not computed again), per node (cumulative).",
            e,
            registry=r,
        )
        self._engine_families = _EngineFamilies(model)
        r.register(self._engine_families)

    def set_ranks_up(self, ranks_up: dict[int, bool]) -> None:
        """Publish which ranks' workers serve."""
        for rank, is_up in ranks_up.items():
            self.rank_up.labels(self.model, str(rank)).set(1.0 if is_up else 0.0)

    def set_engine_stats(self, stats: EngineStats) -> None:
        """Publish the engines' and links' counters (from `AsyncEngine.engine_stats`), read at each
        scrape.

        Ranks missing from ``stats`` keep the counters of their last answer.
        """
        previous = self._engine_families.stats
        for rank in stats.missing_ranks:
            if rank in previous.walks:
                stats.walks.setdefault(rank, previous.walks[rank])
            if f"rank{rank}" in previous.transport:
                stats.transport.setdefault(f"rank{rank}", previous.transport[f"rank{rank}"])
        self._engine_families.stats = stats
        for rank, nodes in stats.nodes.items():
            for node, values in nodes.items():
                labels = (self.model, str(rank), node)
                steps = values.get("steps", 0.0)
                self.engine_steps.labels(*labels).set(steps)
                self.engine_step_seconds.labels(*labels).set(values.get("step_seconds", 0.0))
                self.engine_batch_size.labels(*labels).set(
                    values.get("batched", 0.0) / steps if steps else 0.0
                )
                for key, seconds in values.items():
                    if (phase := _phase_of(key)) is not None:
                        self.engine_phase_seconds.labels(*labels, phase).set(seconds)
                if "kv_blocks_total" in values:
                    total, used = values["kv_blocks_total"], values.get("kv_blocks_used", 0.0)
                    self.kv_blocks_total.labels(*labels).set(total)
                    self.kv_blocks_used.labels(*labels).set(used)
                    self.kv_usage.labels(*labels).set(used / total if total else 0.0)
                if "prefix_queried_tokens" in values:
                    self.prefix_queried.labels(*labels).set(values["prefix_queried_tokens"])
                    self.prefix_hits.labels(*labels).set(values.get("prefix_hit_tokens", 0.0))

    def watch_admission(self, running: Callable[[], float], waiting: Callable[[], float]) -> None:
        """Read the running and waiting gauges from these functions at each scrape."""
        self.running.labels(self.model).set_function(running)
        self.waiting.labels(self.model).set_function(waiting)

    def count_rejected(self, task: str) -> None:
        """Count a request refused for overload."""
        self.finished.labels(self.model, task, "rejected").inc()

    def tracker(self, task: str, *, sample_rate: int | None = None) -> RequestTracker:
        """Start tracking one request that arrived now."""
        return RequestTracker(self, task, sample_rate)

    def exposition(self) -> bytes:
        """Return the registry in the Prometheus text format."""
        return generate_latest(self.registry)


class _EngineFamilies:
    """Step times per (node, walk) and tensor bytes per transport, from the last `EngineStats`.

    A custom collector: the figures are cumulative already (kept by the workers), so they are
    exported as they are, as a histogram and counters.
    """

    def __init__(self, model: str) -> None:
        self.model = model
        self.stats = EngineStats()

    def describe(self) -> Iterator[Metric]:
        yield from self._families(EngineStats())

    def collect(self) -> Iterator[Metric]:
        yield from self._families(self.stats)

    def _families(self, stats: EngineStats) -> Iterator[Metric]:
        labels = ["model", "rank", "node", "walk"]
        step_times = HistogramMetricFamily(
            "mstar_engine_walk_step_seconds",
            "Duration of the engine steps that served inputs of a walk, per (node, walk). A "
            "step whose "
            "batch mixes several walks is recorded in full under each of them, so sums over "
            "walks can "
            "exceed the node's mstar_engine_step_seconds.",
            labels=labels,
        )
        inputs = CounterMetricFamily(
            "mstar_engine_walk_inputs",
            "Inputs of a walk run in engine steps, per (node, walk).",
            labels=labels,
        )
        bounds = [floatToGoString(b) for b in STEP_TIME_BUCKETS] + ["+Inf"]
        for rank, nodes in stats.walks.items():
            for node, walks in nodes.items():
                for walk, t in walks.items():
                    if len(t.bucket_counts) != len(bounds):
                        continue  # a worker built with other buckets: its histogram cannot be read
                    values = [self.model, str(rank), node, walk]
                    cumulative = list(accumulate(t.bucket_counts))
                    step_times.add_metric(
                        values, list(zip(bounds, cumulative, strict=True)), t.seconds
                    )
                    inputs.add_metric(values, t.inputs)
        yield step_times
        yield inputs
        moved = CounterMetricFamily(
            "mstar_transport_tensor_bytes",
            "Tensor bytes that crossed between processes, per process, transport (ipc or "
            "tcp: ZeroMQ "
            "frames; shm: shared-memory arena slots; cuda_ipc: CUDA IPC handles) and direction. "
            "In-process handoffs pass tensors by reference and are not counted.",
            labels=["model", "process", "transport", "direction"],
        )
        for process, kinds in stats.transport.items():
            for kind, directions in kinds.items():
                for direction in ("sent", "received"):
                    moved.add_metric(
                        [self.model, process, kind, direction], directions.get(direction, 0)
                    )
        yield moved


class RequestTracker:
    """Time one request's outputs and record them when it ends."""

    def __init__(self, metrics: ServerMetrics, task: str, sample_rate: int | None) -> None:
        self.metrics = metrics
        self.task = task
        self.sample_rate = sample_rate
        self.arrival = time.perf_counter()
        self.num_audio_samples = 0
        self._last: dict[str, float] = {}  # modality -> time of its last output
        self._end: float | None = None
        self._is_done = False

    def observe(self, output: Output) -> None:
        """Record one output as it reaches the server."""
        now = time.perf_counter()
        self._end = now
        m, model = self.metrics, self.metrics.model
        modality = output.modality
        last = self._last.get(modality)
        self._last[modality] = now
        if modality == "text":
            m.tokens.labels(model).inc(_num_items(output.data))
            (m.ttft.labels(model) if last is None else m.itl.labels(model)).observe(
                now - (last or self.arrival)
            )
            return
        if last is None:
            if modality == "audio":
                m.ttfa.labels(model).observe(now - self.arrival)
        else:
            m.inter_chunk.labels(model, modality).observe(now - last)
        if modality == "audio":
            samples = _num_items(output.data)
            self.num_audio_samples += samples
            if self.sample_rate:
                m.audio_seconds.labels(model).inc(samples / self.sample_rate)
        elif modality == "image":
            m.images.labels(model).inc()

    def finish(self, status: str) -> None:
        """Record the end of the request (once; later calls do nothing)."""
        if self._is_done:
            return
        self._is_done = True
        m, model = self.metrics, self.metrics.model
        m.finished.labels(model, self.task, status).inc()
        if status != "completed":
            return
        e2e = (self._end or time.perf_counter()) - self.arrival
        m.e2e.labels(model, self.task).observe(e2e)
        if self.num_audio_samples and self.sample_rate:
            m.rtf.labels(model).observe(e2e / (self.num_audio_samples / self.sample_rate))


def _phase_of(key: str) -> str | None:
    """Return the phase a ``phase_<name>_seconds`` stats key times (None for other keys)."""
    prefix, suffix = "phase_", "_seconds"
    if key.startswith(prefix) and key.endswith(suffix) and len(key) > len(prefix) + len(suffix):
        return key[len(prefix) : -len(suffix)]
    return None


def _num_items(data: object) -> int:
    if isinstance(data, torch.Tensor):
        return int(data.numel())
    if isinstance(data, list | tuple):
        return len(data)
    return 1
