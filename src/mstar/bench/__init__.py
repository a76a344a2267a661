"""Benchmark harness: load patterns, client-side metrics, baselines, table/JSON/PNG reports.

Every speed claim in mstar comes from here, measured as the field measures (DESIGN §7).

Besides the harness itself: where a target's time goes (`mstar.bench.phases`: a speech
target's LLM steps and codec windows, or any model's engine counters per node and walk), the
CPU each component of a target spends per audio second (`mstar.bench.cpu`), awaited calls
timed one by one or in bursts on the harness (`mstar.bench.calls`), the machine's
measured limits for floors (`mstar.bench.machine`) and the peak memory a target adds
(`mstar.bench.memory`).
"""

from __future__ import annotations

from mstar.bench.audio import AudioFormat, PcmFrameCounter, WavStreamReader
from mstar.bench.calls import burst, per_round_trip, percentiles, time_calls
from mstar.bench.cpu import CpuAccount, thread_cpu_seconds
from mstar.bench.device import add_device_argument, rank_devices
from mstar.bench.http_targets import (
    ChatTarget,
    GenerateTarget,
    HttpTarget,
    ImagesTarget,
    SpeechTarget,
)
from mstar.bench.loadgen import (
    ClosedLoop,
    LoadPattern,
    OfflineWaves,
    OpenLoop,
    arrival_offsets,
    draw_requests,
    make_requests,
)
from mstar.bench.machine import best_seconds, measure_bandwidth, measure_flops, measure_machine
from mstar.bench.memory import PeakMemory
from mstar.bench.metrics import (
    METRIC_DEFINITIONS,
    RequestMetrics,
    Stats,
    Summary,
    chunk_on_time,
    compute_stats,
    is_streaming_viable,
    request_metrics,
    summarize,
)
from mstar.bench.phases import (
    Counters,
    CounterWindow,
    Figures,
    Meter,
    PhaseTracker,
    PointBreakdown,
    breakdown_table,
    engine_counters,
    engine_figures,
    figures_delta,
)
from mstar.bench.records import BenchRequest, OutputEvent, RequestRecord, Usage
from mstar.bench.report import json_safe, plot_png, print_table, result_to_dict, write_json
from mstar.bench.runner import (
    BenchResult,
    PointResult,
    Ratio,
    is_warmup,
    merge_results,
    run_benchmark,
)
from mstar.bench.targets import CallableTarget, Target

__all__ = [
    "add_device_argument",
    "rank_devices",
    "METRIC_DEFINITIONS",
    "AudioFormat",
    "BenchRequest",
    "BenchResult",
    "CallableTarget",
    "ChatTarget",
    "ClosedLoop",
    "CounterWindow",
    "CpuAccount",
    "Counters",
    "Figures",
    "GenerateTarget",
    "HttpTarget",
    "ImagesTarget",
    "LoadPattern",
    "Meter",
    "OfflineWaves",
    "OpenLoop",
    "OutputEvent",
    "PcmFrameCounter",
    "PeakMemory",
    "PhaseTracker",
    "PointBreakdown",
    "PointResult",
    "Ratio",
    "RequestMetrics",
    "RequestRecord",
    "SpeechTarget",
    "Stats",
    "Summary",
    "Target",
    "Usage",
    "WavStreamReader",
    "arrival_offsets",
    "best_seconds",
    "burst",
    "breakdown_table",
    "chunk_on_time",
    "compute_stats",
    "draw_requests",
    "engine_counters",
    "engine_figures",
    "figures_delta",
    "is_streaming_viable",
    "is_warmup",
    "json_safe",
    "make_requests",
    "measure_bandwidth",
    "measure_flops",
    "measure_machine",
    "merge_results",
    "per_round_trip",
    "percentiles",
    "plot_png",
    "print_table",
    "request_metrics",
    "result_to_dict",
    "run_benchmark",
    "summarize",
    "thread_cpu_seconds",
    "time_calls",
    "write_json",
]
