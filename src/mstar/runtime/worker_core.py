"""The worker's work: host node engines, run walk shares, move values to peer workers.

The `Worker` actor wraps this with messages. One worker runs per device (rank); it hosts
an engine for every node placed on its rank, runs its share of each walk it is told to
start (a `WalkRunner` task per walk instance), hands values for other ranks to the outbox,
and reports emissions, stream items and walk completion to the conductor.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import os
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterable, Mapping
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import structlog
import torch

from mstar.engines.kv_cache import budget_bytes
from mstar.engines.kv_node import KVNodeEngine
from mstar.engines.layers import deterministic_products, make_deterministic
from mstar.engines.limits import NodeLimits
from mstar.engines.parallel import (
    GlooGroup,
    ShmGroup,
    TensorParallelError,
    TensorParallelFollower,
    TensorParallelGroup,
    TensorParallelRankLostError,
    TensorShard,
    sharded,
    supports_tensor_parallel,
)
from mstar.engines.stateless import StatelessEngine, StatelessEngineConfig
from mstar.engines.step_loop import StepExecutor
from mstar.engines.step_times import WalkStepTimes
from mstar.errors import KVCacheCapacityError, MStarError, PlacementError, WorkerUnavailableError
from mstar.graph import Emission, ModelGraph, StreamingGraphEdge
from mstar.runtime.conductor_core import StartWalk
from mstar.runtime.model import EngineType, Model, supports_shared_engines
from mstar.runtime.placement import TensorParallelRole
from mstar.runtime.walk_runner import ValueKey, WalkRunner
from mstar.transport.janitor import SHM_DIR

__all__ = [
    "ENGINE_FACTORIES",
    "EngineFactory",
    "NodeEngine",
    "WorkerConfig",
    "WorkerCore",
    "WorkerOutbox",
    "kv_cache_budgets",
]

_log = structlog.get_logger(__name__)

Slot = tuple[str, str]
_RunKey = tuple[str, int]  # (request id, walk seq)

# Remember this many released requests, to drop values that were in flight to them.
_TOMBSTONES = 4096


class NodeEngine(Protocol):
    """What a worker needs of a node's engine (`StatelessEngine`, `KVNodeEngine`)."""

    @property
    def num_pending(self) -> int:
        """Return how many firings wait or run."""
        ...

    def start(self) -> None:
        """Start stepping on the running event loop."""
        ...

    async def aclose(self) -> None:
        """Stop; pending firings fail."""
        ...

    def submit(
        self, request_id: str, inputs: Mapping[str, Any], walk: str = ""
    ) -> Awaitable[Mapping[str, Any]]:
        """Fire the node for one request, as part of ``walk`` (batched with others)."""
        ...

    def abort(self, request_id: str) -> Any:
        """Drop everything held for a request."""
        ...

    def stats(self) -> Mapping[str, float]:
        """Return cumulative counters: steps, batched inputs, seconds in steps, ..."""
        ...

    def limits(self) -> NodeLimits | None:
        """Return what the engine accepts (None: no length limit), fixed at start."""
        ...

    @property
    def walk_times(self) -> WalkStepTimes:
        """Return the step times per walk (a mixed batch counts under each of its walks)."""
        ...

    @property
    def num_requests(self) -> int:
        """Return how many requests (or their sequences) hold state here between firings."""
        ...


class WorkerOutbox(Protocol):
    """Where a worker's messages go."""

    def walk_done(
        self, request_id: str, walk_seq: int, rank: int, persisted: dict[Slot, Any]
    ) -> None:
        """Tell the conductor this rank finished its share of a walk."""
        ...

    def walk_failed(self, request_id: str, walk_seq: int, rank: int, error: Exception) -> None:
        """Tell the conductor a walk failed here."""
        ...

    def emitted(self, request_id: str, emission: Emission) -> None:
        """Send an emission to the conductor."""
        ...

    def stream_item(self, request_id: str, slot: Slot, value: Any) -> None:
        """Send a stream item to the conductor."""
        ...

    def node_values(
        self, rank: int, request_id: str, walk_seq: int, items: list[tuple[ValueKey, Any]]
    ) -> None:
        """Send values to the worker of another rank."""
        ...


@dataclass(frozen=True)
class WorkerConfig:
    """How a worker runs its engines.

    Attributes:
        device: Torch device of this rank ("cpu", "cuda:0").
        offload_steps: Run engine steps on a thread of their own so the event loop never
            blocks on device work (False runs them inline: lowest latency for tiny nodes).
        stateless: Batching limits of stateless engines.
        num_threads: Torch intra-op threads of this worker's engine steps (None: leave as
            is). Torch keeps the setting per thread: with `offload_steps` it applies to the
            rank's step thread only, so ranks sharing a process share its cores without
            oversubscribing them; otherwise to the event loop's thread.
        freeze_gc: Once the engines are built, collect garbage and freeze what lives out of
            the collector's full passes (a worker process; see `EngineConfig.freeze_gc`).
        kv_cache_memory: KV-cache budget of this rank, shared by its KV-cache nodes: bytes
            (int) or a fraction of the device's free memory at start (float). None: a lone
            KV node sizes its own cache (its `KVCacheEngineConfig`); several split the
            device default (0.8 of free memory on CUDA, min(1 GiB, 0.25) on a CPU).
        kv_cache_shares: Node -> fraction of the rank's budget (the rest is split evenly
            among the KV nodes not named); they must add up to at most 1.
        deterministic: Serve deterministically (see `EngineConfig.deterministic`): weights
            load under `deterministic_products`, KV-cache engines compute each row on its
            own, stateless engines run one input at a time.
        tensor_parallel: The tensor-parallel groups this rank is in (see
            `mstar.engines.parallel`): it leads a group's nodes (their engines run here) or
            follows them (it runs the leader's steps on its shard).
        own_process: The worker runs in a process of its own (a worker process, a Ray actor):
            a failure it cannot serve past (a tensor-parallel group whose ranks fell out of
            step) exits the process, and its supervisor restarts it.
    """

    device: str = "cpu"
    offload_steps: bool = True
    stateless: StatelessEngineConfig = field(default_factory=StatelessEngineConfig)
    num_threads: int | None = None
    freeze_gc: bool = False
    kv_cache_memory: int | float | None = None
    kv_cache_shares: dict[str, float] = field(default_factory=dict)
    deterministic: bool = False
    tensor_parallel: tuple[TensorParallelRole, ...] = ()
    own_process: bool = False


EngineFactory = Callable[
    [str, Any, "Executor | None", WorkerConfig, "int | float | None"], NodeEngine
]
"""``factory(node, submodule, step_executor, worker_config, kv_cache_bytes) -> NodeEngine``."""


def _make_stateless(
    node: str,
    module: Any,
    executor: Executor | None,
    config: WorkerConfig,
    _budget: int | float | None,
) -> NodeEngine:
    limits = (
        replace(config.stateless, deterministic=True) if config.deterministic else config.stateless
    )
    return StatelessEngine(node, module, limits, executor)


def _make_kv(
    node: str,
    module: Any,
    executor: Executor | None,
    config: WorkerConfig,
    budget: int | float | None,
    tensor_parallel: TensorParallelGroup | None = None,
) -> NodeEngine:
    try:
        return KVNodeEngine(
            node,
            module,
            executor,
            device=config.device,
            kv_cache_memory=budget,
            deterministic=config.deterministic,
            tensor_parallel=tensor_parallel,
        )
    except KVCacheCapacityError as exc:
        raise KVCacheCapacityError(f"KV-cache node {node!r}: {exc}") from exc


ENGINE_FACTORIES: dict[EngineType, EngineFactory] = {
    EngineType.STATELESS: _make_stateless,
    EngineType.KV_CACHE: _make_kv,
}
"""The one table a worker builds node engines from: an engine type is chosen by the model
(`Model.engine_types`), never by what a submodule happens to offer."""


def kv_cache_budgets(
    kv_nodes: list[str], config: WorkerConfig, device: torch.device
) -> dict[str, int | None]:
    """Return each KV-cache node's cache budget in bytes (None: the node sizes its own).

    Raises:
        KVCacheCapacityError: The shares name another node, are not positive, or add up
            to more than the whole budget.
    """
    shares = dict(config.kv_cache_shares)
    unknown = sorted(set(shares) - set(kv_nodes))
    if unknown:
        raise KVCacheCapacityError(
            f"kv_cache_shares name {unknown}, which are not KV-cache nodes of this rank "
            f"(those are {sorted(kv_nodes)})"
        )
    for node, share in shares.items():
        if not 0.0 < share <= 1.0:
            raise KVCacheCapacityError(
                f"the KV-cache share of node {node!r} must be in (0, 1], got {share}"
            )
    total_share = sum(shares.values())
    if total_share > 1.0 + 1e-9:
        raise KVCacheCapacityError(
            f"the KV-cache shares of {sorted(shares)} add up to {total_share:.3g} of the budget; "
            "they must add up to at most 1"
        )
    if config.kv_cache_memory is None and len(kv_nodes) <= 1 and not shares:
        return dict.fromkeys(kv_nodes)
    num_bytes = budget_bytes(config.kv_cache_memory, device)
    rest = [n for n in kv_nodes if n not in shares]
    each_rest = (1.0 - total_share) / len(rest) if rest else 0.0
    return {n: int(num_bytes * shares.get(n, each_rest)) for n in kv_nodes}


class _Ports:
    """The `WalkPorts` of one walk instance."""

    __slots__ = ("request_id", "walk", "walk_seq", "worker")

    def __init__(self, worker: WorkerCore, request_id: str, walk: str, walk_seq: int) -> None:
        self.worker, self.request_id, self.walk, self.walk_seq = worker, request_id, walk, walk_seq

    def fire(self, node: str, inputs: Mapping[str, Any]) -> Awaitable[Mapping[str, Any]]:
        return self.worker.engines[node].submit(self.request_id, inputs, self.walk)

    def loop(
        self,
        node: str,
        inputs: Mapping[str, Any],
        max_iters: int | None,
        sink: Callable[[Mapping[str, Any]], None],
    ) -> Awaitable[None] | None:
        engine = self.worker.engines[node]
        if isinstance(engine, KVNodeEngine) and engine.has_native_loop:
            return engine.run(self.request_id, inputs, max_iters, sink, self.walk)
        return None

    def send(self, rank: int, items: list[tuple[ValueKey, Any]]) -> None:
        self.worker.outbox.node_values(rank, self.request_id, self.walk_seq, items)

    def emit(self, node: str, name: str, modality: str, value: Any) -> None:
        part = self.worker.graph.node_partition[node]
        self.worker.outbox.emitted(
            self.request_id, Emission(part, self.walk, node, name, modality, value)
        )

    def stream(self, node: str, edge: StreamingGraphEdge, value: Any) -> None:
        self.worker.outbox.stream_item(self.request_id, (edge.dst, edge.name), value)


class WorkerCore:
    """Engines and walk shares of one rank; an async context manager."""

    def __init__(
        self,
        rank: int,
        model: Model,
        graph: ModelGraph,
        placement: Mapping[tuple[str, str], tuple[int, ...]],
        outbox: WorkerOutbox,
        config: WorkerConfig | None = None,
    ) -> None:
        self.rank, self.model, self.graph, self.outbox = rank, model, graph, outbox
        self.config = config or WorkerConfig()
        self.node_names = sorted({node for (node, _), ranks in placement.items() if rank in ranks})
        self.engines: dict[str, NodeEngine] = {}  # by node; a hosted node maps to its host's engine
        # node -> the node whose engine it runs on (`SupportsSharedEngines`)
        self.hosted: dict[str, str] = {}
        self.runners: dict[_RunKey, WalkRunner] = {}
        self.tasks: dict[_RunKey, asyncio.Task[None]] = {}
        self.early: dict[_RunKey, list[tuple[ValueKey, Any]]] = {}
        self._released: OrderedDict[str, int] = OrderedDict()  # request -> last walk seq released
        self._executor: ThreadPoolExecutor | None = None
        # node -> (its tensor-parallel group, its shard, where the placement declares it)
        self._shards: dict[str, tuple[TensorParallelGroup, TensorShard, str]] = {}
        self.followers: dict[str, TensorParallelFollower] = {}  # nodes this rank follows

    async def __aenter__(self) -> WorkerCore:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def start(self) -> None:
        """Build this rank's node engines."""
        threads = self.config.num_threads
        if self.config.offload_steps:
            # A new thread's OpenMP pool starts at every core, whatever this thread's torch
            # setting says: the step thread takes the setting explicitly (this thread's, when
            # the config names none), or it would oversubscribe the cores next to the loop.
            self._executor = StepExecutor(
                thread_name_prefix=f"mstar-rank{self.rank}",
                initializer=functools.partial(
                    torch.set_num_threads, threads or torch.get_num_threads()
                ),
            )
        elif threads is not None:
            torch.set_num_threads(threads)
        device = torch.device(self.config.device)
        types = self.model.engine_types()
        for node in self.node_names:
            if types.get(node) not in ENGINE_FACTORIES:
                raise MStarError(
                    f"node {node!r} has engine type {types.get(node)!r}; expected one of "
                    f"{[t.value for t in EngineType]}"
                )
        if supports_shared_engines(self.model):
            hosts = self.model.engine_hosts()
            self.hosted = {
                n: hosts[n] for n in self.node_names if n in hosts and hosts[n] in self.node_names
            }
        owned = [n for n in self.node_names if n not in self.hosted]
        budgets = kv_cache_budgets(
            [n for n in owned if types[n] == EngineType.KV_CACHE], self.config, device
        )
        self._join_tensor_parallel(types, device)
        for node in owned:
            module = await self._load(node, device)
            if self.config.deterministic and types[node] == EngineType.KV_CACHE:
                # Stateless nodes run one input at a time; a KV node's rows share products.
                make_deterministic(module.model)  # the network its engine steps
            if node in self._shards:
                engine = _make_kv(
                    node,
                    module,
                    self._executor,
                    self.config,
                    budgets.get(node),
                    tensor_parallel=self._shards[node][0],
                )
            else:
                engine = ENGINE_FACTORIES[types[node]](
                    node, module, self._executor, self.config, budgets.get(node)
                )
            engine.start()
            self.engines[node] = engine
        for node, (group, _, _) in self._shards.items():
            if group.rank == 0:
                continue
            module = await self._load(node, device)
            if self.config.deterministic:
                make_deterministic(module.model)
            follower = TensorParallelFollower(
                node,
                module.model,
                group,
                device,
                num_threads=self.config.num_threads,
                on_failure=self._follower_failed,
            )
            follower.start()
            self.followers[node] = follower
        for node, host in self.hosted.items():
            self.engines[node] = self.engines[host]
        if self.config.freeze_gc:
            gc.collect()
            gc.freeze()

    def _join_tensor_parallel(self, types: Mapping[str, EngineType], device: torch.device) -> None:
        """Join the tensor-parallel groups this rank is in (their shared memory, or gloo).

        A node whose host is in the same group (`SupportsSharedEngines`) steps on the host's
        sharded engine: it takes no group (nor shard, nor follower) of its own.
        """
        hosts = self.model.engine_hosts() if supports_shared_engines(self.model) else {}
        for role in self.config.tensor_parallel:
            if self.rank not in role.ranks:
                continue
            index, world = role.ranks.index(self.rank), len(role.ranks)
            owned = [n for n in role.nodes if hosts.get(n) not in role.nodes]
            if role.store is not None and len(owned) > 1:
                raise PlacementError(
                    f"{role.source}: a tensor-parallel group across machines shards one node"
                )
            for i, node in enumerate(role.nodes):
                if types.get(node) != EngineType.KV_CACHE:
                    raise PlacementError(
                        f"{role.source}: tensor_parallel shards KV-cache nodes; {node!r} is not one"
                    )
                if hosts.get(node) in role.nodes:
                    continue
                group: TensorParallelGroup
                if role.store is not None:  # over machines: torch.distributed's gloo
                    group = GlooGroup(
                        index, world, store=role.store, prefix=role.channel, device=device
                    )
                else:
                    path = SHM_DIR / f"{role.channel}.{i}"
                    group = ShmGroup(path, index, world, ranks=role.ranks)
                self._shards[node] = (group, TensorShard(index, world, group), role.source)

    def _follower_failed(self, error: BaseException) -> None:
        """A tensor-parallel group this rank follows cannot serve again: in a process of its own,
        exit (the supervisor restarts the group as a unit); in-process, its leader's steps fail."""
        if self.config.own_process:
            _log.error("tensor_parallel_group_failed", rank=self.rank, error=repr(error))
            os._exit(70)

    async def _load(self, node: str, device: torch.device) -> Any:
        """Build a node's module (its shard, where the node is sharded)."""
        part = self._shards.get(node)
        shard = part[1] if part is not None else None
        # Loading weights takes seconds: off the event loop, which must keep heartbeating.
        with deterministic_products(self.config.deterministic), sharded(shard):
            try:
                module = await asyncio.to_thread(self.model.submodule, node, device)
            except TensorParallelError as exc:
                raise PlacementError(f"{part[2] if part else node}: {exc}") from None
        if shard is not None:
            model = module.model
            if not supports_tensor_parallel(model) or model.tensor_shard != shard:
                raise PlacementError(
                    f"{part[2] if part else node}: node {node!r}'s network "
                    f"({type(model).__name__}) does not support tensor parallelism"
                )
        return module

    async def aclose(self) -> None:
        """Cancel running walks and close the engines."""
        for task in list(self.tasks.values()):
            task.cancel()
        await asyncio.gather(*self.tasks.values(), return_exceptions=True)
        for follower in self.followers.values():
            await asyncio.to_thread(follower.close)
        for engine in self.owned_engines.values():
            await engine.aclose()
        for group, _, _ in self._shards.values():
            if group.leader is not None:
                group.leader.stop()  # the followers' loops end
            group.close()
        if self._executor is not None:
            self._executor.shutdown(wait=True)

    @property
    def owned_engines(self) -> dict[str, NodeEngine]:
        """Return each engine once, under the node that owns it (hosted nodes left out)."""
        return {name: engine for name, engine in self.engines.items() if name not in self.hosted}

    async def settle(self, timeout: float = 5.0) -> None:
        """Wait (bounded) until the releases received so far are applied in every engine."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                for engine in self.owned_engines.values():
                    if isinstance(engine, KVNodeEngine):
                        await engine.wait_released()

    def held_state(self) -> dict[str, int]:
        """Count what this worker holds for requests (all zero when idle; see `settle`)."""
        counts = {
            "runners": len(self.runners),
            "tasks": len(self.tasks),
            "early_values": len(self.early),
        }
        for name, engine in self.owned_engines.items():
            counts[f"pending:{name}"] = engine.num_pending
            counts[f"requests:{name}"] = engine.num_requests
        return counts

    # --- messages ------------------------------------------------------------------------

    def start_walk(self, cmd: StartWalk) -> None:
        """Start this rank's share of a walk."""
        key = (cmd.request_id, cmd.walk_seq)
        if self._is_released(cmd.request_id, cmd.walk_seq):
            return
        ports = _Ports(self, cmd.request_id, cmd.walk, cmd.walk_seq)
        runner = WalkRunner(
            self.graph, cmd.walk, self.rank, cmd.node_ranks, cmd.initial, ports, cmd.request_id
        )
        self.runners[key] = runner
        self.tasks[key] = asyncio.get_running_loop().create_task(
            self._run(key, runner), name=f"walk:{key}"
        )
        for value_key, value in self.early.pop(key, ()):
            runner.deliver(value_key, value)

    def deliver(
        self, request_id: str, walk_seq: int, items: Iterable[tuple[ValueKey, Any]]
    ) -> None:
        """Accept values from another rank's share of a walk."""
        runner = self.runners.get((request_id, walk_seq))
        if runner is not None:
            deliver = runner.deliver
            for key, value in items:
                deliver(key, value)
        elif not self._is_released(request_id, walk_seq):
            self.early.setdefault((request_id, walk_seq), []).extend(items)

    def release(self, request_id: str, up_to_seq: int) -> None:
        """Drop everything held for a request's walks up to ``up_to_seq``."""
        self._released[request_id] = up_to_seq
        self._released.move_to_end(request_id)
        while len(self._released) > _TOMBSTONES:
            self._released.popitem(last=False)
        for key in [k for k in self.tasks if k[0] == request_id and k[1] <= up_to_seq]:
            self.tasks.pop(key).cancel()
            self.runners.pop(key, None)
        for key in [k for k in self.early if k[0] == request_id and k[1] <= up_to_seq]:
            del self.early[key]
        for engine in self.owned_engines.values():
            engine.abort(request_id)

    def _is_released(self, request_id: str, walk_seq: int) -> bool:
        return walk_seq <= self._released.get(request_id, 0)

    async def _run(self, key: _RunKey, runner: WalkRunner) -> None:
        request_id, walk_seq = key
        try:
            persisted = await runner.run()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self._forget(key)
            self.outbox.walk_failed(request_id, walk_seq, self.rank, _rank_lost(exc) or exc)
            return
        self._forget(key)
        self.outbox.walk_done(request_id, walk_seq, self.rank, persisted)

    def _forget(self, key: _RunKey) -> None:
        self.runners.pop(key, None)
        self.tasks.pop(key, None)


def _rank_lost(error: BaseException) -> WorkerUnavailableError | None:
    """Return the error of the lost rank a walk's failure comes from, if it does.

    A rank of a tensor-parallel group that dies is noticed by its conductor's watchdog and by
    the group's next collective, in either order; the request fails the same way both times.
    """
    seen: set[int] = set()
    cause: BaseException | None = error
    while cause is not None and id(cause) not in seen:
        if isinstance(cause, TensorParallelRankLostError):
            return WorkerUnavailableError(
                f"the worker of rank {cause.rank} died ({cause})", rank=cause.rank
            )
        seen.add(id(cause))
        cause = cause.__cause__ or cause.__context__
    return None
