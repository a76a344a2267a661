"""`StreamBuffer`: the consumer side of a streaming edge, applying a chunk policy."""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar, overload

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


class _Buffered(Sequence[T]):
    """The buffered items as a policy sees them: indexed by absolute stream position."""

    __slots__ = ("_buffer",)

    def __init__(self, buffer: StreamBuffer[T]) -> None:
        self._buffer = buffer

    def __len__(self) -> int:
        return self._buffer.num_items

    @overload
    def __getitem__(self, index: int) -> T: ...

    @overload
    def __getitem__(self, index: slice) -> Sequence[T]: ...

    def __getitem__(self, index: int | slice) -> T | Sequence[T]:
        buf = self._buffer
        if isinstance(index, slice):
            start, stop, step = index.indices(buf.num_items)
            if start < buf._base:
                raise IndexError(f"stream positions before {buf._base} were already dropped")
            return buf._items[start - buf._base : stop - buf._base : step]
        if index < 0:
            index += buf.num_items
        if not buf._base <= index < buf.num_items:
            raise IndexError(
                f"stream position {index} is not buffered ({buf._base}..{buf.num_items})"
            )
        return buf._items[index - buf._base]


class StreamBuffer(Generic[T]):
    """Collect items from a producer; hand out chunks as the policy allows.

    Pure and synchronous: ``put`` appends, ``close`` marks the producer done, ``pop_ready``
    returns (and consumes) the chunks ready now, and ``next_chunk`` hands them out one at a
    time, as a consumer walk takes them. Items no future chunk can contain are dropped, so
    memory stays bounded by the policy's window, not the stream length.
    """

    __slots__ = (
        "_base",
        "_closed",
        "_final_sent",
        "_items",
        "_ready",
        "_view",
        "num_chunks",
        "num_delivered",
        "num_items",
        "policy",
    )

    def __init__(self, policy: ChunkPolicy) -> None:
        self.policy = policy
        self._items: list[T] = []
        self._base = 0  # absolute index of self._items[0]
        self._view = _Buffered(self)
        self._ready: deque[Chunk[T]] = deque()
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
            raise RuntimeError(
                "StreamBuffer.put after close(): the producer already signalled done"
            )
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

    @property
    def is_over(self) -> bool:
        """Return whether no chunk will ever come: drained, unless the policy continues after
        done."""
        return self._final_sent and not self._ready and not self.policy.continue_after_done

    def next_chunk(self) -> Chunk[T] | None:
        """Return the next chunk for one consumer firing, or None when none is ready yet.

        Once the stream is drained, a policy with ``continue_after_done`` gets an empty final
        chunk at every call; otherwise None, and `is_over` is true.
        """
        if not self._ready:
            self._ready.extend(self.pop_ready())
        if self._ready:
            return self._ready.popleft()
        if self._final_sent and self.policy.continue_after_done:
            return Chunk((), self.num_items, 0, True)
        return None

    def pop_ready(self) -> list[Chunk[T]]:
        """Return and consume the chunks ready now (possibly none)."""
        chunks: list[Chunk[T]] = list(self._ready)
        self._ready.clear()
        policy = self.policy
        while (
            window := policy.next_window(self._view, self.num_delivered, self.num_chunks)
        ) is not None:
            start, end = window
            if not self._base <= start <= self.num_delivered < end <= self.num_items:
                raise ValueError(
                    f"{policy} chose the window [{start}, {end}) of {self.num_items} "
                    "buffered items "
                    f"({self.num_delivered} delivered, positions before {self._base} "
                    "dropped): a window "
                    "must bring new buffered items and skip none"
                )
            chunks.append(self._take(start, end, is_last=False))
        if self._closed and not self._final_sent:
            start = policy.final_start(self.num_items, self.num_delivered)
            if self.num_delivered == self.num_items:
                start = self.num_items  # nothing new: an end-of-stream marker
            elif not self._base <= start <= self.num_delivered:
                raise ValueError(
                    f"{policy} chose the final start {start} ({self.num_delivered} delivered, "
                    f"positions before {self._base} dropped): it must skip no item"
                )
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
