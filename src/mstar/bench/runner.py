"""Run a benchmark: every target, every load point, identical requests, client-side timing.

    result = await run_benchmark(
        targets={"mstar": engine_target, "transformers": hf_generate},  # first = primary
        requests=make_requests(prompts, max_tokens=256, ignore_eos=True),
        load=ClosedLoop((1, 2, 4, 8)),
    )
    print_table(result); write_json(result, "out.json"); plot_png(result, "out.png")

At each load point the targets run one after another on the same drawn requests and the same
arrival schedule; each first sends its warm-up requests (not measured), then the measured
ones. The first target is the primary; the others are baselines it is compared with.
"""

from __future__ import annotations

import gc
import math
import os
import platform
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

import mstar
from mstar.bench.loadgen import LoadPattern, draw_requests, run_closed_loop
from mstar.bench.metrics import Summary, summarize
from mstar.bench.records import BenchRequest, OutputEvent, RequestRecord, Usage
from mstar.bench.targets import Target, as_target
from mstar.errors import BenchConfigError

__all__ = [
    "cpu_model",
    "RATIO_METRICS",
    "BenchResult",
    "PointResult",
    "Ratio",
    "collect_environment",
    "is_warmup",
    "merge_results",
    "metric_value",
    "run_benchmark",
    "time_request",
]

# Headline metrics compared between the primary target and each baseline: (key, better).
RATIO_METRICS: tuple[tuple[str, str], ...] = (
    ("requests_per_s", "higher"),
    ("output_tokens_per_s", "higher"),
    ("audio_s_per_s", "higher"),
    ("images_per_s", "higher"),
    ("e2e_s.p50", "lower"),
    ("ttft_s.p50", "lower"),
    ("tpot_s.p50", "lower"),
    ("ttfa_s.p50", "lower"),
    ("image_latency_s.p50", "lower"),
    ("jct_s.p50", "lower"),
)


@dataclass(frozen=True)
class PointResult:
    """One target measured at one load point."""

    target: str
    point: float
    summary: Summary
    records: tuple[RequestRecord, ...]


@dataclass(frozen=True)
class Ratio:
    """How much better the primary is than a baseline on one metric (> 1: primary better).

    For throughputs it is primary / baseline; for latencies baseline / primary (a speedup).
    """

    point: float
    baseline: str
    metric: str
    value: float


def merge_results(
    results: Sequence[BenchResult], config: Mapping[str, Any] | None = None
) -> BenchResult:
    """Return one result holding every point of ``results`` (one run per load point, closed
    loop), its config the first's with ``config`` on top and the load listing every point."""
    first = results[0]
    merged = {**first.config, **(config or {})}
    merged["load"] = {"pattern": "closed_loop", "points": [r.load_points[0] for r in results]}
    return replace(first, config=merged, points=tuple(p for r in results for p in r.points))


def metric_value(summary: Summary, key: str) -> float | None:
    """Return a summary value by key: a field ("requests_per_s") or "stat.field" ("e2e_s.p50")."""
    name, _, field = key.partition(".")
    value = getattr(summary, name)
    if field:
        return None if value is None else float(getattr(value, field))
    return None if value is None else float(value)


@dataclass(frozen=True)
class BenchResult:
    """Everything a run measured, with its configuration and environment."""

    name: str
    load_kind: str
    load_unit: str
    primary: str
    baselines: tuple[str, ...]
    config: dict[str, Any]
    environment: dict[str, Any]
    points: tuple[PointResult, ...]

    @property
    def targets(self) -> tuple[str, ...]:
        """Target names, primary first."""
        return (self.primary, *self.baselines)

    @property
    def load_points(self) -> tuple[float, ...]:
        """The swept load values, in run order."""
        return tuple(dict.fromkeys(p.point for p in self.points))

    def result(self, target: str, point: float) -> PointResult:
        """Return the result of `target` at load `point`."""
        for entry in self.points:
            if entry.target == target and entry.point == point:
                return entry
        raise KeyError(f"no result for target {target!r} at {self.load_kind}={point}")

    def ratios(self) -> list[Ratio]:
        """Compare the primary with each baseline at each point, on every metric both have."""
        out: list[Ratio] = []
        for point in self.load_points:
            primary = self.result(self.primary, point).summary
            for baseline in self.baselines:
                other = self.result(baseline, point).summary
                for key, better in RATIO_METRICS:
                    mine, theirs = metric_value(primary, key), metric_value(other, key)
                    if not mine or not theirs:
                        continue  # absent or zero: no meaningful ratio
                    value = mine / theirs if better == "higher" else theirs / mine
                    out.append(Ratio(point, baseline, key, value))
        return out


async def time_request(target: Target, request: BenchRequest, phase_start: float) -> RequestRecord:
    """Send one request to `target`, stamping each output on arrival; never raises on failure.

    The stream's loop only stamps (the client shares its event loop with in-process
    targets); the events are built once the stream has ended.
    """
    stamped: list[tuple[float, OutputEvent]] = []
    usage: Usage | None = None
    error: str | None = None
    start = time.perf_counter()
    stream = target.stream(request)
    clock = time.perf_counter
    try:
        async for item in stream:
            now = clock()
            if isinstance(item, Usage):
                usage = item
            else:
                stamped.append((now, item))
    except Exception as exc:  # a failed request is a measurement, not a crash of the run
        error = f"{type(exc).__name__}: {exc}"
    finally:
        close = getattr(stream, "aclose", None)
        if close is not None:
            await close()
    end = time.perf_counter()
    events = tuple(replace(item, time_s=now - start) for now, item in stamped)
    return RequestRecord(request.request_id, start - phase_start, end - start, events, usage, error)


def collect_environment() -> dict[str, Any]:
    """Describe the machine and software versions a run measured on."""
    import httpx
    import numpy

    env: dict[str, Any] = {
        "time_utc": datetime.now(UTC).isoformat(timespec="seconds"),
        "mstar": mstar.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(),
        "numpy": numpy.__version__,
        "httpx": httpx.__version__,
    }
    try:
        import torch
    except ImportError:
        env["torch"] = None
        return env
    env["torch"] = torch.__version__
    env["torch_threads"] = torch.get_num_threads()
    env["cuda_available"] = torch.cuda.is_available()
    if env["cuda_available"]:
        env["cuda"] = torch.version.cuda
        env["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return env


def cpu_model() -> str:
    """Return the CPU's model name (``/proc/cpuinfo``), what benchmark figures are named by."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def is_warmup(request_id: str) -> bool:
    """Return whether the harness sent this request to warm a target up (``warmup-<point>-<i>``).

    Warm-up requests are never measured: a target that accounts its own time skips them.
    """
    return request_id.startswith("warmup-")


def _label(point: float) -> str:
    if math.isinf(point):
        return "inf"
    return str(int(point)) if point == int(point) else f"{point:g}"


async def run_benchmark(
    targets: Mapping[str, Target | Callable[[BenchRequest], AsyncIterator[Any]]],
    requests: Sequence[BenchRequest],
    load: LoadPattern,
    *,
    name: str = "bench",
    seed: int = 0,
    progress: bool = True,
    console: Console | None = None,
    config: Mapping[str, Any] | None = None,
) -> BenchResult:
    """Measure every target at every load point of `load` on identical requests.

    Args:
        targets: Name to target, in order: the first is the primary, the rest baselines.
            A bare async-generator function is wrapped as a `CallableTarget`.
        requests: Request templates; each point draws its requests from them (seeded).
        load: The load pattern and its sweep.
        name: Name of the benchmark in reports.
        seed: Seeds the requests drawn and the arrival schedules.
        progress: Show a progress bar.
        console: Where the configuration and progress go (default: the terminal).
        config: More configuration to record and print (model, endpoint, ...).

    Returns:
        Every point's records and summary, with configuration and environment.
    """
    if not targets:
        raise BenchConfigError("give at least one target")
    if not requests:
        raise BenchConfigError("give at least one request")
    console = console or Console()
    opened = {label: as_target(label, target) for label, target in targets.items()}
    labels = list(opened)
    run_config: dict[str, Any] = {
        "name": name,
        "targets": labels,
        "primary": labels[0],
        "baselines": labels[1:],
        "load": load.describe(),
        "seed": seed,
        "num_request_templates": len(requests),
        "requests": [r.to_dict() for r in requests[:8]],
        **dict(config or {}),
    }
    console.print(f"[bold]{name}[/bold]: configuration")
    for key, value in run_config.items():
        text = str(value)  # the JSON keeps it whole; the terminal gets a line
        console.print(
            f"  {key}: {text if len(text) <= 100 else text[:99] + '…'}",
            highlight=False,
            markup=False,
        )

    points: list[PointResult] = []
    bar = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        disable=not progress,
    )
    async with AsyncExitStack() as stack:
        stack.callback(gc.unfreeze)  # the points freeze what is alive before measuring
        for target in opened.values():
            await stack.enter_async_context(target)
        with bar:
            for index, point in enumerate(load.points()):
                point_seed = seed * 1_000_003 + index
                label = _label(point)
                warmup = draw_requests(
                    requests, load.warmup_at(point), seed=point_seed, prefix=f"warmup-{label}"
                )
                measured = draw_requests(
                    requests,
                    load.requests_at(point),
                    seed=point_seed + 1,
                    prefix=f"{load.kind}-{label}",
                )
                for target_label, target in opened.items():
                    task = bar.add_task(
                        f"{target_label} {load.kind}={label}", total=len(warmup) + len(measured)
                    )
                    points.append(
                        await _run_point(
                            target,
                            target_label,
                            point,
                            warmup,
                            measured,
                            load,
                            point_seed,
                            bar,
                            task,
                        )
                    )
    return BenchResult(
        name=name,
        load_kind=load.kind,
        load_unit=load.unit,
        primary=labels[0],
        baselines=tuple(labels[1:]),
        config=run_config,
        environment=collect_environment(),
        points=tuple(points),
    )


async def _run_point(
    target: Target,
    label: str,
    point: float,
    warmup: Sequence[BenchRequest],
    measured: Sequence[BenchRequest],
    load: LoadPattern,
    seed: int,
    bar: Progress,
    task: Any,
) -> PointResult:
    async def send_warmup(request: BenchRequest) -> RequestRecord:
        record = await time_request(target, request, warmup_start)
        bar.advance(task)
        return record

    async def send(request: BenchRequest) -> RequestRecord:
        record = await time_request(target, request, start)
        bar.advance(task)
        return record

    warmup_start = time.perf_counter()
    if warmup:
        await run_closed_loop(warmup, send_warmup, load.warmup_concurrency_at(point))
    # What lives now (models, imports, earlier records) is frozen out of the collector's
    # full passes, which otherwise stall whichever target runs then (100+ ms each).
    gc.collect()
    gc.freeze()
    start = time.perf_counter()
    records = await load.drive(point, measured, send, seed=seed)
    duration = time.perf_counter() - start
    return PointResult(label, point, summarize(records, duration), tuple(records))
