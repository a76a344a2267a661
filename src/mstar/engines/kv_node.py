"""`KVNodeEngine`: a `KVCacheEngine` serving one graph node, inside a worker's event loop.

The node's side of the contract (`KVNode`, `ForwardKVNode`, `KVTurn`, `KVForward`, ...) is in
`mstar.engines.interfaces`.

A KV-cache node keeps each request's cache across walks. Two kinds of work share its steps:

- **token walks** (`KVNode`: an LLM backbone, a talker): a ``prefill`` walk fires the node
  once, and a ``decode`` walk's `DynamicLoop` over the node is the engine's own decode loop
  under continuous batching, with the stop check per request per step. The node turns its
  inputs into a `KVTurn` (tokens to append, how to sample) and each sampled token into
  outputs.
- **forward firings** (`ForwardKVNode`: a denoiser over a context, an action expert over a
  prefix, a world model's frames): each firing is a `KVForward`, one `KVChunk` per sequence
  of the request (``""`` is the request's own; others are its branches or rollout rows),
  each appending inputs (tokens or a payload, any mask, any expert), or querying a cache
  read-only, optionally after a reset or a fork at a mark. The rows come back to the node,
  which makes the firing's outputs. Firings of all requests pending at a step run in it.

A node may offer both (BAGEL: decode text natively, denoise by firings). All engine calls
happen on one thread (the step executor), between steps, so the event loop never blocks on
device work and never races the step in flight.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Executor
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from mstar.engines.interfaces import (
    FiringRows,
    ForwardKVNode,
    KVChunk,
    KVNode,
    KVTurn,
    supports_forward_walks,
    supports_token_walks,
)
from mstar.engines.kv_engine import KVCacheEngine
from mstar.engines.limits import NodeLimits
from mstar.engines.parallel import TensorParallelGroup
from mstar.engines.sampler import TokenLogprobs
from mstar.engines.sampling_params import SamplingParams
from mstar.engines.sequence import FinishReason, SequenceStatus
from mstar.engines.step_loop import StepExecutor, StepLoop
from mstar.engines.step_overlap import OverlappedSteps, overlap_pays
from mstar.engines.step_times import WalkStepTimes
from mstar.errors import (
    EngineClosedError,
    KVCacheCapacityError,
    RequestAbortedError,
    RequestNotFoundError,
)

__all__ = ["KVNodeEngine", "seq_key"]


@dataclass
class _Walk:
    """A walk running here: its sink gets each step's outputs; `done` ends it."""

    sink: Callable[[Mapping[str, Any]], None]
    done: asyncio.Future[None]
    name: str


@dataclass
class _PrefixGroup:
    """A prompt computed once for a group of requests, and the requests waiting to fork it."""

    prompt: list[int]
    pending: list[tuple[str, SamplingParams]] = field(default_factory=list)


def _group_key(group: str) -> str:
    """Return the engine id of a prefix group's shared sequence."""
    return f"{group}#prefix"


@dataclass
class _Firing:
    """A forward firing waiting for its chunks' rows (keyed by engine sequence id)."""

    request_id: str
    inputs: Mapping[str, Any]
    done: asyncio.Future[Mapping[str, Any]]
    name: str
    keys: list[str]
    rows: dict[str, torch.Tensor | None] = field(default_factory=dict)


_StepResult = tuple[str, list[int], list[int] | None, Any, list[TokenLogprobs] | None]
"""Per sequence of a step: its key, new tokens, its history when its walk ended, the rows it
returned, and its new tokens' log-probabilities when its params ask for them."""

# At most this many event-loop turns are waited for a wave of firings to arrive.
_FIRING_ROUNDS = 16
# At most this long an idle engine waits for the rest of a prefix group (its requests are
# prepared one by one, on other threads too) before computing the shared prompt.
_GROUP_WAIT_S = 0.02


def seq_key(request_id: str, seq: str) -> str:
    """Return the engine id of a request's sequence (``seq`` "" is the request's own)."""
    return request_id if not seq else f"{request_id}/{seq}"


class KVNodeEngine(StepLoop):
    """Continuous batching for one KV-cache node (`start` it, then `aclose` it)."""

    def __init__(
        self,
        node: str,
        kv_node: KVNode | ForwardKVNode,
        executor: Executor | None,
        device: str = "cpu",
        *,
        kv_cache_memory: int | float | None = None,
        deterministic: bool = False,
        tensor_parallel: TensorParallelGroup | None = None,
    ) -> None:
        super().__init__()
        self.node = node
        self.kv_node = kv_node
        config = kv_node.engine_config
        if kv_cache_memory is not None and config.num_blocks is None:
            config = replace(config, kv_cache_memory=kv_cache_memory)
        if deterministic:
            config = replace(config, deterministic=True)
        self.engine = KVCacheEngine(
            kv_node.model, config, device=device, tensor_parallel=tensor_parallel
        )
        self.executor = executor
        self.has_native_loop = supports_token_walks(kv_node)
        self._forward_node = kv_node if supports_forward_walks(kv_node) else None
        self.num_steps = 0
        self.num_batched = 0  # sequences scheduled, over all steps
        self.step_seconds = 0.0
        self.walk_times = WalkStepTimes()  # per walk: the steps its sequences ran in
        self._walks: dict[str, _Walk] = {}
        self._firings: dict[str, _Firing] = {}  # by engine sequence id (a query's own id)
        self._keys: dict[str, set[str]] = {}  # request -> engine ids of its sequences
        self._query_ids = itertools.count()
        self._release_after: set[str] = set()  # sequences dropped once their chunk ran
        self._token_node: Any = kv_node if self.has_native_loop else None
        # by engine id of the shared sequence (step thread only)
        self._groups: dict[str, _PrefixGroup] = {}
        # group -> (arrived, size), on the loop
        self._group_arrivals: dict[str, tuple[int, int]] = {}
        # Engine calls to apply before the next step (appended on the loop, run on the step thread).
        self._ops: collections.deque[tuple[str, Callable[[], object]]] = collections.deque()
        self._steps = OverlappedSteps(
            self.engine.runner, self._step, self._deliver, self._fail_step, self._keep_stepping
        )
        # A step answered firings (set on the step thread, read between its runs): the next
        # step waits for their walks to fire again, so that requests stay in one wave.
        self._answered = False
        self._awaited: set[str] = set()  # requests the last step answered that have not fired again

    def _fail_pending(self, error: EngineClosedError) -> None:
        for walk in self._walks.values():
            _end(walk, error)
        self._walks.clear()
        for firing in self._firings.values():
            _fail(firing, error)
        self._firings.clear()

    def limits(self) -> NodeLimits:
        """Return the cache's limits, fixed when the engine was built."""
        engine = self.engine
        return NodeLimits(engine.max_seq_len, engine.num_blocks, engine.config.block_size)

    def stats(self) -> dict[str, float]:
        """Return cumulative step counters, per-phase seconds and KV-cache occupancy (for
        metrics)."""
        blocks = self.engine.block_manager
        return {
            "steps": self.num_steps,
            "batched": self.num_batched,
            "step_seconds": self.step_seconds,
            "kv_blocks_total": self.engine.num_blocks,
            "kv_blocks_used": self.engine.num_blocks - blocks.num_free_blocks,
            "max_seq_len": self.engine.max_seq_len,
            "prefix_queried_tokens": blocks.prefix_queried_tokens,
            "prefix_hit_tokens": blocks.prefix_hit_tokens,
            **self.engine.runner.phases.snapshot(),
        }

    @property
    def num_pending(self) -> int:
        """Return how many walks and firings run here now."""
        return len(self._walks) + len({id(f) for f in self._firings.values()})

    @property
    def num_requests(self) -> int:
        """Return how many sequences hold state here (running or between walks)."""
        return self.engine.num_requests

    async def submit(
        self, request_id: str, inputs: Mapping[str, Any], walk: str = ""
    ) -> Mapping[str, Any]:
        """Fire the node once for a request: a forward firing, or one sampled token."""
        if self._forward_node is None:
            outputs: list[Mapping[str, Any]] = []
            await self.run(request_id, inputs, 1, outputs.append, walk)
            return outputs[-1]
        return await self._fire(self._forward_node, request_id, inputs, walk)

    async def _fire(
        self, node: ForwardKVNode, request_id: str, inputs: Mapping[str, Any], walk: str
    ) -> Mapping[str, Any]:
        if self._closed:
            raise EngineClosedError(f"engine for node {self.node!r} is closed")
        forward = node.forward(request_id, inputs)
        if not forward.chunks:
            result = node.forward_outputs([FiringRows(request_id, inputs, [])])[0]
            if isinstance(result, BaseException):
                raise result
            return result
        size = self.engine.config.block_size
        reserved = sum(-(-c.reserve_tokens // size) for c in forward.chunks)
        if reserved > self.engine.num_blocks:
            raise KVCacheCapacityError(
                f"a firing of request {request_id!r} reserves {reserved} blocks for its "
                "sequences but the "
                f"KV cache of node {self.node!r} has {self.engine.num_blocks}; raise its "
                "KV-cache budget or send less at once"
            )
        keys: list[str] = []
        for chunk in forward.chunks:
            key = seq_key(request_id, chunk.seq)
            out_key = f"{key}?{next(self._query_ids)}" if chunk.read_only else key
            if out_key in keys and (
                chunk.reset or chunk.fork_from is not None or chunk.truncate is not None
            ):
                raise ValueError(
                    f"a later chunk of sequence {chunk.seq!r} in one firing cannot reset, "
                    "fork or truncate it"
                )
            if out_key in self._firings or out_key in self._walks:
                raise RuntimeError(
                    f"sequence {out_key!r} of node {self.node!r} already runs a walk"
                )
            keys.append(out_key)
        ops = [
            self._chunk_ops(request_id, seq_key(request_id, c.seq), k, c, extends=k in keys[:i])
            for i, (k, c) in enumerate(zip(keys, forward.chunks, strict=True))
        ]
        firing = _Firing(request_id, inputs, asyncio.get_running_loop().create_future(), walk, keys)
        held = self._keys.setdefault(request_id, set())
        for key, chunk in zip(keys, forward.chunks, strict=True):
            self._firings[key] = firing
            held.add(seq_key(request_id, chunk.seq))
        self._awaited.discard(request_id)
        for phase in (0, 1):
            self._ops.extend((key, op[phase]) for key, op in zip(keys, ops, strict=True))
        self._wakeup.set()
        try:
            await firing.done
        finally:
            for key in keys:
                if self._firings.get(key) is firing:
                    del self._firings[key]
        return firing.done.result()

    def _chunk_ops(
        self, request_id: str, key: str, out_key: str, chunk: KVChunk, *, extends: bool = False
    ) -> tuple[Callable[[], object], Callable[[], object]]:
        """Return the engine calls of one chunk: its reset or fork, then its inputs.

        All of a firing's resets and forks run before any of its inputs are appended (a
        branch forked at a mark of a sequence that the same firing extends). A chunk that
        ``extends`` its sequence after an earlier chunk of the same firing appends to that walk.
        """
        engine = self.engine
        output = chunk.output
        args: dict[str, Any] = {
            "mask": chunk.mask,
            "payload": chunk.payload,
            "num_tokens": chunk.num_tokens,
            "expert": chunk.expert,
        }

        def prepare() -> None:
            if chunk.truncate is not None:
                engine.truncate(key, chunk.truncate)
            if chunk.reset or chunk.fork_from is not None:
                engine.abort(key)
            if chunk.fork_from is not None:
                engine.fork(
                    seq_key(request_id, chunk.fork_from),
                    key,
                    num_tokens=chunk.fork_tokens,
                    keep_alive=True,
                )

        def append() -> None:
            if extends:
                engine.extend(key, chunk.token_ids, output_mode=output, **args)
            elif chunk.read_only:
                engine.query(key, out_key, token_ids=chunk.token_ids, **args)
            elif self._holds(key):
                engine.resume(key, chunk.token_ids, output_mode=output, **args)
            else:
                engine.add_request(
                    key,
                    chunk.token_ids or [],
                    keep_alive=True,
                    output_mode=output,
                    reserve_tokens=chunk.reserve_tokens,
                    **args,
                )

        if chunk.release:
            self._release_after.add(out_key)
        return prepare, append

    async def run(
        self,
        request_id: str,
        inputs: Mapping[str, Any],
        max_steps: int | None,
        sink: Callable[[Mapping[str, Any]], None],
        walk: str = "",
    ) -> None:
        """Run up to ``max_steps`` decode steps for a request, calling ``sink`` with each step's
        outputs.

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
        if request_id in self._walks or request_id in self._firings:
            raise RuntimeError(f"request {request_id!r} already runs a walk on node {self.node!r}")
        if self._token_node is None:
            raise RuntimeError(
                f"node {self.node!r} has no token walks (it is fired by forward passes)"
            )
        is_first = not self._holds(request_id)
        turn: KVTurn = self._token_node.turn(request_id, inputs, is_first=is_first)
        if turn.is_done:
            return
        params = turn.sampling_params
        if is_first:  # the whole request must fit, not only this walk's steps
            self.engine.check_length(request_id, len(turn.new_token_ids), params.max_tokens)
        if max_steps is not None:
            params = params.replace(max_tokens=min(params.max_tokens, max_steps))
        running = _Walk(sink, asyncio.get_running_loop().create_future(), walk)
        self._walks[request_id] = running
        self._keys.setdefault(request_id, set()).add(request_id)
        if is_first and self._can_share(turn):
            assert turn.prefix_group is not None
            arrived, _ = self._group_arrivals.get(turn.prefix_group, (0, 0))
            self._group_arrivals[turn.prefix_group] = (arrived + 1, turn.prefix_group_size)
            self._ops.append((request_id, lambda: self._join_group(request_id, turn, params)))
        elif is_first:
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
                        return_rows=turn.return_rows,
                    ),
                )
            )
        else:
            self._ops.append(
                (
                    request_id,
                    lambda: self.engine.resume(
                        request_id,
                        turn.new_token_ids,
                        params,
                        mask=turn.mask,
                        logits_processor=turn.logits_processor,
                        return_rows=turn.return_rows,
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

    async def _gather_groups(self) -> None:
        """Let the requests of the prefix groups just arriving all arrive (bounded), then forget
        them."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + _GROUP_WAIT_S
        turns = 0
        while (
            any(arrived < size for arrived, size in self._group_arrivals.values())
            and loop.time() < deadline
        ):
            await asyncio.sleep(0 if turns < 16 else 0.001)
            turns += 1
        self._group_arrivals.clear()

    @staticmethod
    def _can_share(turn: KVTurn) -> bool:
        """Whether a first walk may fork its group's shared prompt (a plain causal prompt of 2+
        tokens)."""
        plain = turn.mask is None or turn.mask.is_causal
        return (
            turn.prefix_group is not None
            and plain
            and turn.logits_processor is None
            and len(turn.new_token_ids) > 1
        )

    def _join_group(self, request_id: str, turn: KVTurn, params: SamplingParams) -> None:
        """Fork the group's shared prompt for a request, computing it first if nobody did (step
        thread).

        ```
        shared:  [p0 p1 ... p(n-2)]            computed once ("none" output)
        fork i:  [p0 p1 ... p(n-2)] + [p(n-1)]  shared blocks, then its own last token and samples
        ```
        """
        assert turn.prefix_group is not None
        key = _group_key(turn.prefix_group)
        prompt = turn.new_token_ids
        group = self._groups.get(key)
        if group is not None and group.prompt == prompt:
            group.pending.append((request_id, params))
            return
        if group is not None or self.engine.has_request(key):
            # Another prompt under this group's name (or its shared sequence still around): compute
            # alone.
            self.engine.add_request(request_id, prompt, params, keep_alive=True)
            return
        self.engine.add_request(
            key, prompt[:-1], SamplingParams.greedy(1), keep_alive=True, output_mode="none"
        )
        self._groups[key] = _PrefixGroup(list(prompt), [(request_id, params)])

    def _fork_group(self, key: str, failed: list[tuple[str, BaseException]]) -> None:
        """The group's shared prompt is computed: fork it for every waiting request, then drop it
        (step thread)."""
        group = self._groups.pop(key)
        engine = self.engine
        for request_id, params in group.pending:
            if request_id not in self._walks:
                continue  # released meanwhile
            try:
                engine.fork(key, request_id, params, keep_alive=True)
                engine.resume(request_id, group.prompt[-1:], params)
            except Exception as exc:
                engine.abort(request_id)
                failed.append((request_id, exc))
        engine.release(key)

    def _fail_group(
        self, key: str, error: BaseException, failed: list[tuple[str, BaseException]]
    ) -> None:
        """The group's shared prompt failed: so does every request waiting for it (step thread)."""
        group = self._groups.pop(key)
        failed.extend((request_id, error) for request_id, _ in group.pending)
        self.engine.abort(key)

    def release(self, request_id: str) -> None:
        """Drop a request's caches and any walk or firing it runs here (partition done, or
        aborted)."""
        error = RequestAbortedError(f"request {request_id!r} was aborted")
        walk = self._walks.pop(request_id, None)
        if walk is not None:
            _end(walk, error)
        for key in [k for k, f in self._firings.items() if f.request_id == request_id]:
            _fail(self._firings.pop(key), error)
        keys = self._keys.pop(request_id, set())
        keys.add(request_id)
        self._release_after -= keys
        self._awaited.discard(request_id)
        self._ops.append((request_id, lambda: [self.engine.abort(k) for k in keys]))
        if self._forward_node is not None:
            self._forward_node.release(request_id)
        self._wakeup.set()

    abort = release

    async def wait_released(self) -> None:
        """Return once the releases (and other engine calls) queued so far are applied.

        A release frees its blocks on the step thread, before the next step: this waits for
        that, so that what the engine then reports holds nothing of the released requests.
        """
        if self._closed or self._task is None:
            return
        loop = asyncio.get_running_loop()
        applied: asyncio.Future[None] = loop.create_future()

        def mark() -> None:  # runs after every call queued before it
            loop.call_soon_threadsafe(_resolve, applied)

        self._ops.append(("", mark))
        self._wakeup.set()
        await applied

    def _holds(self, key: str) -> bool:
        try:
            return self.engine.get_sequence(key).status is SequenceStatus.PAUSED
        except RequestNotFoundError:
            return False

    def _step(self) -> tuple[list[tuple[str, BaseException]], list[_StepResult], bool]:
        """Apply queued engine calls, then run one step (on the step thread).

        Returns failed engine calls; per sequence the new tokens, when its walk ended the
        sequence's whole history, and the rows it returned; and whether anything in them
        starts or ends a walk (an error, a walk's first token, a walk's end, a firing's
        rows), which is handed over at once.
        """
        failed: list[tuple[str, BaseException]] = []
        while self._ops:  # a deque: the event loop appends while the step thread pops
            key, op = self._ops.popleft()
            try:
                op()
            except Exception as exc:  # a bad request fails alone
                failed.append((key, exc))
        if not self.engine.has_unfinished():
            return failed, [], bool(failed)
        results: list[_StepResult] = []
        urgent = bool(failed)
        engine = self.engine
        for o in engine.step():
            if o.request_id in self._groups:
                if o.error is not None:
                    self._fail_group(o.request_id, o.error, failed)
                elif o.finished:
                    self._fork_group(o.request_id, failed)
                urgent = True
                continue
            if o.error is not None:
                failed.append((o.request_id, o.error))
                urgent = True
                continue
            if o.finished and o.finish_reason is FinishReason.COMPUTED:
                results.append((o.request_id, [], None, o.hidden, None))
                urgent = self._answered = True
                if o.request_id in self._release_after:
                    self._release_after.discard(o.request_id)
                    engine.abort(o.request_id)
                continue
            seq = engine.get_sequence(o.request_id)
            new = list(o.new_token_ids)
            history = list(seq.token_ids) if o.finished else None
            urgent = urgent or history is not None or seq.num_output_tokens == len(new)
            logprobs = None
            if seq.params.logprobs is not None:
                logprobs, seq.logprobs = seq.logprobs[-len(new) :] if new else [], []
            results.append((o.request_id, new, history, o.hidden, logprobs))
        return failed, results, urgent

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if not self._ops and (self.engine.is_stalled or not self.engine.has_unfinished()):
                self._wakeup.clear()
                await self._wakeup.wait()
                await self._gather_firings()
                await self._gather_groups()
            elif self._answered:
                await self._gather_firings()
            self._answered = False
            if self.executor is not None:
                await loop.run_in_executor(self.executor, self._run_steps, loop)
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

    async def _gather_firings(self) -> None:
        """Let a wave of firings arrive (bounded), so that every request in lockstep joins one step.

        Firings come in waves: the walks a step answered fire again (at once, or as new walks
        a few loop turns later, through the conductor), and an upstream batch fires the walks
        it fed. Waited for after an idle spell and after every step that answered firings
        (while other work is queued too): until a whole loop turn brought nothing new and
        every request the last step answered fired again or left.
        """
        if self._forward_node is None:
            return
        seen = -1
        for _ in range(_FIRING_ROUNDS):
            if len(self._ops) == seen and not self._awaited:
                break
            seen = len(self._ops)
            await asyncio.sleep(0)
        self._awaited.clear()

    def _run_steps(self, loop: asyncio.AbstractEventLoop) -> None:
        """Run steps back to back on the step thread (see `OverlappedSteps`)."""
        self._steps.run(loop, overlap=overlap_pays(self.engine.device))

    def _keep_stepping(self) -> bool:
        """Whether the step thread runs another step at once (see `OverlappedSteps`)."""
        engine = self.engine
        has_work = bool(self._ops) or (engine.has_unfinished() and not engine.is_stalled)
        return not self._closed and not self._thread_wanted() and has_work and not self._answered

    def _thread_wanted(self) -> bool:
        """Whether other work waits for the step thread (always assumed when it can't be told:
        an executor other than a `StepExecutor`)."""
        executor = self.executor
        return not isinstance(executor, StepExecutor) or executor.has_waiting_work()

    def _fail_step(self, error: Exception) -> None:
        """The model itself failed: every walk and firing in the step fails."""
        for request_id, walk in list(self._walks.items()):
            del self._walks[request_id]
            _end(walk, error)
        for key, firing in list(self._firings.items()):
            del self._firings[key]
            _fail(firing, error)

    def _deliver(
        self,
        seconds: float,
        failed: list[tuple[str, BaseException]],
        results: list[_StepResult],
    ) -> None:
        """Count a step and hand its tokens, rows (or errors) to the walks and firings that wait."""
        if results:  # a pass that only applied engine calls (releases) computed nothing
            self.num_steps += 1
            self.num_batched += len(results)
            self.step_seconds += seconds
        walks, firings = self._walks, self._firings
        self.walk_times.record(
            seconds,
            [w.name for r in results if (w := walks.get(r[0]) or firings.get(r[0])) is not None],
        )
        for key, error in failed:
            if (walk := walks.pop(key, None)) is not None:
                _end(walk, error)
            elif (firing := firings.get(key)) is not None:
                _fail(firing, error)
        outputs = None if self._token_node is None else self._token_node.outputs
        completed: list[_Firing] = []
        for key, tokens, history, rows, logprobs in results:
            if (firing := firings.get(key)) is not None:
                self._chunk_done(firing, key, rows, completed)
                continue
            if (walk := walks.get(key)) is None or outputs is None:
                continue  # released meanwhile, or its walk failed
            last = len(tokens) - 1
            try:
                for i, token in enumerate(tokens):
                    extra: dict[str, Any] = {}
                    if logprobs is not None:
                        extra["logprobs"] = logprobs[i]
                    if rows is not None and i == 0:
                        extra["rows"] = rows
                    walk.sink(outputs(key, token, history if i == last else None, **extra))
            except Exception as exc:  # the walk's own failure: it ends alone
                del walks[key]
                _end(walk, exc)
                continue
            if history is not None:
                del walks[key]
                _end(walk, None)
        if completed:
            self._complete(completed)

    def _chunk_done(
        self, firing: _Firing, key: str, rows: torch.Tensor | None, completed: list[_Firing]
    ) -> None:
        firing.rows[key] = rows
        if len(firing.rows) == len(set(firing.keys)) and not firing.done.done():
            completed.append(firing)

    def _complete(self, firings: list[_Firing]) -> None:
        """Hand the firings a step completed to the node in one call; resolve each with its
        result."""
        node = self._forward_node
        assert node is not None
        batch = [FiringRows(f.request_id, f.inputs, _chunk_rows(f)) for f in firings]
        self._awaited.update(f.request_id for f in firings)
        try:
            results = node.forward_outputs(batch)
        except Exception as exc:  # the node failed them all
            for firing in firings:
                _fail(firing, exc)
            return
        for firing, result in zip(firings, results, strict=True):
            if isinstance(result, BaseException):
                _fail(firing, result)
            elif not firing.done.done():
                firing.done.set_result(result)


def _chunk_rows(firing: _Firing) -> list[torch.Tensor | None]:
    """Return each chunk's rows: a sequence's come under its last chunk (None under earlier
    ones)."""
    keys = firing.keys
    return [firing.rows[k] if k not in keys[i + 1 :] else None for i, k in enumerate(keys)]


def _end(walk: _Walk, error: BaseException | None) -> None:
    """Finish a walk (with ``error``, or cleanly); nothing happens if it already ended."""
    if not walk.done.done():
        if error is None:
            walk.done.set_result(None)
        else:
            walk.done.set_exception(error)


def _fail(firing: _Firing, error: BaseException) -> None:
    if not firing.done.done():
        firing.done.set_exception(error)


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)
