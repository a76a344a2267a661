"""`StreamBuffer`: the consumer side of a streaming edge, applying a chunk policy."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from mstar.streaming.policies import ChunkPolicy

__all__ = ["Chunk", "StreamBuffer"]

T = TypeVar("T")

# Trim delivered items no chunk can need again once this many have piled up (amortised O(1)).
_TRIM_AT = 256


@dataclass(frozen=True, slots=True)
class Chunk(Generic[T]):
    """Consecutive stream items handed to a consumer.

    Attributes:
        items: The items, beginning at absolute stream index ``start``.
        start: Absolute index of ``items[0]`` in the stream.
        context_len: How many leading items were already delivered before (left context).
        is_last: True on the final chunk, after the producer signalled done.
    """

    items: tuple[T, ...]
    start: int
    context_len: int
    is_last: bool

    @property
    def new_items(self) -> tuple[T, ...]:
        """Return the items delivered for the first time."""
        return self.items[self.context_len :]

    @property
    def end(self) -> int:
        """Return the absolute index one past the last item."""
        return self.start + len(self.items)


class StreamBuffer(Generic[T]):
    """Collect items from a producer; hand out chunks as the policy allows.

    Pure and synchronous: ``put`` appends, ``close`` marks the producer done, ``pop_ready``
    returns (and consumes) the chunks ready now. Items no future chunk can contain are
    dropped, so memory stays bounded by the policy's window, not the stream length.
    """

    __slots__ = ("_base", "_closed", "_final_sent", "_items", "num_chunks", "num_delivered", "num_items", "policy")

    def __init__(self, policy: ChunkPolicy) -> None:
        self.policy = policy
        self._items: list[T] = []
        self._base = 0  # absolute index of self._items[0]
        self.num_items = 0
        self.num_delivered = 0
        self.num_chunks = 0
        self._closed = False
        self._final_sent = False

    def put(self, items: Sequence[T]) -> None:
        """Append items from the producer.

        Raises:
            RuntimeError: If the buffer was already closed.
        """
        if self._closed:
            raise RuntimeError("StreamBuffer.put after close(): the producer already signalled done")
        self._items.extend(items)
        self.num_items += len(items)

    def close(self) -> None:
        """Mark the producer done; the next ``pop_ready`` ends with the final chunk."""
        self._closed = True

    @property
    def is_closed(self) -> bool:
        """Return whether the producer signalled done."""
        return self._closed

    @property
    def is_drained(self) -> bool:
        """Return whether the buffer is closed and its final chunk was handed out."""
        return self._final_sent

    def pop_ready(self) -> list[Chunk[T]]:
        """Return and consume the chunks ready now (possibly none)."""
        chunks: list[Chunk[T]] = []
        policy = self.policy
        while (window := policy.next_window(self.num_items, self.num_delivered, self.num_chunks)) is not None:
            chunks.append(self._take(window[0], window[1], is_last=False))
        if self._closed and not self._final_sent:
            start = policy.final_start(self.num_items, self.num_delivered)
            if self.num_delivered == self.num_items:
                start = self.num_items  # nothing new: an end-of-stream marker
            chunks.append(self._take(start, self.num_items, is_last=True))
            self._final_sent = True
        if chunks:
            self._trim()
        return chunks

    def _take(self, start: int, end: int, *, is_last: bool) -> Chunk[T]:
        items = tuple(self._items[start - self._base : end - self._base])
        chunk = Chunk(items, start, max(0, self.num_delivered - start), is_last)
        self.num_delivered = max(self.num_delivered, end)
        self.num_chunks += 1
        return chunk

    def _trim(self) -> None:
        keep_from = self.policy.retained_from(self.num_delivered)
        drop = keep_from - self._base
        if drop >= _TRIM_AT or (self._final_sent and drop > 0):
            del self._items[:drop]
            self._base = keep_from

    def __repr__(self) -> str:
        state = "drained" if self._final_sent else "closed" if self._closed else "open"
        return (
            f"StreamBuffer({self.policy}, items={self.num_items}, "
            f"delivered={self.num_delivered}, {state})"
        )


