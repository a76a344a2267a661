"""`AskTimeouts`: ask deadlines grouped into short buckets, one loop timer per bucket.

A loop timer per ask costs a heap push and, once the reply came, a cancelled handle that
the loop must later sift out; at tens of thousands of asks per second that is a visible
share of a round trip. Here deadlines are rounded up to the next `resolution` step, so all
asks expiring in one step share one timer, and a reply only removes its future from a dict:

    now                 deadline buckets (resolution r)
     |   [t0 .. t0+r) -> {future: ref, ...}  one call_at(t0 + r)
     |   [t1 .. t1+r) -> {...}               one call_at(t1 + r)

An ask thus fails between `timeout` and `timeout + resolution` after it was sent.
"""

from __future__ import annotations

import asyncio
import math
from typing import Any

from mstar.errors import AskTimeoutError

__all__ = ["AskTimeouts"]


class AskTimeouts:
    """Fail pending asks whose timeout passed.

    Args:
        resolution: bucket width in seconds (how late a timeout may fire).
    """

    def __init__(self, resolution: float = 0.005) -> None:
        self.resolution = resolution
        self._buckets: dict[int, dict[asyncio.Future[Any], tuple[object, float]]] = {}

    def add(self, future: asyncio.Future[Any], target: object, timeout: float) -> int:
        """Fail `future` with `AskTimeoutError` unless it is done within `timeout`; return its
        bucket."""
        loop = asyncio.get_running_loop()
        bucket = math.ceil((loop.time() + timeout) / self.resolution)
        entries = self._buckets.get(bucket)
        if entries is None:
            entries = self._buckets[bucket] = {}
            loop.call_at(bucket * self.resolution, self._expire, bucket)
        entries[future] = (target, timeout)
        return bucket

    def discard(self, bucket: int, future: asyncio.Future[Any]) -> None:
        """Forget `future` (it got its answer, or its asker gave up)."""
        entries = self._buckets.get(bucket)
        if entries is not None:
            entries.pop(future, None)

    def _expire(self, bucket: int) -> None:
        for future, (target, timeout) in self._buckets.pop(bucket, {}).items():
            if not future.done():
                future.set_exception(
                    AskTimeoutError(f"no reply from {target!r} within {timeout} s")
                )
