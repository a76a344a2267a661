"""Load patterns: how requests are offered to a target (DESIGN §7).

- `ClosedLoop`: c clients, each sending its next request when the last one finished; swept
  over c (1, 2, 4, 8, 16, 32 by default), at least 5 x c measured requests per point.
- `OpenLoop`: requests arrive at a mean rate regardless of completions, with Gamma
  inter-arrival gaps (burstiness 1 is a Poisson process; lower is burstier, higher is more
  regular), optionally capped at a maximum concurrency.
- `OfflineWaves`: waves of w requests submitted at once; the next wave starts when the whole
  wave finished (batch throughput).

A pattern only decides *when* `send` is called; the runner times each request, excludes the
warm-up requests it sends first, and hands every target identical requests and schedules.
"""

from __future__ import annotations

import asyncio
import math
import random
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, replace
from typing import Any, ClassVar, Protocol

import numpy as np

from mstar.bench.records import BenchRequest, RequestRecord
from mstar.errors import BenchConfigError

__all__ = [
    "MIN_REQUESTS_PER_CLIENT",
    "ClosedLoop",
    "LoadPattern",
    "OfflineWaves",
    "OpenLoop",
    "Send",
    "arrival_offsets",
    "draw_requests",
    "make_requests",
    "run_closed_loop",
]

Send = Callable[[BenchRequest], Coroutine[Any, Any, RequestRecord]]

# A closed-loop point measures at least this many requests per client (DESIGN §7).
MIN_REQUESTS_PER_CLIENT = 5


class LoadPattern(Protocol):
    """A sweep of load points and how to offer requests at each."""

    kind: ClassVar[str]  # the swept quantity: "concurrency", "rate" or "wave_size"
    unit: ClassVar[str]

    def points(self) -> tuple[float, ...]:
        """Return the swept values, in order."""
        ...

    def requests_at(self, point: float) -> int:
        """Return how many measured requests `point` sends."""
        ...

    def warmup_at(self, point: float) -> int:
        """Return how many unmeasured requests precede the measured ones."""
        ...

    def warmup_concurrency_at(self, point: float) -> int:
        """Return the concurrency of the warm-up requests."""
        ...

    def describe(self) -> dict[str, Any]:
        """Return the pattern's configuration as JSON-ready data."""
        ...

    async def drive(
        self, point: float, requests: Sequence[BenchRequest], send: Send, *, seed: int
    ) -> list[RequestRecord]:
        """Offer `requests` at load `point`; return their records in request order."""
        ...


async def run_closed_loop(
    requests: Sequence[BenchRequest], send: Send, concurrency: int
) -> list[RequestRecord]:
    """Send `requests` from `concurrency` clients; return the records in request order."""
    records: list[RequestRecord | None] = [None] * len(requests)
    pending = iter(enumerate(requests))

    async def client() -> None:
        # The clients share one iterator: whichever is free takes the next request.
        for index, request in pending:
            records[index] = await send(request)

    async with asyncio.TaskGroup() as group:
        for _ in range(min(concurrency, len(requests))):
            group.create_task(client())
    return [record for record in records if record is not None]


def _check_points(name: str, points: Sequence[float], *, integral: bool) -> tuple[float, ...]:
    if not points:
        raise BenchConfigError(f"{name}: give at least one value")
    for point in points:
        if not point > 0 or (integral and (math.isinf(point) or point != int(point))):
            kind = "a positive integer" if integral else "positive (inf for all at once)"
            raise BenchConfigError(f"{name}: {point!r} is not {kind}")
    return tuple(points)


@dataclass(frozen=True)
class ClosedLoop:
    """Closed loop at each concurrency c: c clients, each waits for its answer, then sends.

    Attributes:
        concurrencies: The swept values of c.
        num_requests: Measured requests per point; raised to 5 x c where smaller.
        warmup: Unmeasured requests per point, sent first at concurrency c; default c.
    """

    kind: ClassVar[str] = "concurrency"
    unit: ClassVar[str] = "clients"
    concurrencies: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    num_requests: int | None = None
    warmup: int | None = None

    def __post_init__(self) -> None:
        points = _check_points("concurrencies", self.concurrencies, integral=True)
        object.__setattr__(self, "concurrencies", tuple(int(c) for c in points))
        if self.num_requests is not None and self.num_requests < 1:
            raise BenchConfigError(f"num_requests must be >= 1, got {self.num_requests}")
        if self.warmup is not None and self.warmup < 0:
            raise BenchConfigError(f"warmup must be >= 0, got {self.warmup}")

    def points(self) -> tuple[float, ...]:
        return tuple(float(c) for c in self.concurrencies)

    def requests_at(self, point: float) -> int:
        """Return max(num_requests, 5 x c) for concurrency c = `point`."""
        return max(self.num_requests or 0, MIN_REQUESTS_PER_CLIENT * int(point))

    def warmup_at(self, point: float) -> int:
        return int(point) if self.warmup is None else self.warmup

    def warmup_concurrency_at(self, point: float) -> int:
        return int(point)

    def describe(self) -> dict[str, Any]:
        return {
            "pattern": "closed_loop",
            "concurrencies": list(self.concurrencies),
            "num_requests": self.num_requests,
            "min_requests_per_client": MIN_REQUESTS_PER_CLIENT,
            "warmup": self.warmup,
        }

    async def drive(
        self, point: float, requests: Sequence[BenchRequest], send: Send, *, seed: int
    ) -> list[RequestRecord]:
        return await run_closed_loop(requests, send, int(point))


def arrival_offsets(
    num_requests: int, rate: float, burstiness: float, rng: np.random.Generator
) -> np.ndarray:
    """Return send times (seconds from the start) of an open-loop arrival process.

    The first request goes at 0; the gaps between consecutive requests are independent
    Gamma(shape=burstiness, scale=1 / (rate * burstiness)) draws, whose mean is 1 / rate.
    Burstiness 1 gives exponential gaps (a Poisson process). An infinite rate sends all at 0.
    """
    if num_requests < 1 or not rate > 0 or not burstiness > 0:
        raise BenchConfigError(
            f"arrivals need num_requests >= 1, rate > 0 and burstiness > 0; got "
            f"{num_requests}, {rate}, {burstiness}"
        )
    if math.isinf(rate):
        return np.zeros(num_requests)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=num_requests - 1)
    return np.concatenate([[0.0], np.cumsum(gaps)])


@dataclass(frozen=True)
class OpenLoop:
    """Open loop at each rate: arrivals follow a seeded Gamma process, whatever the answers.

    Attributes:
        rates: The swept mean arrival rates, requests per second (inf: all at once).
        num_requests: Measured requests per point.
        burstiness: Shape of the Gamma gaps; 1 is Poisson.
        max_concurrency: Requests in flight at most; an arrival past it waits for a slot.
        warmup: Unmeasured requests per point, sent first all at once.
    """

    kind: ClassVar[str] = "rate"
    unit: ClassVar[str] = "req/s"
    rates: tuple[float, ...] = (1.0,)
    num_requests: int = 100
    burstiness: float = 1.0
    max_concurrency: int | None = None
    warmup: int = 1

    def __post_init__(self) -> None:
        points = _check_points("rates", self.rates, integral=False)
        object.__setattr__(self, "rates", tuple(float(r) for r in points))
        if self.num_requests < 1:
            raise BenchConfigError(f"num_requests must be >= 1, got {self.num_requests}")
        if not self.burstiness > 0:
            raise BenchConfigError(f"burstiness must be > 0, got {self.burstiness}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise BenchConfigError(f"max_concurrency must be >= 1, got {self.max_concurrency}")
        if self.warmup < 0:
            raise BenchConfigError(f"warmup must be >= 0, got {self.warmup}")

    def points(self) -> tuple[float, ...]:
        return tuple(float(r) for r in self.rates)

    def requests_at(self, point: float) -> int:
        return self.num_requests

    def warmup_at(self, point: float) -> int:
        return self.warmup

    def warmup_concurrency_at(self, point: float) -> int:
        return max(1, min(self.warmup, self.max_concurrency or self.warmup))

    def describe(self) -> dict[str, Any]:
        return {
            "pattern": "open_loop",
            "rates": [r if math.isfinite(r) else "inf" for r in self.rates],
            "num_requests": self.num_requests,
            "burstiness": self.burstiness,
            "arrivals": "poisson" if self.burstiness == 1.0 else "gamma",
            "max_concurrency": self.max_concurrency,
            "warmup": self.warmup,
        }

    async def drive(
        self, point: float, requests: Sequence[BenchRequest], send: Send, *, seed: int
    ) -> list[RequestRecord]:
        offsets = arrival_offsets(
            len(requests), point, self.burstiness, np.random.default_rng(seed)
        )
        slots = asyncio.Semaphore(self.max_concurrency) if self.max_concurrency else None
        records: list[RequestRecord | None] = [None] * len(requests)

        async def one(index: int, request: BenchRequest) -> None:
            if slots is None:
                records[index] = await send(request)
                return
            async with slots:
                records[index] = await send(request)

        loop = asyncio.get_running_loop()
        start = loop.time()
        async with asyncio.TaskGroup() as group:
            for index, (request, offset) in enumerate(zip(requests, offsets, strict=True)):
                delay = start + float(offset) - loop.time()
                if delay > 0:
                    await asyncio.sleep(delay)  # the arrival schedule itself, not sequencing
                group.create_task(one(index, request))
        return [record for record in records if record is not None]


@dataclass(frozen=True)
class OfflineWaves:
    """Offline waves at each wave size w: w requests at once, then the next wave.

    Attributes:
        wave_sizes: The swept values of w.
        num_waves: Measured waves per point.
        warmup: Unmeasured requests per point, sent first at concurrency w; default w.
    """

    kind: ClassVar[str] = "wave_size"
    unit: ClassVar[str] = "requests"
    wave_sizes: tuple[int, ...] = (8, 32)
    num_waves: int = 2
    warmup: int | None = None

    def __post_init__(self) -> None:
        points = _check_points("wave_sizes", self.wave_sizes, integral=True)
        object.__setattr__(self, "wave_sizes", tuple(int(w) for w in points))
        if self.num_waves < 1:
            raise BenchConfigError(f"num_waves must be >= 1, got {self.num_waves}")
        if self.warmup is not None and self.warmup < 0:
            raise BenchConfigError(f"warmup must be >= 0, got {self.warmup}")

    def points(self) -> tuple[float, ...]:
        return tuple(float(w) for w in self.wave_sizes)

    def requests_at(self, point: float) -> int:
        return int(point) * self.num_waves

    def warmup_at(self, point: float) -> int:
        return int(point) if self.warmup is None else self.warmup

    def warmup_concurrency_at(self, point: float) -> int:
        return int(point)

    def describe(self) -> dict[str, Any]:
        return {
            "pattern": "offline_waves",
            "wave_sizes": list(self.wave_sizes),
            "num_waves": self.num_waves,
            "warmup": self.warmup,
        }

    async def drive(
        self, point: float, requests: Sequence[BenchRequest], send: Send, *, seed: int
    ) -> list[RequestRecord]:
        size = int(point)
        records: list[RequestRecord] = []
        for begin in range(0, len(requests), size):
            wave = requests[begin : begin + size]
            async with asyncio.TaskGroup() as group:
                tasks = [group.create_task(send(request)) for request in wave]
            records.extend(task.result() for task in tasks)
        return records


def make_requests(
    prompts: Sequence[str],
    *,
    max_tokens: int | None = None,
    ignore_eos: bool = False,
    params: dict[str, Any] | None = None,
) -> list[BenchRequest]:
    """Return one request template per prompt, all with the same output settings."""
    if not prompts:
        raise BenchConfigError("give at least one prompt")
    if max_tokens is not None and max_tokens < 1:
        raise BenchConfigError(f"max_tokens must be >= 1, got {max_tokens}")
    if ignore_eos and max_tokens is None:
        raise BenchConfigError("ignore_eos needs max_tokens: it fixes the output length")
    return [
        BenchRequest(f"p{i}", prompt, max_tokens, ignore_eos, dict(params or {}))
        for i, prompt in enumerate(prompts)
    ]


def draw_requests(
    pool: Sequence[BenchRequest], num: int, *, seed: int, prefix: str
) -> list[BenchRequest]:
    """Draw `num` requests from `pool` with replacement, seeded; ids are `prefix-i`."""
    if not pool:
        raise BenchConfigError("the request pool is empty")
    rng = random.Random(seed)
    return [replace(rng.choice(pool), request_id=f"{prefix}-{i}") for i in range(num)]
