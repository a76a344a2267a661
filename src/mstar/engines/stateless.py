"""`StatelessEngine`: continuous batching for nodes without cross-step state.

Encoders, decoders, codecs and CFG combines keep nothing between calls, so whatever inputs
are pending for a node, from any requests, can run as one batch. Each step takes up to
``max_batch_size`` pending inputs in arrival order (waiting up to ``max_wait_s`` for the
batch to fill when it is short), runs the node once, and splits the outputs back to the
requests that submitted them. Step times are kept per node and per walk (`WalkStepTimes`).

An engine that runs steps on the event loop's thread and never waits for a batch to fill
steps in a plain loop callback, scheduled when the first input arrives: inputs submitted in
the same loop turn still share a step, and no step task has to be woken per firing.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, Protocol, TypeGuard, runtime_checkable

import torch

from mstar.engines.step_loop import StepLoop
from mstar.engines.step_times import WalkStepTimes
from mstar.errors import EngineClosedError, RequestAbortedError

__all__ = [
    "BatchedNode",
    "StatelessEngine",
    "StatelessEngineConfig",
    "SupportsConcurrentCalls",
    "batched",
    "supports_concurrent_calls",
]


class BatchedNode(Protocol):
    """A node's computation over a batch: one input mapping per request in, one output out."""

    def __call__(self, batch: Sequence[Mapping[str, Any]]) -> Sequence[Mapping[str, Any]]:
        """Run the node on ``batch``; return outputs in the same order."""
        ...


def batched(fn: Callable[[Mapping[str, Any]], Mapping[str, Any]]) -> BatchedNode:
    """Adapt a per-request node callable to the batched interface (a loop over the batch)."""

    def run(batch: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
        return [fn(inputs) for inputs in batch]

    return run


@runtime_checkable
class SupportsConcurrentCalls(Protocol):
    """A `BatchedNode` that may be called from several threads at once (no per-call state
    shared between calls): a deterministic engine then runs a batch's inputs side by side,
    one thread each."""

    supports_concurrent_calls: ClassVar[Literal[True]]


def supports_concurrent_calls(module: object) -> TypeGuard[SupportsConcurrentCalls]:
    """Whether `module` declares `SupportsConcurrentCalls`."""
    return getattr(module, "supports_concurrent_calls", False) is True


def _each_alone(module: BatchedNode, workers: Executor | None) -> BatchedNode:
    """`module` called once per input, on one torch intra-op thread (side by side on `workers`
    where given): each input's outputs as it gets them alone, at any thread count."""

    def one(inputs: Mapping[str, Any]) -> Mapping[str, Any]:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            (out,) = module([inputs])
        finally:
            torch.set_num_threads(threads)
        return out

    def run(batch: Sequence[Mapping[str, Any]]) -> Sequence[Mapping[str, Any]]:
        if workers is None or len(batch) == 1:
            return [one(inputs) for inputs in batch]
        return list(workers.map(one, batch))

    return run


@dataclass(frozen=True)
class StatelessEngineConfig:
    """Batching limits of a `StatelessEngine`.

    Attributes:
        max_batch_size: Most inputs run in one step.
        max_wait_s: How long a short batch waits for more inputs (0: run at once).
        deterministic: Compute each input of a step on its own, on one torch thread
            (deterministic serving: an input's outputs then depend neither on the others nor
            on the thread count, whatever kernels the node's ops pick); a node that supports
            concurrent calls (`SupportsConcurrentCalls`) takes a step's inputs side by side,
            on as many threads as the engine's steps have.
    """

    max_batch_size: int = 32
    max_wait_s: float = 0.0
    deterministic: bool = False

    def __post_init__(self) -> None:
        if self.max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {self.max_batch_size}")
        if self.max_wait_s < 0:
            raise ValueError(f"max_wait_s must be >= 0, got {self.max_wait_s}")


@dataclass
class _Pending:
    request_id: str
    inputs: Mapping[str, Any]
    future: asyncio.Future[Mapping[str, Any]]
    walk: str


class StatelessEngine(StepLoop):
    """Batch a node's pending inputs across requests; an async context manager.

    Args:
        node: The node's name (for errors and metrics).
        module: The node's batched computation.
        config: Batching limits.
        executor: Where steps run; None runs them on the event loop's thread, which suits
            tiny CPU nodes; pass a single-thread executor for real device work so the event
            loop never blocks.
    """

    def __init__(
        self,
        node: str,
        module: BatchedNode,
        config: StatelessEngineConfig | None = None,
        executor: Executor | None = None,
    ) -> None:
        super().__init__()
        self.node = node
        self.config = config or StatelessEngineConfig()
        self.module = module
        self._workers: ThreadPoolExecutor | None = None
        if self.config.deterministic:
            threads = torch.get_num_threads()
            if threads > 1 and supports_concurrent_calls(module):
                self._workers = ThreadPoolExecutor(
                    threads,
                    thread_name_prefix=f"mstar-{node}",
                    initializer=torch.set_num_threads,
                    initargs=(1,),
                )
            self.module = _each_alone(module, self._workers)
        self.executor = executor
        self.num_steps = 0
        self.num_batched = 0  # inputs run, over all steps
        self.step_seconds = 0.0  # time spent in steps
        self.walk_times = WalkStepTimes()
        self._queue: deque[_Pending] = deque()
        self._is_inline = executor is None and self.config.max_wait_s == 0
        self._loop: asyncio.AbstractEventLoop | None = None  # set by `start` when inline
        self._is_step_scheduled = False

    def start(self) -> None:
        """Start stepping on the running event loop."""
        if not self._is_inline:
            super().start()
            return
        if self._loop is None and not self._closed:
            self._loop = asyncio.get_running_loop()
            if self._queue:
                self._schedule_step()

    async def aclose(self) -> None:
        """Stop stepping (see `StepLoop.aclose`) and stop the side-by-side call threads."""
        await super().aclose()
        if self._workers is not None:
            self._workers.shutdown(wait=True)

    async def __aenter__(self) -> StatelessEngine:
        self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def _fail_pending(self, error: EngineClosedError) -> None:
        while self._queue:
            p = self._queue.popleft()
            if not p.future.done():
                p.future.set_exception(error)

    @property
    def num_pending(self) -> int:
        """Return how many inputs wait for a step."""
        return len(self._queue)

    @property
    def num_requests(self) -> int:
        """Return how many requests hold state here between firings: none (stateless)."""
        return 0

    def pending_request_ids(self) -> set[str]:
        """Return the requests with inputs waiting for a step."""
        return {p.request_id for p in self._queue}

    async def submit(
        self, request_id: str, inputs: Mapping[str, Any], walk: str = ""
    ) -> Mapping[str, Any]:
        """Queue one request's inputs (for ``walk``, in step times); return its outputs once the
        batch ran.

        Raises:
            EngineClosedError: The engine is closed.
            RequestAbortedError: The request was aborted before its batch ran.
            Exception: Whatever the node raised for the batch.
        """
        if self._closed:
            raise EngineClosedError(f"engine for node {self.node!r} is closed")
        future: asyncio.Future[Mapping[str, Any]] = (
            self._loop or asyncio.get_running_loop()
        ).create_future()
        self._queue.append(_Pending(request_id, inputs, future, walk))
        if not self._is_inline:
            self._wakeup.set()
        elif self._loop is not None and not self._is_step_scheduled:
            self._schedule_step()
        return await future

    def abort(self, request_id: str) -> int:
        """Drop a request's pending inputs; return how many were dropped."""
        keep: deque[_Pending] = deque()
        dropped = 0
        for p in self._queue:
            if p.request_id == request_id:
                dropped += 1
                if not p.future.done():
                    p.future.set_exception(
                        RequestAbortedError(f"request {request_id!r} was aborted")
                    )
            else:
                keep.append(p)
        self._queue = keep
        return dropped

    def _take_batch(self) -> list[_Pending]:
        queue = self._queue
        if len(queue) == 1:  # the common case at low load: no batch to cut
            p = queue.popleft()
            return [] if p.future.done() else [p]
        n = min(self.config.max_batch_size, len(queue))
        batch = [queue.popleft() for _ in range(n)]
        return [p for p in batch if not p.future.done()]  # cancelled while waiting

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        cfg = self.config
        while True:
            if not self._queue:
                self._wakeup.clear()
                await self._wakeup.wait()
            if cfg.max_wait_s > 0 and len(self._queue) < cfg.max_batch_size:
                deadline = loop.time() + cfg.max_wait_s
                while (
                    len(self._queue) < cfg.max_batch_size and (left := deadline - loop.time()) > 0
                ):
                    self._wakeup.clear()
                    try:
                        await asyncio.wait_for(self._wakeup.wait(), left)
                    except TimeoutError:
                        break
            batch = self._take_batch()
            if batch:
                await self._step(batch)

    async def _step(self, batch: list[_Pending]) -> None:
        try:
            outputs = await self._call([p.inputs for p in batch], [p.walk for p in batch])
        except Exception as exc:
            if len(batch) == 1:
                _fail(batch[0], exc)
                return
            # Rerun one by one so a bad input fails only its own request.
            for p in batch:
                await self._step([p])
            return
        _resolve(batch, outputs)

    async def _call(
        self, inputs: list[Mapping[str, Any]], walks: list[str]
    ) -> Sequence[Mapping[str, Any]]:
        if self.executor is None:
            return self._call_now(inputs, walks)
        start = time.perf_counter()
        try:
            outputs = await asyncio.get_running_loop().run_in_executor(
                self.executor, self.module, inputs
            )
        finally:
            self._record(time.perf_counter() - start, len(inputs), walks)
        self._check(outputs, inputs)
        return outputs

    # --- inline stepping (no executor, no waiting for batches to fill) ------------------------

    def _schedule_step(self) -> None:
        assert self._loop is not None
        self._is_step_scheduled = True
        self._loop.call_soon(self._step_inline)

    def _step_inline(self) -> None:
        """Run every batch pending now (a loop callback, as the step task would in one turn)."""
        self._is_step_scheduled = False
        while self._queue and not self._closed:
            batch = self._take_batch()
            if batch:
                self._step_now(batch)

    def _step_now(self, batch: list[_Pending]) -> None:
        try:
            outputs = self._call_now([p.inputs for p in batch], [p.walk for p in batch])
        except Exception as exc:
            if len(batch) == 1:
                _fail(batch[0], exc)
                return
            # Rerun one by one so a bad input fails only its own request.
            for p in batch:
                self._step_now([p])
            return
        _resolve(batch, outputs)

    def _call_now(
        self, inputs: list[Mapping[str, Any]], walks: list[str]
    ) -> Sequence[Mapping[str, Any]]:
        start = time.perf_counter()
        try:
            outputs = self.module(inputs)
        finally:
            self._record(time.perf_counter() - start, len(inputs), walks)
        self._check(outputs, inputs)
        return outputs

    def _record(self, seconds: float, num_inputs: int, walks: list[str]) -> None:
        self.num_steps += 1
        self.num_batched += num_inputs
        self.step_seconds += seconds
        self.walk_times.record(seconds, walks)

    def _check(self, outputs: Sequence[Mapping[str, Any]], inputs: list[Mapping[str, Any]]) -> None:
        if len(outputs) != len(inputs):
            raise RuntimeError(
                f"node {self.node!r} returned {len(outputs)} outputs for a batch of {len(inputs)}"
            )

    def limits(self) -> None:
        """Return None: a stateless node holds nothing across steps, so it has no length limit."""
        return None

    def stats(self) -> dict[str, float]:
        """Return cumulative step counters (for metrics)."""
        return {
            "steps": self.num_steps,
            "batched": self.num_batched,
            "step_seconds": self.step_seconds,
        }


def _resolve(batch: list[_Pending], outputs: Sequence[Mapping[str, Any]]) -> None:
    for p, out in zip(batch, outputs, strict=True):
        if not p.future.done():
            p.future.set_result(out)


def _fail(p: _Pending, error: Exception) -> None:
    if not p.future.done():
        p.future.set_exception(error)
