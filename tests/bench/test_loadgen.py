"""Load patterns: concurrency kept, arrival processes seeded and shaped, waves separated."""

from __future__ import annotations

import asyncio
import itertools

import numpy as np
import pytest

from mstar.bench.loadgen import (
    MIN_REQUESTS_PER_CLIENT,
    ClosedLoop,
    OfflineWaves,
    OpenLoop,
    arrival_offsets,
    draw_requests,
    make_requests,
)
from mstar.bench.records import BenchRequest, RequestRecord
from mstar.errors import BenchConfigError


class Recorder:
    """A `send` that tracks requests in flight; each request yields to the loop a few times."""

    def __init__(self, steps: int = 3) -> None:
        self.in_flight: set[str] = set()
        self.max_in_flight = 0
        self.started: list[str] = []
        self.finished: list[str] = []
        self.in_flight_at_start: dict[str, set[str]] = {}
        self.steps = steps

    async def __call__(self, request: BenchRequest) -> RequestRecord:
        self.in_flight_at_start[request.request_id] = set(self.in_flight)
        self.in_flight.add(request.request_id)
        self.started.append(request.request_id)
        self.max_in_flight = max(self.max_in_flight, len(self.in_flight))
        for _ in range(self.steps):
            await asyncio.sleep(0)
        self.in_flight.remove(request.request_id)
        self.finished.append(request.request_id)
        return RequestRecord(request.request_id, 0.0, 0.0)


def requests(n: int) -> list[BenchRequest]:
    return draw_requests(make_requests(["a", "b", "c"]), n, seed=1, prefix="q")


async def test_closed_loop_keeps_exactly_c_requests_in_flight() -> None:
    load = ClosedLoop((1, 4))
    for c in (1, 4):
        send = Recorder()
        batch = requests(load.requests_at(c))
        records = await load.drive(float(c), batch, send, seed=0)
        assert send.max_in_flight == c
        assert [r.request_id for r in records] == [r.request_id for r in batch]
        # A new request starts only when one finishes: the i-th start (i >= c) follows
        # at least i - c + 1 completions.
        assert all(len(send.in_flight_at_start[rid]) < c for rid in send.started)


def test_closed_loop_measures_at_least_five_requests_per_client() -> None:
    load = ClosedLoop((1, 2, 8), num_requests=12)
    assert [load.requests_at(p) for p in load.points()] == [12, 12, 8 * MIN_REQUESTS_PER_CLIENT]
    assert ClosedLoop().points() == (1.0, 2.0, 4.0, 8.0, 16.0, 32.0)
    assert [load.warmup_at(p) for p in load.points()] == [1, 2, 8]
    assert ClosedLoop((4,), warmup=0).warmup_at(4.0) == 0


def test_arrivals_are_seeded_gamma_with_the_requested_mean() -> None:
    first = arrival_offsets(20_001, 50.0, 1.0, np.random.default_rng(7))
    again = arrival_offsets(20_001, 50.0, 1.0, np.random.default_rng(7))
    assert np.array_equal(first, again)
    assert first[0] == 0.0 and np.all(np.diff(first) >= 0)
    gaps = np.diff(first)
    assert gaps.mean() == pytest.approx(1 / 50.0, rel=0.03)
    # Exponential gaps (Poisson): coefficient of variation 1. Burstiness 4: 1/2. 0.25: 2.
    for burstiness, cv in ((1.0, 1.0), (4.0, 0.5), (0.25, 2.0)):
        gaps = np.diff(arrival_offsets(20_001, 50.0, burstiness, np.random.default_rng(3)))
        assert gaps.mean() == pytest.approx(1 / 50.0, rel=0.05)
        assert gaps.std() / gaps.mean() == pytest.approx(cv, rel=0.06)
    assert np.array_equal(
        arrival_offsets(5, float("inf"), 1.0, np.random.default_rng(0)), np.zeros(5)
    )


async def test_open_loop_sends_everything_and_respects_the_concurrency_cap() -> None:
    send = Recorder(steps=5)
    batch = requests(12)
    load = OpenLoop(rates=(float("inf"),), num_requests=12, max_concurrency=3)
    records = await load.drive(float("inf"), batch, send, seed=0)
    assert [r.request_id for r in records] == [r.request_id for r in batch]
    assert send.max_in_flight == 3
    uncapped = Recorder(steps=5)
    await OpenLoop(rates=(float("inf"),)).drive(float("inf"), batch, uncapped, seed=0)
    assert uncapped.max_in_flight == 12  # open loop: arrivals do not wait for answers


async def test_open_loop_at_a_finite_rate_returns_records_in_order() -> None:
    batch = requests(6)
    records = await OpenLoop(rates=(5000.0,), num_requests=6).drive(
        5000.0, batch, Recorder(), seed=3
    )
    assert [r.request_id for r in records] == [r.request_id for r in batch]


async def test_offline_waves_start_after_the_previous_wave_finished() -> None:
    load = OfflineWaves(wave_sizes=(3,), num_waves=3)
    assert load.requests_at(3.0) == 9
    send = Recorder()
    batch = requests(9)
    records = await load.drive(3.0, batch, send, seed=0)
    assert len(records) == 9 and send.max_in_flight == 3
    waves = [batch[i : i + 3] for i in (0, 3, 6)]
    for earlier, later in itertools.pairwise(waves):
        for request in later:
            assert not send.in_flight_at_start[request.request_id] & {r.request_id for r in earlier}
            assert {r.request_id for r in earlier} <= set(
                send.finished[: send.finished.index(request.request_id)]
            )


def test_requests_are_drawn_identically_for_a_seed() -> None:
    pool = make_requests(
        ["a", "b", "c", "d"], max_tokens=16, ignore_eos=True, params={"voice": "x"}
    )
    assert [r.request_id for r in pool] == ["p0", "p1", "p2", "p3"]
    first = draw_requests(pool, 20, seed=5, prefix="c-4")
    assert first == draw_requests(pool, 20, seed=5, prefix="c-4")
    assert first != draw_requests(pool, 20, seed=6, prefix="c-4")
    assert [r.request_id for r in first] == [f"c-4-{i}" for i in range(20)]
    assert {r.prompt for r in first} <= {"a", "b", "c", "d"}
    assert all(r.max_tokens == 16 and r.ignore_eos and r.params == {"voice": "x"} for r in first)


@pytest.mark.parametrize(
    "make",
    [
        lambda: ClosedLoop(()),
        lambda: ClosedLoop((0,)),
        lambda: ClosedLoop((1.5,)),  # type: ignore[arg-type]
        lambda: ClosedLoop((1,), num_requests=0),
        lambda: OpenLoop(rates=(-1.0,)),
        lambda: OpenLoop(rates=(1.0,), burstiness=0.0),
        lambda: OpenLoop(rates=(1.0,), max_concurrency=0),
        lambda: OfflineWaves(wave_sizes=(float("inf"),)),  # type: ignore[arg-type]
        lambda: OfflineWaves(num_waves=0),
        lambda: make_requests([]),
        lambda: make_requests(["a"], ignore_eos=True),
        lambda: make_requests(["a"], max_tokens=0),
        lambda: draw_requests([], 1, seed=0, prefix="x"),
        lambda: arrival_offsets(0, 1.0, 1.0, np.random.default_rng(0)),
    ],
)
def test_invalid_load_settings_raise_config_errors(make: object) -> None:
    with pytest.raises(BenchConfigError):
        make()  # type: ignore[operator]
