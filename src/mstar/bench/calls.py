"""Timing awaited calls for micro-benchmarks: one by one, and in bursts on the harness.

A round trip of a few microseconds is below what the harness's per-request bookkeeping can
resolve: `time_calls` times each call with ``perf_counter_ns`` (`percentiles` summarises them),
and `burst` makes one harness request of ``k`` calls in a row, so the harness's ratios and
reports apply; `per_round_trip` turns a burst's E2E back into one call's time.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from mstar.bench.records import BenchRequest, OutputEvent
from mstar.bench.runner import BenchResult

__all__ = ["burst", "per_round_trip", "percentiles", "time_calls"]


async def time_calls(call: Callable[[], Awaitable[Any]], n: int, warmup: int) -> list[int]:
    """Await ``call`` ``warmup`` times untimed, then ``n`` times; return each call's nanoseconds."""
    for _ in range(warmup):
        await call()
    samples = []
    clock = time.perf_counter_ns
    for _ in range(n):
        t0 = clock()
        await call()
        samples.append(clock() - t0)
    return samples


def percentiles(samples_ns: list[int]) -> dict[str, float]:
    """Return the p50 and p99 (nearest rank, in microseconds) of nanosecond samples."""
    ordered = sorted(samples_ns)
    return {
        "p50_us": ordered[len(ordered) // 2] / 1e3,
        "p99_us": ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))] / 1e3,
    }


def burst(
    call: Callable[[], Awaitable[Any]], k: int
) -> Callable[[BenchRequest], AsyncIterator[OutputEvent]]:
    """Return a harness target whose every request is `k` calls of `call` in a row.

    A burst streams nothing back: its E2E is the time of the `k` calls.
    """

    async def run(request: BenchRequest) -> AsyncIterator[OutputEvent]:
        for _ in range(k):
            await call()
        return
        yield  # an async generator that yields nothing

    return run


def per_round_trip(result: BenchResult, k: int) -> dict[str, Any]:
    """Return the mean call inside a burst of ``k`` (p50 and p99 over the bursts, in µs), per
    target, and the ratio of the primary's p50 to the first baseline's (``ratio_p50``).

    Raises:
        RuntimeError: A target's bursts failed (no E2E to divide).
    """
    point = result.load_points[0]
    out: dict[str, Any] = {"round_trips_per_burst": k}
    for target in result.targets:
        summary = result.result(target, point).summary
        if summary.e2e_s is None or summary.num_failed:
            raise RuntimeError(f"{result.name}: {target} bursts failed")
        out[target] = {"p50_us": summary.e2e_s.p50 / k * 1e6, "p99_us": summary.e2e_s.p99 / k * 1e6}
    primary, baseline = result.targets[0], result.targets[1]
    out["ratio_p50"] = out[primary]["p50_us"] / out[baseline]["p50_us"]
    return out
