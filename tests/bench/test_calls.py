"""Timing awaited calls: one sample per call, nearest-rank percentiles, bursts on the harness."""

from __future__ import annotations

from mstar.bench import ClosedLoop, make_requests, run_benchmark
from mstar.bench.calls import burst, per_round_trip, percentiles, time_calls


async def test_time_calls_warms_up_then_times_each_call() -> None:
    calls: list[int] = []

    async def call() -> None:
        calls.append(1)

    samples = await time_calls(call, 5, 2)
    assert len(samples) == 5 and len(calls) == 7 and all(s >= 0 for s in samples)


def test_percentiles_are_nearest_rank_in_microseconds() -> None:
    samples = [1000 * (i + 1) for i in range(100)]  # 1 .. 100 us, shuffled order irrelevant
    assert percentiles(samples[::-1]) == {"p50_us": 51.0, "p99_us": 100.0}
    assert percentiles([7000]) == {"p50_us": 7.0, "p99_us": 7.0}


async def test_a_burst_is_k_calls_and_streams_nothing() -> None:
    calls: list[int] = []

    async def call() -> None:
        calls.append(1)

    target = burst(call, 3)
    events = [e async for e in target(make_requests(["x"])[0])]
    assert events == [] and len(calls) == 3


async def test_per_round_trip_divides_each_target_by_the_burst() -> None:
    async def call() -> None:
        pass

    result = await run_benchmark(
        {"fast": burst(call, 10), "floor": burst(call, 10)},
        make_requests(["x"]),
        ClosedLoop((1,), num_requests=5, warmup=0),
        progress=False,
    )
    out = per_round_trip(result, 10)
    assert out["round_trips_per_burst"] == 10 and set(out) >= {"fast", "floor", "ratio_p50"}
    summary = result.result("fast", 1.0).summary
    assert summary.e2e_s is not None
    assert out["fast"]["p50_us"] == summary.e2e_s.p50 / 10 * 1e6
    assert out["ratio_p50"] == out["fast"]["p50_us"] / out["floor"]["p50_us"]
