"""What a benchmark measures: a `Target` turns a request into a stream of output events.

Two kinds exist: `CallableTarget` wraps any async-generator function (the embedded
`AsyncEngine`, a hand-written loop, transformers `generate`, all in this process), and the
HTTP targets in `mstar.bench.http` speak to a server. The client, not the target, stamps
event times, so every target is timed the same way.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterable
from types import TracebackType
from typing import Any, Protocol, Self, runtime_checkable

from mstar.bench.records import BenchRequest, OutputEvent, Usage
from mstar.errors import BenchTargetError

__all__ = ["CallableTarget", "Target", "TargetItem", "as_target"]

TargetItem = OutputEvent | Usage


@runtime_checkable
class Target(Protocol):
    """A system under test, opened once per run with `async with`."""

    name: str

    async def __aenter__(self) -> Self:
        """Acquire what the target needs (HTTP connections, an engine)."""
        ...

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        """Release what `__aenter__` acquired."""
        ...

    def stream(self, request: BenchRequest) -> AsyncIterator[TargetItem]:
        """Send one request; yield its output events as they arrive, and optionally a Usage.

        Raises:
            BenchTargetError: The target answered with an error or a malformed response.
        """
        ...


class CallableTarget:
    """Benchmark an in-process async generator: `async for out in fn(request): ...`.

    Args:
        fn: Called with each `BenchRequest`; returns an async iterator of outputs.
        name: Label of the target in reports.
        to_events: Maps each yielded output to the events (and usage) it stands for; by
            default outputs must already be `OutputEvent`s or `Usage`. An adapter for an
            engine's own output type goes here, e.g. an `AsyncEngine` audio output to one
            audio event of its sample count.
    """

    def __init__(
        self,
        fn: Callable[[BenchRequest], AsyncIterator[Any]],
        *,
        name: str,
        to_events: Callable[[Any], Iterable[TargetItem]] | None = None,
    ) -> None:
        if not callable(fn):
            raise BenchTargetError(f"target {name!r}: {fn!r} is not callable")
        self.name = name
        self._fn = fn
        self._to_events = to_events

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        return None

    async def stream(self, request: BenchRequest) -> AsyncIterator[TargetItem]:
        """Run the wrapped generator on `request` and yield its outputs as events."""
        outputs = self._fn(request)
        if not hasattr(outputs, "__aiter__"):
            raise BenchTargetError(
                f"target {self.name!r}: calling {self._fn!r} returned {type(outputs).__name__}, "
                "not an async iterator; write it as `async def f(request): ... yield ...`"
            )
        try:
            async for output in outputs:
                if self._to_events is not None:
                    for item in self._to_events(output):
                        yield _checked(self.name, item)
                else:
                    yield _checked(self.name, output)
        finally:
            # Close the wrapped generator now, not at garbage collection, so an engine
            # sees a request abandoned mid-stream (error, cancellation) right away.
            close = getattr(outputs, "aclose", None)
            if close is not None:
                await close()


def _checked(name: str, item: object) -> TargetItem:
    if not isinstance(item, OutputEvent | Usage):
        raise BenchTargetError(
            f"target {name!r} yielded {type(item).__name__}; yield OutputEvent or Usage, "
            "or pass `to_events=` to convert its outputs"
        )
    return item


def as_target(name: str, target: Target | Callable[[BenchRequest], AsyncIterator[Any]]) -> Target:
    """Return `target` itself if it is a `Target`, else wrap the callable as a CallableTarget."""
    if isinstance(target, Target):
        return target
    return CallableTarget(target, name=name)
