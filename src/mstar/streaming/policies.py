"""Chunk policies: when a stream consumer fires, and which items each chunk holds.

`ChunkPolicy` is an open protocol: any object with its three methods and its
``continue_after_done`` attribute is a policy, and a model author may write one beside the
model without touching the runtime (the assistant's sentence policy is one). The
`StreamBuffer` asks the policy, and nothing else decides chunks.

``next_window(items, num_delivered, num_chunks)`` sees the items buffered so far (``items``:
indexed by absolute stream position, ``len(items)`` of them; positions before
``retained_from(num_delivered)`` may be gone), the items already delivered as new
(``num_delivered``) and the chunks fired so far (``num_chunks``). It returns the absolute
``[start, end)`` window of the next chunk, or ``None`` when no chunk is ready; it must not
go back (``end > num_delivered``) and must start no earlier than ``retained_from``. Items of
the window before ``num_delivered`` are left context (``context_len``); the rest are new.
The three policies below look only at counts; a policy may also look at the items.

    SlidingWindowChunkPolicy(window=4, stride=2), 9 items:

        items    0 1 2 3 4 5 6 7 8
        chunk 0  N N N N                  context_len 0
        chunk 1      c c N N              context_len 2
        chunk 2          c c N N          context_len 2
        close              c c c N        last min(window, n) items: context_len 3

    (N = new item, c = left context already delivered)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol, runtime_checkable

__all__ = [
    "ChunkPolicy",
    "FixedChunkPolicy",
    "LeftContextChunkPolicy",
    "SlidingWindowChunkPolicy",
]


@runtime_checkable
class ChunkPolicy(Protocol):
    """When a stream's consumer fires and which items each chunk holds (see the module doc).

    Attributes:
        continue_after_done: Once the producer ended and every item was delivered, the
            consumer's walks keep firing, each given an empty final chunk, and the model's
            walk state machine decides when its partition stops.
    """

    @property
    def continue_after_done(self) -> bool:
        """Whether the consumer keeps firing after the stream is drained."""
        ...

    def next_window(
        self, items: Sequence[Any], num_delivered: int, num_chunks: int
    ) -> tuple[int, int] | None:
        """Return the ``[start, end)`` window of the next chunk, or None when none is ready."""
        ...

    def final_start(self, num_items: int, num_delivered: int) -> int:
        """Return where the final chunk (after the producer ended) starts."""
        ...

    def retained_from(self, num_delivered: int) -> int:
        """Return the first position any later chunk may still hold (earlier ones are dropped)."""
        ...


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


@dataclass(frozen=True, slots=True)
class FixedChunkPolicy:
    """Fire every ``size`` new items; chunks do not overlap.

    Reference semantics (``n`` items, producer done at the end)::

        for k in range(n // size):
            yield Chunk(items[k*size:(k+1)*size], start=k*size, context_len=0, is_last=False)
        rest = (n // size) * size
        yield Chunk(items[rest:], start=rest, context_len=0, is_last=True)

    ``continue_after_done`` keeps the consumer partition running after the producer ends:
    walks that consume this stream keep firing, each given an empty final chunk.
    """

    size: int
    continue_after_done: bool = False

    def __post_init__(self) -> None:
        _require(self.size >= 1, f"FixedChunkPolicy size must be >= 1, got {self.size}")

    def next_window(
        self, items: Sequence[Any], num_delivered: int, num_chunks: int
    ) -> tuple[int, int] | None:
        end = num_delivered + self.size
        return (num_delivered, end) if end <= len(items) else None

    def final_start(self, num_items: int, num_delivered: int) -> int:
        return num_delivered

    def retained_from(self, num_delivered: int) -> int:
        return num_delivered

    def __str__(self) -> str:
        extra = ", continue_after_done=True" if self.continue_after_done else ""
        return f"FixedChunkPolicy(size={self.size}{extra})"


@dataclass(frozen=True, slots=True)
class SlidingWindowChunkPolicy:
    """Fire on windows of ``window`` items that advance by ``stride``.

    Reference semantics (``n`` items, producer done at the end)::

        k = 0
        while k*stride + window <= n:
            yield Chunk(items[k*stride:k*stride + window], start=k*stride,
                        context_len=0 if k == 0 else window - stride, is_last=False)
            k += 1
        delivered = 0 if k == 0 else (k-1)*stride + window
        start = n - min(window, n) if delivered < n else n
        yield Chunk(items[start:], start, context_len=max(0, delivered - start), is_last=True)
    """

    window: int
    stride: int
    continue_after_done: ClassVar[bool] = False

    def __post_init__(self) -> None:
        _require(
            self.window >= 1, f"SlidingWindowChunkPolicy window must be >= 1, got {self.window}"
        )
        _require(
            1 <= self.stride <= self.window,
            f"SlidingWindowChunkPolicy stride must be in [1, window={self.window}], got "
            f"{self.stride}",
        )

    def next_window(
        self, items: Sequence[Any], num_delivered: int, num_chunks: int
    ) -> tuple[int, int] | None:
        start = num_chunks * self.stride
        end = start + self.window
        return (start, end) if end <= len(items) else None

    def final_start(self, num_items: int, num_delivered: int) -> int:
        return num_items - min(self.window, num_items)

    def retained_from(self, num_delivered: int) -> int:
        return max(0, num_delivered - self.window)

    def __str__(self) -> str:
        return f"SlidingWindowChunkPolicy(window={self.window}, stride={self.stride})"


@dataclass(frozen=True, slots=True)
class LeftContextChunkPolicy:
    """Fire every ``chunk`` new items, each preceded by up to ``left_context`` delivered items.

    Reference semantics (``n`` items, producer done at the end)::

        for k in range(n // chunk):
            start = max(0, k*chunk - left_context)
            yield Chunk(items[start:(k+1)*chunk], start, context_len=k*chunk - start,
                        is_last=False)
        delivered = (n // chunk) * chunk
        start = max(0, delivered - left_context) if delivered < n else n
        yield Chunk(items[start:], start, context_len=delivered - start, is_last=True)
    """

    chunk: int
    left_context: int
    continue_after_done: ClassVar[bool] = False

    def __post_init__(self) -> None:
        _require(self.chunk >= 1, f"LeftContextChunkPolicy chunk must be >= 1, got {self.chunk}")
        _require(
            self.left_context >= 0,
            f"LeftContextChunkPolicy left_context must be >= 0, got {self.left_context}",
        )

    def next_window(
        self, items: Sequence[Any], num_delivered: int, num_chunks: int
    ) -> tuple[int, int] | None:
        end = num_delivered + self.chunk
        if end > len(items):
            return None
        return (max(0, num_delivered - self.left_context), end)

    def final_start(self, num_items: int, num_delivered: int) -> int:
        return max(0, num_delivered - self.left_context)

    def retained_from(self, num_delivered: int) -> int:
        return max(0, num_delivered - self.left_context)

    def __str__(self) -> str:
        return f"LeftContextChunkPolicy(chunk={self.chunk}, left_context={self.left_context})"
