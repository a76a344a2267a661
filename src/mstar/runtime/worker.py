"""The `Worker` actor (one per rank) and the host that builds one in a worker process."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import Any

from mstar.actors import Actor, ActorRef, ActorSystem
from mstar.engines.parallel import TensorParallelFollower
from mstar.errors import MStarError, WalkExecutionError, WorkerUnavailableError
from mstar.graph import Emission, ModelGraph
from mstar.runtime.conductor_core import StartWalk
from mstar.runtime.messages import (
    EmittedMsg,
    InitWorker,
    LimitsQuery,
    LimitsReport,
    NodeValuesMsg,
    ReleaseRequest,
    StartWalkMsg,
    StateQuery,
    StateReport,
    StatsQuery,
    StatsReport,
    StreamItemMsg,
    UpdatePeer,
    WalkDoneMsg,
    WalkFailedMsg,
    WalkStepStats,
    WorkerReady,
)
from mstar.runtime.model import Model, ModelSpec
from mstar.runtime.placement import Placement
from mstar.runtime.trust import check_model_factory
from mstar.runtime.values import from_slots, to_slots
from mstar.runtime.walk_runner import ValueKey
from mstar.runtime.worker_core import NodeEngine, WorkerConfig, WorkerCore
from mstar.wire import ActorId

__all__ = ["HOST_NAME", "Worker", "WorkerHost", "setup_worker_host", "stats_report", "worker_name"]

HOST_NAME = "worker-host"
Slot = tuple[str, str]


def worker_name(rank: int) -> str:
    """Return the actor name of the worker of ``rank``."""
    return f"worker-{rank}"


class Worker(Actor):
    """Hosts the engines of one rank and runs its shares of walks (see `WorkerCore`)."""

    # Values from peer workers are handed to their walk runners as they arrive, without a
    # task switch through the mailbox: in a loop across ranks that is every step.
    immediate_types = frozenset({NodeValuesMsg})

    def __init__(
        self,
        rank: int,
        model: Model,
        graph: ModelGraph,
        placement: Mapping[tuple[str, str], tuple[int, ...]],
        conductor: ActorRef,
        workers: Mapping[int, ActorRef],
        config: WorkerConfig,
    ) -> None:
        self.rank = rank
        self.conductor = conductor
        self.workers = dict(workers)
        self.core = WorkerCore(rank, model, graph, placement, self, config)

    async def on_start(self) -> None:
        """Build this rank's engines."""
        await self.core.start()

    async def on_stop(self) -> None:
        """Cancel walks and close the engines."""
        await self.core.aclose()

    def handle_now(self, message: NodeValuesMsg) -> None:
        """Hand values from a peer worker to the runner of their walk."""
        self.core.deliver(
            message.request_id, message.walk_seq, zip(message.keys, message.values, strict=True)
        )

    async def handle(self, message: Any) -> Any:
        """Start walks, take values from peers, release requests."""
        if isinstance(message, NodeValuesMsg):
            self.handle_now(message)
        elif isinstance(message, StartWalkMsg):
            initial = from_slots(message.initial)
            self.core.start_walk(
                StartWalk(
                    message.request_id,
                    message.walk_seq,
                    message.walk,
                    self.rank,
                    dict(message.node_ranks),
                    initial,
                )
            )
        elif isinstance(message, ReleaseRequest):
            self.core.release(message.request_id, message.up_to_seq)
        elif isinstance(message, UpdatePeer):
            self.workers[message.rank] = self.system.ref(message.worker)
        elif isinstance(message, StateQuery):
            await self.core.settle()  # released blocks are free by now, not at the next step
            return StateReport(self.core.held_state())
        elif isinstance(message, StatsQuery):
            return stats_report(self.core.owned_engines, self.system, self.core.followers)
        elif isinstance(message, LimitsQuery):
            engines = self.core.owned_engines.items()
            return LimitsReport(
                {
                    node: limits
                    for node, engine in engines
                    if (limits := engine.limits()) is not None
                }
            )
        else:
            raise TypeError(f"worker {self.rank} does not handle {type(message).__name__}")
        return None

    # --- WorkerOutbox ------------------------------------------------------------------------
    # Values go into messages as they are: a link to another process converts them.

    def walk_done(
        self, request_id: str, walk_seq: int, rank: int, persisted: dict[Slot, Any]
    ) -> None:
        """Report a finished walk share to the conductor."""
        self.conductor.tell(WalkDoneMsg(request_id, walk_seq, rank, to_slots(persisted)))

    def walk_failed(self, request_id: str, walk_seq: int, rank: int, error: Exception) -> None:
        """Report a failed walk share to the conductor."""
        if isinstance(error, WalkExecutionError):
            kind = type(error).__name__
            msg = WalkFailedMsg(
                request_id, walk_seq, rank, kind, error.reason, error.node, error.walk, error.cause
            )
        elif isinstance(error, WorkerUnavailableError) and error.rank is not None:
            msg = WalkFailedMsg(
                request_id, walk_seq, rank, type(error).__name__, str(error), lost_rank=error.rank
            )
        else:
            msg = WalkFailedMsg(
                request_id, walk_seq, rank, type(error).__name__, f"{type(error).__name__}: {error}"
            )
        self.conductor.tell(msg)

    def emitted(self, request_id: str, emission: Emission) -> None:
        """Send an emission to the conductor."""
        e = emission
        self.conductor.tell(
            EmittedMsg(request_id, e.partition, e.walk, e.node, e.name, e.modality, e.value)
        )

    def stream_item(self, request_id: str, slot: Slot, value: Any) -> None:
        """Send a stream item to the conductor."""
        self.conductor.tell(StreamItemMsg(request_id, slot[0], slot[1], value))

    def node_values(
        self, rank: int, request_id: str, walk_seq: int, items: list[tuple[ValueKey, Any]]
    ) -> None:
        """Send values straight to the worker of another rank (one message)."""
        keys = [key for key, _ in items]
        values = [v for _, v in items]
        self.workers[rank].tell(NodeValuesMsg(request_id, walk_seq, keys, values))


class WorkerHost(Actor):
    """Runs in a worker process: builds that process's `Worker` when told how.

    Args:
        allowed_model_factories: What it may build besides the zoo's models (see
            `mstar.runtime.trust`); given at launch, never by a message.
    """

    def __init__(self, allowed_model_factories: Sequence[str] = ()) -> None:
        self.allowed_model_factories = tuple(allowed_model_factories)

    async def handle(self, message: Any) -> Any:
        """Build the worker from an `InitWorker`; answer `WorkerReady`.

        Raises:
            UntrustedModelError: The factory is neither the zoo's nor allow-listed.
        """
        if not isinstance(message, InitWorker):
            raise TypeError(f"the worker host does not handle {type(message).__name__}")
        check_model_factory(message.model_factory, self.allowed_model_factories)
        spec = ModelSpec(message.model_factory, message.model_kwargs)
        model = await asyncio.to_thread(spec.build)  # keep the loop free for heartbeats
        graph = model.graph()
        placement = Placement(tuple(message.node_groups), message.placement_model).resolve(graph)
        config = message.config
        system: ActorSystem = self.system
        conductor = system.ref(message.conductor)
        workers = {rank: system.ref(actor_id) for rank, actor_id in message.workers.items()}
        rank = message.rank
        if workers[rank].address not in system.addresses:
            raise MStarError(f"rank {rank} is not placed in this process")
        ref = await system.spawn(
            lambda: Worker(rank, model, graph, placement, conductor, workers, config),
            name=worker_name(rank),
        )
        return WorkerReady(rank, ActorId(ref.address, ref.name))


def stats_report(
    engines: Mapping[str, NodeEngine],
    system: ActorSystem,
    followers: Mapping[str, TensorParallelFollower] | None = None,
) -> StatsReport:
    """Report the engines' counters, their step times per walk, and the system's tensor bytes
    (and the steps of the tensor-parallel shards this rank follows)."""
    walks = {
        name: {
            walk: WalkStepStats(t.steps, t.inputs, t.seconds, list(t.bucket_counts))
            for walk, t in engine.walk_times.by_walk.items()
        }
        for name, engine in engines.items()
    }
    stats = {name: dict(engine.stats()) for name, engine in engines.items()}
    stats.update({name: f.stats() for name, f in (followers or {}).items()})
    return StatsReport(stats, walks, system.transport_tally.snapshot())


async def setup_worker_host(
    system: ActorSystem, allowed_model_factories: Sequence[str] = ()
) -> None:
    """Spawn the worker host in a fresh worker process (`SystemProcess` setup)."""
    allowed = tuple(allowed_model_factories)
    await system.spawn(lambda: WorkerHost(allowed), name=HOST_NAME)
