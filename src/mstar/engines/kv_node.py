"""`KVNodeEngine`: a `KVCacheEngine` serving one graph node, inside a worker's event loop.

A KV-cache node (an LLM backbone, a talker) keeps each request's cache across walks: a
``prefill`` walk fires the node once, and a ``decode`` walk's `DynamicLoop` over the node is
the engine's own decode loop under continuous batching, with the stop check per request per
step. The model side of the node is a `KVNode`: it turns the node's inputs into a `KVTurn`
(the tokens to append and how to sample) and each sampled token into the node's outputs.

All engine calls happen on one thread (the step executor), between steps, so the event
loop never blocks on device work and never races the step in flight.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Executor
from dataclasses import dataclass, replace
from typing import Any, Protocol

import torch

from mstar.engines.kv_engine import KVCacheEngine, KVCacheEngineConfig
from mstar.engines.masks import AttentionMask
from mstar.engines.paged_model import PagedModel
from mstar.engines.sampling_params import SamplingParams
from mstar.engines.sequence import LogitsProcessor, SequenceStatus
from mstar.engines.step_loop import StepLoop
from mstar.engines.step_times import WalkStepTimes
from mstar.errors import EngineClosedError, RequestAbortedError, RequestNotFoundError

__all__ = ["KVNode", "KVNodeEngine", "KVTurn"]


@dataclass(frozen=True)
class KVTurn:
    """What one walk asks of a KV-cache node for one request.

    Attributes:
        new_token_ids: Tokens to append before sampling (the prompt on the first walk, or
            the whole history on a rank that holds no cache for the request; none to continue
            from the last sampled token).
        sampling_params: How to sample; ``max_tokens`` is capped by the walk's step count.
        mask: Attention among the new tokens (default causal).
        logits_processor: Per-step hook on this request's logits (constrained decoding).
        is_done: Nothing more to generate (the history already ends with a stop token, or
            ``max_tokens`` were generated): the walk ends at once, sampling nothing.
    """

    new_token_ids: list[int]
    sampling_params: SamplingParams
    mask: AttentionMask | None = None
    logits_processor: LogitsProcessor | None = None
    is_done: bool = False


class KVNode(Protocol):
    """The model side of a KV-cache node (what `Model.submodule` returns for one)."""

    model: PagedModel
    engine_config: KVCacheEngineConfig

    def turn(self, request_id: str, inputs: Mapping[str, Any], *, is_first: bool) -> KVTurn:
        """Turn the node's inputs for one walk into tokens to append and sampling settings.

        ``is_first`` is True when this engine holds no cache for the request: its first
        walk, or a later walk placed on another rank (the cache is then rebuilt from the
        history the node persists, e.g. decode after prefill on another rank).
        """
        ...

    def outputs(
        self, request_id: str, token_id: int, history: list[int] | None
    ) -> Mapping[str, Any]:
        """Return the node's outputs (and signals) for one sampled token.

        ``history`` (every token of the sequence, prompt first) is given on the walk's last
        token only, and None before; a node looped by a `DynamicLoop` must raise the loop's
        stop signal exactly then, and persists the history for the request's next walk.
        """
        ...


@dataclass
class _Walk:
    """A walk running here: its sink gets each step's outputs; `done` ends it."""

    sink: Callable[[Mapping[str, Any]], None]
    done: asyncio.Future[None]
    name: str


class KVNodeEngine(StepLoop):
    """Continuous batching for one KV-cache node (`start` it, then `aclose` it)."""

    def __init__(
        self, node: str, kv_node: KVNode, executor: Executor | None, device: str | None = None
    ) -> None:
        super().__init__()
        self.node = node
        self.kv_node = kv_node
        self.engine = KVCacheEngine(kv_node.model, kv_node.engine_config, device=device)
        self.executor = executor
        self.num_steps = 0
        self.num_batched = 0  # sequences scheduled, over all steps
        self.step_seconds = 0.0
        self.walk_times = WalkStepTimes()  # per walk: the steps its sequences ran in
        self._walks: dict[str, _Walk] = {}
        # Engine calls to apply before the next step (appended on the loop, run on the step thread).
        self._ops: collections.deque[tuple[str, Callable[[], object]]] = collections.deque()

    def _fail_pending(self, error: EngineClosedError) -> None:
        for walk in self._walks.values():
            _end(walk, error)
        self._walks.clear()

    def stats(self) -> dict[str, float]:
        """Return cumulative step counters and KV-cache occupancy (for metrics)."""
        blocks = self.engine.block_manager
        return {
            "steps": self.num_steps,
            "batched": self.num_batched,
            "step_seconds": self.step_seconds,
            "kv_blocks_total": self.engine.num_blocks,
            "kv_blocks_used": self.engine.num_blocks - blocks.num_free_blocks,
        }

    @property
    def num_pending(self) -> int:
        """Return how many walks run here now."""
        return len(self._walks)

    @property
    def num_requests(self) -> int:
        """Return how many requests hold state here (running or between walks)."""
        return self.engine.num_requests

    async def submit(self, request_id: str, inputs: Mapping[str, Any], walk: str = "") -> Mapping[str, Any]:
        """Fire the node once for a request (one sampled token)."""
        outputs: list[Mapping[str, Any]] = []
        await self.run(request_id, inputs, 1, outputs.append, walk)
        return outputs[-1]

    async def run(
        self,
        request_id: str,
        inputs: Mapping[str, Any],
        max_steps: int | None,
        sink: Callable[[Mapping[str, Any]], None],
        walk: str = "",
    ) -> None:
        """Run up to ``max_steps`` decode steps for a request, calling ``sink`` with each step's outputs.

        ``sink`` runs on the event loop, synchronously while the step's tokens are handed
        out: a step's outputs reach every walk in one pass, with no task switch per token.
        An exception from ``sink`` ends this walk with it. ``walk`` names the walk this runs
        for (step times are kept per walk).

        Raises:
            EngineClosedError: The engine closed.
            RequestAbortedError: The request was released while running.
        """
        if self._closed:
            raise EngineClosedError(f"engine for node {self.node!r} is closed")
        if request_id in self._walks:
            raise RuntimeError(f"request {request_id!r} already runs a walk on node {self.node!r}")
        is_first = not self._holds(request_id)
        turn = self.kv_node.turn(request_id, inputs, is_first=is_first)
        if turn.is_done:
            return
        params = turn.sampling_params
        if max_steps is not None:
            params = replace(params, max_tokens=min(params.max_tokens, max_steps))
        running = _Walk(sink, asyncio.get_running_loop().create_future(), walk)
        self._walks[request_id] = running
        if is_first:
            self._ops.append(
                (
                    request_id,
                    lambda: self.engine.add_request(
                        request_id,
                        turn.new_token_ids,
                        params,
                        mask=turn.mask,
                        keep_alive=True,
                        logits_processor=turn.logits_processor,
                    ),
                )
            )
        else:
            self._ops.append(
                (
                    request_id,
                    lambda: self.engine.resume(
                        request_id, turn.new_token_ids, params, mask=turn.mask
                    ),
                )
            )
        self._wakeup.set()
        try:
            await running.done
        finally:
            if self._walks.get(request_id) is running:
                del self._walks[request_id]
            elif running.done.done() and not running.done.cancelled():
                running.done.exception()  # ended as this task was cancelled: nobody else reads it

    def release(self, request_id: str) -> None:
        """Drop a request's cache and any walk it runs here (partition done, or aborted)."""
        walk = self._walks.pop(request_id, None)
        if walk is not None:
            _end(walk, RequestAbortedError(f"request {request_id!r} was aborted"))
        self._ops.append((request_id, lambda: self.engine.abort(request_id)))
        self._wakeup.set()

    abort = release

    def _holds(self, request_id: str) -> bool:
        try:
            return self.engine.get_sequence(request_id).status is SequenceStatus.PAUSED
        except RequestNotFoundError:
            return False

    def _step(
        self,
    ) -> tuple[list[tuple[str, BaseException]], list[tuple[str, list[int], list[int] | None]], bool]:
        """Apply queued engine calls, then run one step (on the step thread).

        Returns failed engine calls; per request the new tokens and, when its walk ended,
        the sequence's whole history; and whether anything in them starts or ends a walk
        (an error, a walk's first token, a walk's end), which `_steps` hands over at once.
        """
        failed: list[tuple[str, BaseException]] = []
        while self._ops:  # a deque: the event loop appends while the step thread pops
            request_id, op = self._ops.popleft()
            try:
                op()
            except Exception as exc:  # a bad request fails alone
                failed.append((request_id, exc))
        if not self.engine.has_unfinished():
            return failed, [], bool(failed)
        results = []
        urgent = bool(failed)
        for o in self.engine.step():
            seq = self.engine.get_sequence(o.request_id)
            new = list(o.new_token_ids)
            history = list(seq.token_ids) if o.finished else None
            urgent = urgent or history is not None or seq.num_output_tokens == len(new)
            results.append((o.request_id, new, history))
        return failed, results, urgent

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if not self._ops and not self.engine.has_unfinished():
                self._wakeup.clear()
                await self._wakeup.wait()
            if self.executor is not None:
                await loop.run_in_executor(self.executor, self._steps, loop)
                continue
            # Let the walks woken by the last step run (and emit) before the next one: a step
            # on the event loop itself would otherwise starve them, step after step.
            await asyncio.sleep(0)
            start = time.perf_counter()
            try:
                failed, results, _ = self._step()
            except Exception as step_error:
                self._fail_step(step_error)
                continue
            self._deliver(time.perf_counter() - start, failed, results)

    def _steps(self, loop: asyncio.AbstractEventLoop) -> None:
        """Run steps back to back on the step thread; hand each one's results to the loop.

        The next step starts as soon as the last one ends, without a round trip through the
        event loop (which would cost about a millisecond per step while the loop streams
        the last step's tokens). A step's results go to the loop while the next step
        projects its logits: the loop's Python (routing and streaming a token per
        request) then runs while this thread sits in the step's longest kernel, which
        holds no GIL, instead of contending with the step's own Python for it. Results that
        start or end a walk (first tokens, last tokens, errors) go at once, and so does
        everything when no further step follows. The thread is yielded when the engine runs
        dry, when the engine closes, or when another engine of this rank has work queued
        on the thread. (On a CPU whose cores the step's kernels use up, results go at once.)
        """
        pending: list[tuple[float, list[tuple[str, BaseException]], list[Any]]] = []
        loop_closed = False

        def hand_over() -> None:
            nonlocal loop_closed
            if pending:
                try:
                    loop.call_soon_threadsafe(self._deliver, *pending.pop())
                except RuntimeError:  # the loop closed meanwhile: nobody waits for these
                    loop_closed = True

        # Overlapping pays only with a core to spare for the loop: a multi-threaded kernel
        # that shares its cores with the loop's Python waits for its slowest thread.
        overlap = self.engine.device.type != "cpu" or torch.get_num_threads() < _usable_cores()
        runner = self.engine.runner
        runner.before_logits = hand_over if overlap else None
        try:
            while not loop_closed:
                start = time.perf_counter()
                try:
                    failed, results, urgent = self._step()
                except Exception as step_error:
                    hand_over()
                    with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                        loop.call_soon_threadsafe(self._fail_step, step_error)
                    return
                hand_over()  # a step that computed no logits did not take the last results
                pending.append((time.perf_counter() - start, failed, results))
                if urgent or not overlap:  # first tokens and walk ends are not held back
                    hand_over()
                if self._closed or self._thread_wanted() or not (self._ops or self.engine.has_unfinished()):
                    hand_over()
                    return
        finally:
            runner.before_logits = None

    def _thread_wanted(self) -> bool:
        """Whether other work waits for the step thread (always assumed when it can't be told)."""
        queue = getattr(self.executor, "_work_queue", None)
        return queue is None or not queue.empty()

    def _fail_step(self, error: Exception) -> None:
        """The model itself failed: every walk in the step fails."""
        for request_id, walk in list(self._walks.items()):
            del self._walks[request_id]
            _end(walk, error)

    def _deliver(
        self,
        seconds: float,
        failed: list[tuple[str, BaseException]],
        results: list[tuple[str, list[int], list[int] | None]],
    ) -> None:
        """Count a step and hand its tokens (or errors) to the walks that wait for them."""
        self.num_steps += 1
        self.num_batched += len(results)
        self.step_seconds += seconds
        self.walk_times.record(seconds, [self._walks[r[0]].name for r in results if r[0] in self._walks])
        walks = self._walks
        for request_id, error in failed:
            if (walk := walks.pop(request_id, None)) is not None:
                _end(walk, error)
        outputs = self.kv_node.outputs
        for request_id, tokens, history in results:
            if (walk := walks.get(request_id)) is None:
                continue  # released meanwhile, or its walk failed
            last = len(tokens) - 1
            try:
                for i, token in enumerate(tokens):
                    walk.sink(outputs(request_id, token, history if i == last else None))
            except Exception as exc:  # the walk's own failure: it ends alone
                del walks[request_id]
                _end(walk, exc)
                continue
            if history is not None:
                del walks[request_id]
                _end(walk, None)


def _usable_cores() -> int:
    """Return how many cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def _end(walk: _Walk, error: BaseException | None) -> None:
    """Finish a walk (with ``error``, or cleanly); nothing happens if it already ended."""
    if not walk.done.done():
        if error is None:
            walk.done.set_result(None)
        else:
            walk.done.set_exception(error)
