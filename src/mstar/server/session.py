"""One engine request as the server sees it: admitted, timed, and never left running.

    stream = RequestStream(state, Request("speech", {...}))
    await stream.start()             # admission (503 when full), then the first output
    async for out in stream.outputs():
        ...
    await stream.aclose()            # aborts the request unless it finished; frees the slot

`start` waits for the first output so that errors the model raises while preparing the
request (bad fields) become a 4xx status before any response byte is sent.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable
from typing import TYPE_CHECKING, TypeVar

import structlog
from starlette.requests import Request as HttpRequest
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from mstar.errors import (
    APIRequestError,
    ClientDisconnectedError,
    InvalidRequestError,
    KVCacheCapacityError,
    OverloadedError,
    RequestAbortedError,
    WalkExecutionError,
)
from mstar.runtime.model import Output, Request

if TYPE_CHECKING:
    from mstar.server.state import ServerState

__all__ = [
    "EngineStreamingResponse",
    "RequestStream",
    "cancel_on_disconnect",
    "open_stream",
    "request_error",
    "run_to_end",
    "status_of",
]

log = structlog.get_logger(__name__)

T = TypeVar("T")


def status_of(exc: BaseException) -> str:
    """Return the `mstar_requests_finished_total` status of a request that raised ``exc``."""
    if isinstance(
        exc, RequestAbortedError | ClientDisconnectedError | asyncio.CancelledError | GeneratorExit
    ):
        return "aborted"
    if isinstance(exc, ValueError):
        return "invalid"
    return "error"


class RequestStream:
    """Run one request through the engine under admission control and metrics."""

    def __init__(
        self, state: ServerState, request: Request, *, sample_rate: int | None = None
    ) -> None:
        self.state = state
        self.request = request
        self.tracker = state.metrics.tracker(request.task, sample_rate=sample_rate)
        self._outputs: AsyncIterator[Output] | None = None
        self._first: Output | None = None
        self._is_admitted = False
        self._is_done = False  # the engine delivered its last output
        self._is_closed = False
        self._status: str | None = None

    @property
    def request_id(self) -> str:
        """Return the engine's id of the request."""
        return self.request.request_id

    async def start(self) -> None:
        """Wait for admission and the first output.

        Raises:
            OverloadedError: No running slot and the waiting line is full, or the server
                is shutting down.
            ValueError: The model rejected the request.
            MStarError: The engine failed the request.
        """
        try:
            if self.state.is_draining:
                raise OverloadedError(
                    "the server is shutting down: retry on another replica", retry_after_s=1
                )
            await self.state.admission.acquire()
        except OverloadedError:
            self._is_closed = True
            self.state.metrics.count_rejected(self.request.task)
            raise
        self._is_admitted = True
        self.state.add_running(self.request_id)
        self._outputs = self.state.engine.generate(self.request)
        try:
            self._first = await anext(self._outputs)
        except StopAsyncIteration:
            self._is_done = True
        except BaseException as exc:
            await self.aclose(status_of(exc))
            raise
        else:
            self.tracker.observe(self._first)

    async def outputs(self) -> AsyncGenerator[Output, None]:
        """Yield every output of the request (the first one included), as it comes."""
        if self._outputs is None:
            raise RuntimeError("call start() first")
        try:
            if self._first is not None:
                first, self._first = self._first, None
                yield first
            while not self._is_done:
                try:
                    out = await anext(self._outputs)
                except StopAsyncIteration:
                    self._is_done = True
                    break
                self.tracker.observe(out)
                yield out
        except BaseException as exc:
            self._status = self._status or status_of(exc)
            raise

    def complete(self) -> None:
        """Mark the request completed though outputs remain (e.g. a stop string was seen)."""
        self._status = "completed"

    async def aclose(self, status: str | None = None) -> None:
        """End the request: abort it in the engine unless it finished, free its slot, record it."""
        if self._is_closed:
            return
        self._is_closed = True
        status = status or self._status or ("completed" if self._is_done else "aborted")
        try:
            if not self._is_done and self._outputs is not None:
                # Closing the engine's generator aborts the request; the explicit abort covers
                # a generator that a cancelled task left mid-step.
                with contextlib.suppress(RuntimeError):
                    await self._outputs.aclose()  # type: ignore[attr-defined]
                await self.state.engine.abort(self.request_id)
        finally:
            self.tracker.finish(status)  # before the slot is freed: an idle server has counted it
            if self._is_admitted:
                self.state.admission.release()
                self.state.discard_running(self.request_id)
            if status != "completed":
                log.info("request_ended", engine_request_id=self.request_id, status=status)


class EngineStreamingResponse(StreamingResponse):
    """A streaming response that always closes its `RequestStream` (client gone or not)."""

    def __init__(
        self, content: AsyncIterator[bytes], stream: RequestStream, **kwargs: object
    ) -> None:
        super().__init__(content, **kwargs)  # type: ignore[arg-type]
        self.stream = stream

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Send the stream; then end the request (aborting it if the client left early)."""
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.stream.aclose()


async def _until_disconnected(request: HttpRequest) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def cancel_on_disconnect(request: HttpRequest, work: Awaitable[T]) -> T:
    """Await ``work``, cancelling it if the client disconnects first.

    Use only once the request body was read (the watcher consumes what the client sends).

    Raises:
        ClientDisconnectedError: The client went away first.
    """
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_until_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watcher
    if not task.done() or task.cancelled():
        raise ClientDisconnectedError("the client disconnected")
    return task.result()


def request_error(exc: BaseException, *, length_param: str = "max_tokens") -> BaseException:
    """Return the error to answer for a request that failed to start.

    The model's rejection (a ValueError) is a 400; a request its KV cache cannot hold (the
    model's own check, or a node's) is a 400 ``context_length_exceeded`` naming
    ``length_param``, since the routes already refused what they could count.
    """
    if isinstance(exc, APIRequestError):
        return exc
    if isinstance(exc, InvalidRequestError):
        return APIRequestError(str(exc), param=exc.param)
    cannot_fit = isinstance(exc, KVCacheCapacityError) or (
        isinstance(exc, WalkExecutionError) and exc.cause == KVCacheCapacityError.__name__
    )
    if cannot_fit:
        reason = exc.reason if isinstance(exc, WalkExecutionError) else str(exc)
        reason = reason.removeprefix(f"node raised {KVCacheCapacityError.__name__}: ")
        return APIRequestError(reason, param=length_param, code="context_length_exceeded")
    if isinstance(exc, ValueError):
        return APIRequestError(str(exc))
    return exc


async def open_stream(
    state: ServerState,
    http: HttpRequest,
    request: Request,
    *,
    sample_rate: int | None = None,
    length_param: str = "max_tokens",
) -> RequestStream:
    """Start ``request``; return its stream once the first output is there.

    Raises:
        APIRequestError: The model rejected the request (400; see `request_error`).
        OverloadedError: The server is at capacity.
        ClientDisconnectedError: The client went away while the request waited.
        MStarError: The engine failed the request.
    """
    stream = RequestStream(state, request, sample_rate=sample_rate)
    try:
        await cancel_on_disconnect(http, stream.start())
    except BaseException as exc:
        await stream.aclose(status_of(exc))
        error = request_error(exc, length_param=length_param)
        if error is exc:
            raise
        raise error from exc
    return stream


async def run_to_end(
    state: ServerState,
    http: HttpRequest,
    requests: list[Request],
    *,
    sample_rate: int | None = None,
) -> list[list[Output]]:
    """Run requests concurrently to the end; return each one's outputs.

    A client that disconnects aborts them all.

    Raises:
        APIRequestError: The model rejected a request (400; see `request_error`).
        OverloadedError: The server is at capacity.
        ClientDisconnectedError: The client went away.
        MStarError: The engine failed a request.
    """
    streams = [RequestStream(state, r, sample_rate=sample_rate) for r in requests]

    async def run(stream: RequestStream) -> list[Output]:
        await stream.start()
        return [out async for out in stream.outputs()]

    async def run_all() -> list[list[Output]]:
        tasks = [asyncio.ensure_future(run(s)) for s in streams]
        try:
            return list(await asyncio.gather(*tasks))
        finally:
            for task in tasks:  # one failed: stop the others before their streams close
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    try:
        return await cancel_on_disconnect(http, run_all())
    except (ValueError, WalkExecutionError) as exc:
        error = request_error(exc)
        if error is exc:
            raise
        raise error from exc
    finally:
        for stream in streams:
            await stream.aclose()
