"""Report a `BenchResult`: a terminal table (rich), a JSON file, a PNG plot (matplotlib).

The table and the plot show only the metrics some target has (no empty audio columns for a
text benchmark); the JSON holds everything: configuration, environment, metric definitions,
every request's timeline, every summary and every ratio.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from mstar.bench.metrics import METRIC_DEFINITIONS, Summary
from mstar.bench.runner import BenchResult, metric_value

__all__ = [
    "JSON_SCHEMA",
    "json_safe",
    "make_distribution_table",
    "make_ratio_table",
    "make_table",
    "plot_png",
    "print_table",
    "result_to_dict",
    "write_json",
]

JSON_SCHEMA = "mstar.bench/1"

# (header, summary field) of the latency distributions, shown in milliseconds.
_LATENCIES: tuple[tuple[str, str], ...] = (
    ("TTFT", "ttft_s"),
    ("TPOT", "tpot_s"),
    ("ITL", "itl_s"),
    ("TTFA", "ttfa_s"),
    ("image", "image_latency_s"),
    ("JCT", "jct_s"),
    ("E2E", "e2e_s"),
)
# (header, summary field) of the rates.
_RATES: tuple[tuple[str, str], ...] = (
    ("req/s", "requests_per_s"),
    ("tok/s", "output_tokens_per_s"),
    ("audio s/s", "audio_s_per_s"),
    ("img/s", "images_per_s"),
)
# Short headers of the ratio table.
_RATIO_HEADERS = {
    **{key: header for header, key in _RATES},
    **{f"{key}.p50": f"{header} p50" for header, key in _LATENCIES},
}


def _label(point: float) -> str:
    if math.isinf(point):
        return "inf"
    return str(int(point)) if point == int(point) else f"{point:g}"


def _present(result: BenchResult, key: str) -> bool:
    return any(metric_value(p.summary, key) for p in result.points)


def _num(value: float) -> str:
    # About three significant digits without switching to exponents.
    for bound, fmt in ((100.0, "{:.0f}"), (10.0, "{:.1f}"), (1.0, "{:.2f}")):
        if abs(value) >= bound:
            return fmt.format(value)
    return f"{value:.3f}"


def _used_definitions(result: BenchResult) -> list[str]:
    keys = ["e2e_s", "throughput"]
    for key in ("ttft_s", "itl_s", "tpot_s", "ttfa_s", "rtf", "image_latency_s", "jct_s"):
        if any(p.summary.stats(key) is not None for p in result.points):
            keys.append(key)
    if any(p.summary.viable_fraction is not None for p in result.points):
        keys.append("viable")
    return [METRIC_DEFINITIONS[k] for k in keys]


def _latencies_present(result: BenchResult) -> list[tuple[str, str]]:
    return [
        (header, key)
        for header, key in _LATENCIES
        if any(p.summary.stats(key) is not None for p in result.points)
    ]


def make_table(result: BenchResult) -> Table:
    """Return the summary table: one row per (load point, target), rates and medians."""
    table = Table(title=f"{result.name}: {result.load_kind} sweep")
    table.add_column(result.load_kind, justify="right")
    table.add_column("target")
    table.add_column("ok/fail", justify="right")
    rates = [col for col in _RATES if col[1] == "requests_per_s" or _present(result, col[1])]
    for header, _ in rates:
        table.add_column(header, justify="right")
    latencies = _latencies_present(result)
    for header, _ in latencies:
        table.add_column(f"{header}\np50 ms", justify="right")
    has_audio = any(p.summary.rtf is not None for p in result.points)
    if has_audio:
        table.add_column("RTF\np50", justify="right")
        table.add_column("viable\n%", justify="right")
    for point in result.load_points:
        for target in result.targets:
            summary = result.result(target, point).summary
            row = [
                _label(point),
                target,
                f"{summary.num_requests - summary.num_failed}/{summary.num_failed}",
            ]
            row += [_num(getattr(summary, key)) for _, key in rates]
            for _, key in latencies:
                stats = summary.stats(key)
                row.append("-" if stats is None else _num(1e3 * stats.p50))
            if has_audio:
                row.append("-" if summary.rtf is None else _num(summary.rtf.p50))
                viable = summary.viable_fraction
                row.append("-" if viable is None else f"{100 * viable:.0f}")
            table.add_row(*row)
    return table


def make_distribution_table(result: BenchResult) -> Table:
    """Return every latency distribution: one row per (load point, target, metric)."""
    table = Table(title=f"{result.name}: latency distributions (ms)")
    table.add_column(result.load_kind, justify="right")
    table.add_column("target")
    table.add_column("metric")
    for header in ("n", "mean", "p50", "p95", "p99"):
        table.add_column(header, justify="right")
    latencies = _latencies_present(result)
    for point in result.load_points:
        for target in result.targets:
            summary = result.result(target, point).summary
            for header, key in latencies:
                stats = summary.stats(key)
                if stats is None:
                    continue
                values = (stats.mean, stats.p50, stats.p95, stats.p99)
                table.add_row(
                    _label(point),
                    target,
                    header,
                    str(stats.count),
                    *(_num(1e3 * v) for v in values),
                )
        table.add_section()
    return table


def make_ratio_table(result: BenchResult) -> Table | None:
    """Return the primary-versus-baselines table, or None without baselines."""
    ratios = result.ratios()
    if not ratios:
        return None
    metrics = list(dict.fromkeys(r.metric for r in ratios))
    table = Table(
        title=f"{result.primary} vs baselines (> 1: {result.primary} better; "
        "rates: primary / baseline; latencies: baseline / primary)"
    )
    table.add_column(result.load_kind, justify="right")
    table.add_column("baseline")
    for metric in metrics:
        table.add_column(_RATIO_HEADERS.get(metric, metric), justify="right")
    for point in result.load_points:
        for baseline in result.baselines:
            values = {
                r.metric: r.value for r in ratios if r.point == point and r.baseline == baseline
            }
            table.add_row(
                _label(point),
                baseline,
                *(f"{values[m]:.2f}x" if m in values else "-" for m in metrics),
            )
    return table


def print_table(result: BenchResult, console: Console | None = None) -> None:
    """Print the summary, the latency distributions, the ratios and the metric definitions."""
    console = console or Console()
    console.print(make_table(result))
    console.print(make_distribution_table(result))
    ratio_table = make_ratio_table(result)
    if ratio_table is not None:
        console.print(ratio_table)
    for definition in _used_definitions(result):
        console.print(f"  {definition}", highlight=False, markup=False)


def json_safe(value: Any) -> Any:
    """Return ``value`` as strict-JSON-ready data: NaN as null, infinities as "inf" / "-inf",
    tuples as lists, keys as strings."""
    if isinstance(value, float):
        if math.isnan(value):
            return None
        return ("inf" if value > 0 else "-inf") if math.isinf(value) else value
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(v) for v in value]
    return value


def result_to_dict(result: BenchResult) -> dict[str, Any]:
    """Return the whole result as strict-JSON-ready data (inf as "inf", NaN as null)."""
    data = {
        "schema": JSON_SCHEMA,
        "name": result.name,
        "load": {"kind": result.load_kind, "unit": result.load_unit},
        "primary": result.primary,
        "baselines": list(result.baselines),
        "config": result.config,
        "environment": result.environment,
        "metric_definitions": METRIC_DEFINITIONS,
        "results": [
            {
                "target": p.target,
                "point": p.point,
                "summary": p.summary.to_dict(),
                "requests": [r.to_dict() for r in p.records],
            }
            for p in result.points
        ],
        "ratios": [asdict(r) for r in result.ratios()],
    }
    safe: dict[str, Any] = json_safe(data)
    return safe


def write_json(result: BenchResult, path: str | Path) -> Path:
    """Write the result as JSON to `path` (parents created); return the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result_to_dict(result), indent=1, allow_nan=False) + "\n")
    return path


def _throughput_key(result: BenchResult) -> tuple[str, str]:
    for key, title in (
        ("audio_s_per_s", "audio seconds / s"),
        ("output_tokens_per_s", "output tokens / s"),
        ("images_per_s", "images / s"),
    ):
        if _present(result, key):
            return key, title
    return "requests_per_s", "requests / s"


def _panels(result: BenchResult) -> list[tuple[str, str]]:
    panels = [("e2e_s", "E2E latency (ms)")]
    for key, title in (
        ("ttft_s", "TTFT (ms)"),
        ("ttfa_s", "TTFA (ms)"),
        ("tpot_s", "TPOT (ms)"),
        ("image_latency_s", "image latency (ms)"),
        ("jct_s", "job completion time (ms)"),
    ):
        if any(p.summary.stats(key) is not None for p in result.points):
            panels.append((key, title))
    return panels


def plot_png(result: BenchResult, path: str | Path) -> Path:
    """Plot latency (p50 solid, p99 dashed) and throughput against load; write a PNG.

    Every target shares the axes, so baselines sit beside the primary. Load points are
    placed evenly (a doubling sweep reads as a log axis) and labelled with their values.
    """
    # Imported here: matplotlib costs about a second, which `--help` should not pay. The
    # object API with the Agg canvas needs no pyplot and leaves the global backend alone.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    latency_panels = _panels(result)
    throughput_key, throughput_title = _throughput_key(result)
    num_panels = len(latency_panels) + 1
    figure = Figure(figsize=(4.2 * num_panels, 3.6), layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots(1, num_panels, squeeze=False)[0]
    points = result.load_points
    xs = list(range(len(points)))
    colors = [f"C{i % 10}" for i in range(len(result.targets))]
    for axis, (key, title) in zip(axes, latency_panels, strict=False):
        for target, color in zip(result.targets, colors, strict=True):
            summaries = [result.result(target, p).summary for p in points]
            _plot_series(
                axis, xs, [_stat(s, key, "p50") for s in summaries], color, "-", f"{target} p50"
            )
            _plot_series(
                axis, xs, [_stat(s, key, "p99") for s in summaries], color, "--", f"{target} p99"
            )
        axis.set_title(title)
        axis.set_ylim(bottom=0)
    throughput_axis = axes[-1]
    for target, color in zip(result.targets, colors, strict=True):
        values = [metric_value(result.result(target, p).summary, throughput_key) for p in points]
        _plot_series(throughput_axis, xs, values, color, "-", target)
    throughput_axis.set_title(f"throughput ({throughput_title})")
    throughput_axis.set_ylim(bottom=0)
    for axis in axes:
        axis.set_xticks(xs, [_label(p) for p in points])
        axis.set_xlabel(f"{result.load_kind} ({result.load_unit})")
        axis.grid(alpha=0.3)
        if axis.get_legend_handles_labels()[0]:
            axis.legend(fontsize="small")
        else:
            axis.text(0.5, 0.5, "no successful requests", ha="center", transform=axis.transAxes)
    figure.suptitle(result.name)
    figure.savefig(path, dpi=110)
    return path


def _stat(summary: Summary, key: str, field: str) -> float | None:
    stats = summary.stats(key)
    return None if stats is None else 1e3 * float(getattr(stats, field))


def _plot_series(
    axis: Any, xs: Sequence[int], ys: Sequence[float | None], color: str, style: str, label: str
) -> None:
    pairs = [(x, y) for x, y in zip(xs, ys, strict=True) if y is not None]
    if pairs:
        axis.plot(*zip(*pairs, strict=True), style, color=color, marker="o", label=label)
