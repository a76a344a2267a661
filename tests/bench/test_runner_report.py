"""The whole path: a sweep over an in-process target and a baseline, then table, JSON and PNG."""

from __future__ import annotations

import asyncio
import gc
import json
import math
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from rich.console import Console

from mstar.bench import (
    BenchRequest,
    CallableTarget,
    ClosedLoop,
    OfflineWaves,
    OpenLoop,
    OutputEvent,
    Usage,
    make_requests,
    plot_png,
    print_table,
    run_benchmark,
    write_json,
)
from mstar.bench.runner import RATIO_METRICS, metric_value

RATE = 24_000


class SpeechEngine:
    """A stand-in engine streaming text then audio chunks; remembers what it was asked."""

    def __init__(self, steps_per_chunk: int) -> None:
        self.steps_per_chunk = steps_per_chunk
        self.seen: list[tuple[str, str]] = []

    async def generate(self, request: BenchRequest) -> AsyncIterator[OutputEvent | Usage]:
        self.seen.append((request.request_id, request.prompt))
        tokens = request.max_tokens or 4
        for _ in range(tokens):
            await asyncio.sleep(0)
            yield OutputEvent("text", num_tokens=1)
        for _ in range(3):
            for _ in range(self.steps_per_chunk):
                await asyncio.sleep(0)
            yield OutputEvent("audio", num_samples=RATE // 10, sample_rate=RATE)
        yield Usage(num_output_tokens=tokens)


def quiet_console() -> Console:
    return Console(record=True, width=260, force_terminal=False, color_system=None)


async def test_closed_loop_sweep_with_a_baseline_writes_table_json_and_png(tmp_path: Path) -> None:
    mstar_engine, baseline_engine = SpeechEngine(1), SpeechEngine(4)
    requests = make_requests(
        ["hello there", "a longer prompt", "third"], max_tokens=6, ignore_eos=True
    )
    console = quiet_console()
    result = await run_benchmark(
        {"mstar": mstar_engine.generate, "hand-loop": baseline_engine.generate},
        requests,
        ClosedLoop((1, 2), warmup=2),
        name="demo",
        seed=11,
        progress=False,
        console=console,
        config={"model": "stand-in"},
    )

    # Structure: 2 points x 2 targets, 5 x c measured requests, warm-up excluded.
    assert (result.primary, result.baselines, result.load_points) == (
        "mstar",
        ("hand-loop",),
        (1.0, 2.0),
    )
    for point in (1.0, 2.0):
        for target in ("mstar", "hand-loop"):
            entry = result.result(target, point)
            assert len(entry.records) == 5 * int(point)
            assert not any(r.request_id.startswith("warmup") for r in entry.records)
            s = entry.summary
            assert (s.num_requests, s.num_failed) == (5 * int(point), 0)
            assert s.num_output_tokens == 6 * 5 * int(point)
            assert s.audio_s == pytest.approx(0.3 * 5 * int(point))
            assert s.ttft_s is not None and s.ttfa_s is not None and s.rtf is not None
            assert s.viable_fraction is not None
    # Identical requests for both targets: same ids and prompts, warm-up included.
    assert Counter(mstar_engine.seen) == Counter(baseline_engine.seen)
    assert sum(1 for rid, _ in mstar_engine.seen if rid.startswith("warmup")) == 4

    # Ratios: primary against baseline on every headline metric both have.
    ratios = result.ratios()
    metrics = {r.metric for r in ratios}
    assert {
        "requests_per_s",
        "output_tokens_per_s",
        "audio_s_per_s",
        "e2e_s.p50",
        "ttfa_s.p50",
    } <= metrics
    assert "images_per_s" not in metrics and "jct_s.p50" not in metrics
    for ratio in ratios:
        better = dict(RATIO_METRICS)[ratio.metric]
        mine = metric_value(result.result("mstar", ratio.point).summary, ratio.metric)
        theirs = metric_value(result.result("hand-loop", ratio.point).summary, ratio.metric)
        assert mine and theirs
        assert ratio.value == (mine / theirs if better == "higher" else theirs / mine)

    # Table: configuration printed first, then rows, ratios and the RTF definition.
    print_table(result, console)
    text = console.export_text()
    assert text.index("configuration") < text.index("demo: concurrency sweep")
    assert "model: stand-in" in text
    assert "mstar vs baselines" in text and "hand-loop" in text
    assert "RTF: client E2E latency / audio duration" in text
    assert "demo: latency distributions (ms)" in text and "viable" in text
    for metric in ("TTFT", "TPOT", "ITL", "TTFA", "E2E"):
        assert f"│ {metric} " in text  # one distribution row per metric present
    assert "│ image " not in text and "│ JCT " not in text

    # JSON: strict, complete, per-request timelines included.
    data = json.loads(write_json(result, tmp_path / "out" / "demo.json").read_text())
    assert data["schema"] == "mstar.bench/1"
    assert (data["primary"], data["baselines"]) == ("mstar", ["hand-loop"])
    assert data["config"]["load"]["concurrencies"] == [1, 2]
    assert data["environment"]["python"] and "torch" in data["environment"]
    assert "rtf" in data["metric_definitions"]
    assert len(data["results"]) == 4
    first = data["results"][0]
    assert set(first["summary"]["e2e_s"]) == {"count", "mean", "p50", "p95", "p99"}
    assert len(first["requests"]) == 5
    events = first["requests"][0]["events"]
    assert [e["modality"] for e in events] == ["text"] * 6 + ["audio"] * 3
    assert events[-1]["num_samples"] == RATE // 10 and events[-1]["sample_rate"] == RATE
    assert len(data["ratios"]) == len(ratios)

    # PNG: a real image with latency and throughput panels.
    png = plot_png(result, tmp_path / "out" / "demo.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    from matplotlib.image import imread

    height, width = imread(png).shape[:2]
    assert width > 2 * height  # several panels side by side


async def test_failures_are_counted_and_other_requests_still_measured(tmp_path: Path) -> None:
    async def flaky(request: BenchRequest) -> AsyncIterator[OutputEvent]:
        yield OutputEvent("text", num_tokens=1)
        if request.prompt == "bad":
            raise RuntimeError("device lost")
        yield OutputEvent("text", num_tokens=1)

    async def wrong_type(request: BenchRequest) -> AsyncIterator[object]:
        yield {"tokens": 1}

    result = await run_benchmark(
        {"flaky": flaky, "wrong": CallableTarget(wrong_type, name="wrong")},
        make_requests(["good", "bad"]),
        OfflineWaves(wave_sizes=(4,), num_waves=2, warmup=0),
        progress=False,
        console=quiet_console(),
    )
    flaky = result.result("flaky", 4.0)
    failed = [r for r in flaky.records if r.error]
    assert all(r.error == "RuntimeError: device lost" for r in failed)
    assert (flaky.summary.num_requests, flaky.summary.num_failed) == (8, len(failed))
    assert 0 < len(failed) < 8  # seed 0 draws both prompts
    assert flaky.summary.num_output_tokens == 2 * (8 - len(failed))  # failures add nothing
    wrong = result.result("wrong", 4.0).summary
    assert wrong.num_failed == 8
    assert "yield OutputEvent or Usage" in (result.result("wrong", 4.0).records[0].error or "")
    # No successful request of "wrong": no ratio can be formed.
    assert result.ratios() == []
    write_json(result, tmp_path / "f.json")
    plot_png(result, tmp_path / "f.png")


async def test_measured_phases_run_with_what_lived_before_frozen_out_of_the_collector() -> None:
    frozen: dict[str, int] = {}

    async def target(request: BenchRequest) -> AsyncIterator[OutputEvent]:
        frozen[request.request_id] = gc.get_freeze_count()
        yield OutputEvent("text", num_tokens=1)

    await run_benchmark(
        {"t": target},
        make_requests(["a"]),
        OfflineWaves(wave_sizes=(2,), num_waves=1, warmup=1),
        progress=False,
        console=quiet_console(),
    )
    assert all(count == 0 for rid, count in frozen.items() if rid.startswith("warmup"))
    assert all(count > 1000 for rid, count in frozen.items() if not rid.startswith("warmup"))
    assert len(frozen) == 3
    assert gc.get_freeze_count() == 0  # unfrozen once the run ends


async def test_open_loop_with_infinite_rate_reports_inf_in_strict_json(tmp_path: Path) -> None:
    async def echo(request: BenchRequest) -> AsyncIterator[OutputEvent]:
        yield OutputEvent("image", num_images=2)

    result = await run_benchmark(
        {"images": echo},
        make_requests(["p"]),
        OpenLoop(rates=(1000.0, math.inf), num_requests=4, warmup=0),
        progress=False,
        console=quiet_console(),
    )
    assert result.load_points == (1000.0, math.inf)
    assert result.result("images", math.inf).summary.num_images == 8
    data = json.loads(write_json(result, tmp_path / "o.json").read_text())
    assert [r["point"] for r in data["results"]] == [1000.0, "inf"]
    assert data["config"]["load"]["rates"] == [1000.0, "inf"]
    console = quiet_console()
    print_table(result, console)
    text = console.export_text()
    assert "img/s" in text and "│  inf │" in text
    assert plot_png(result, tmp_path / "o.png").stat().st_size > 0


async def test_bad_arguments_are_config_errors() -> None:
    from mstar.errors import BenchConfigError

    with pytest.raises(BenchConfigError):
        await run_benchmark({}, make_requests(["a"]), ClosedLoop((1,)), progress=False)
    with pytest.raises(BenchConfigError):
        await run_benchmark({"x": SpeechEngine(1).generate}, [], ClosedLoop((1,)), progress=False)
