"""Phase accounting: meter deltas, reads around each point's measured requests, breakdown rows,
engine counters and their window."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import cast

import pytest

from mstar.bench import BenchRequest, OutputEvent, is_warmup
from mstar.bench.phases import (
    Counters,
    CounterWindow,
    Figures,
    Meter,
    PhaseTracker,
    PointBreakdown,
    breakdown_table,
    engine_counters,
)
from mstar.runtime import AsyncEngine, EngineStats
from mstar.runtime.messages import WalkStepStats


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


class _StatsEngine:
    """Answers `engine_stats` as two ranks of a vision + llm model would."""

    def __init__(self) -> None:
        self.stats = EngineStats(
            nodes={
                0: {
                    "vision": {"steps": 2, "batched": 3, "step_seconds": 0.5, "kv_blocks": 9},
                    "llm": {"steps": 10, "batched": 20, "step_seconds": 2.0},
                },
                1: {"llm": {"steps": 5, "batched": 5, "phase_forward_seconds": 0.75}},
            },
            walks={
                0: {
                    "vision": {"prefill": WalkStepStats(2, 3, 0.5, [])},
                    "llm": {
                        "prefill": WalkStepStats(1, 2, 0.25, []),
                        "action_gen": WalkStepStats(10, 20, 1.75, []),
                    },
                },
            },
        )

    async def engine_stats(self) -> EngineStats:
        return self.stats


async def test_engine_counters_sum_ranks_and_read_walks_of_one_node() -> None:
    engine = cast(AsyncEngine, _StatsEngine())
    counters = await engine_counters(engine, nodes=("vision", "llm"), walk_node="llm")
    assert counters == {
        "vision_steps": 2.0,
        "vision_batched": 3.0,
        "vision_step_seconds": 0.5,
        "llm_steps": 15.0,
        "llm_batched": 25.0,
        "llm_step_seconds": 2.0,
        "llm_phase_forward_seconds": 0.75,
        "walk_prefill_steps": 1.0,
        "walk_prefill_inputs": 2.0,
        "walk_prefill_seconds": 0.25,
        "walk_action_gen_steps": 10.0,
        "walk_action_gen_inputs": 20.0,
        "walk_action_gen_seconds": 1.75,
    }


async def test_counter_window_starts_after_the_last_warmup_and_resets() -> None:
    readings = iter([{"steps": 3.0}, {"steps": 2.0}, {"steps": 10.0}, {"steps": 12.0}])

    async def read() -> Counters:
        return next(readings)

    window = CounterWindow(read)
    await window.after_warmup()
    await window.after_warmup()  # read earlier than the first one ended: the maximum counts
    assert await window.spent() == {"steps": 7.0}
    assert await window.spent() == {"steps": 12.0}  # no warm-up since: from zero


def test_warmup_requests_are_recognised_by_name() -> None:
    assert is_warmup("warmup-4-0") and not is_warmup("concurrency-4-0")
