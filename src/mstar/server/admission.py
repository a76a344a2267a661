"""Bounded admission: at most `max_running` requests in the engine, `max_waiting` queued.

A request that finds both full is refused at once (the server answers 503 with
`Retry-After`) rather than queued without bound: under overload, latency stays bounded
for the requests that are admitted and clients learn early that they should back off.
Waiting requests are admitted in arrival order.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from dataclasses import dataclass

from mstar.errors import OverloadedError, ServerConfigError

__all__ = ["AdmissionLimits", "AdmissionQueue"]


@dataclass(frozen=True)
class AdmissionLimits:
    """How many requests run and wait.

    Attributes:
        max_running: Requests in the engine at once.
        max_waiting: Requests queued for a running slot; beyond, requests are refused.
        retry_after_s: The `Retry-After` seconds sent with a refusal.
    """

    max_running: int = 64
    max_waiting: int = 256
    retry_after_s: int = 1

    def __post_init__(self) -> None:
        if self.max_running < 1:
            raise ServerConfigError(f"max_running must be >= 1, got {self.max_running}")
        if self.max_waiting < 0:
            raise ServerConfigError(f"max_waiting must be >= 0, got {self.max_waiting}")
        if self.retry_after_s < 0:
            raise ServerConfigError(f"retry_after_s must be >= 0, got {self.retry_after_s}")


class AdmissionQueue:
    """Running slots with a bounded FIFO of waiters (use from one event loop)."""

    def __init__(self, limits: AdmissionLimits | None = None) -> None:
        self.limits = limits or AdmissionLimits()
        self.num_running = 0
        self._waiters: deque[asyncio.Future[None]] = deque()

    @property
    def num_waiting(self) -> int:
        """Return how many requests wait for a running slot."""
        return sum(not f.done() for f in self._waiters)

    def can_admit(self) -> bool:
        """Return whether `acquire` would run or queue a request now (rather than refuse it)."""
        return (
            self.num_running < self.limits.max_running or self.num_waiting < self.limits.max_waiting
        )

    async def acquire(self) -> None:
        """Take a running slot, waiting in line for one if needed.

        Raises:
            OverloadedError: Every slot runs and the waiting line is full.
        """
        if self.num_running < self.limits.max_running and not self.num_waiting:
            self.num_running += 1
            return
        if self.num_waiting >= self.limits.max_waiting:
            raise OverloadedError(
                f"the server is at capacity ({self.num_running} running, {self.num_waiting} "
                "waiting): "
                f"retry after {self.limits.retry_after_s} s",
                retry_after_s=self.limits.retry_after_s,
            )
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(future)
        try:
            await future  # `release` hands its slot over: `num_running` stays as it was
        except asyncio.CancelledError:
            if future.done() and not future.cancelled():
                self.release()  # the slot arrived as we were cancelled: pass it on
            else:
                with contextlib.suppress(ValueError):
                    self._waiters.remove(future)
            raise

    def release(self) -> None:
        """Give a running slot back: to the first waiter, else to the pool."""
        while self._waiters:
            future = self._waiters.popleft()
            if not future.done():
                future.set_result(None)
                return
        self.num_running -= 1
