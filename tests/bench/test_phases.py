"""Phase accounting: meter deltas, reads around each point's measured requests, breakdown rows."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from mstar.bench import BenchRequest, OutputEvent
from mstar.bench.phases import Figures, Meter, PhaseTracker, PointBreakdown, breakdown_table


def test_meter_deltas() -> None:
    meter = Meter()
    meter.add("codec", 0.5, 4)
    before = meter.snapshot()
    meter.add("codec", 0.25, 2)
    meter.add("llm_step", 1.0)
    assert Meter.delta(before, meter.snapshot()) == {"codec": (0.25, 2), "llm_step": (1.0, 1)}


async def test_phase_tracker_spans_the_measured_requests() -> None:
    meter = Meter()
    num_reads = 0

    async def read() -> Figures:
        nonlocal num_reads
        num_reads += 1
        await asyncio.sleep(0)  # suspends, as AsyncEngine.stats does
        return meter.snapshot()

    async def target(request: BenchRequest) -> AsyncIterator[OutputEvent]:
        meter.add("codec", 1.0)
        yield OutputEvent("audio", num_samples=1, sample_rate=24000)

    tracker = PhaseTracker(read)
    run = tracker.wrap(target)

    async def send(request_id: str) -> None:
        async for _ in run(BenchRequest(request_id, "hi")):
            pass

    await send("warmup-0")
    await asyncio.gather(*(send(f"concurrency-2-{i}") for i in range(3)))
    meter.add("codec", 5.0, 5)  # after the point
    assert tracker.spent("concurrency-2") == {"codec": (3.0, 3)}
    assert num_reads == 1 + 3  # once before the point's first request, once after each


def test_breakdown_rows_prefer_engine_steps_over_generate() -> None:
    spent = {"llm_step": (2.0, 10), "llm_forward": (1.5, 0), "codec": (1.0, 4)}
    row = PointBreakdown.from_spent("mstar", 4, 5.0, 3.0, spent)
    assert (row.llm_s, row.llm_forward_s, row.num_steps) == (2.0, 1.5, 10)
    assert (row.codec_s, row.num_windows) == (1.0, 4)
    assert row.other_s == pytest.approx(2.0)
    generate = PointBreakdown.from_spent("hf", 4, 5.0, 3.0, {"llm_generate": (4.0, 28)})
    assert (generate.llm_s, generate.llm_forward_s, generate.num_steps) == (4.0, None, 28)
    assert (generate.codec_s, generate.num_windows) == (0.0, 0)
    table = breakdown_table([row, generate], "a caption")
    assert table.row_count == 2 and table.caption == "a caption"
