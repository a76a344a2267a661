"""The runtime's wire protocol: what the engine, the conductor and the workers exchange.

Each message is a `WireMessage` (registered with the actors' links below). Node values in
them (`mstar.runtime.values.Value`) are the values themselves inside one process; the link
that carries a message to another process converts them (`to_wire` / `from_wire` here),
so the conductor and the workers never choose how a value crosses.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec

from mstar.engines.limits import NodeLimits
from mstar.runtime.placement import NodeGroup
from mstar.runtime.values import (
    SlotValue,
    Value,
    from_wire,
    slots_from_wire,
    slots_to_wire,
    to_wire,
)
from mstar.runtime.worker_core import WorkerConfig
from mstar.wire import ActorId, WireMessage, WireStruct, register_messages

__all__ = [
    "EmittedMsg",
    "InitWorker",
    "NodeValuesMsg",
    "ReleaseRequest",
    "RUNTIME_MESSAGES",
    "StartWalkMsg",
    "StateQuery",
    "StateReport",
    "StatsQuery",
    "StatsReport",
    "LimitsQuery",
    "LimitsReport",
    "StreamItemMsg",
    "UpdatePeer",
    "WalkDoneMsg",
    "WalkFailedMsg",
    "WalkStepStats",
    "WorkerReady",
]

NonNegative = Annotated[int, msgspec.Meta(ge=0)]


class StartWalkMsg(WireMessage):
    """Conductor to worker: run this rank's share of a walk instance for a request."""

    request_id: str
    walk_seq: int
    walk: str
    node_ranks: dict[str, int]
    initial: list[SlotValue]

    def to_wire(self) -> StartWalkMsg:
        """Return this message with its values in wire form."""
        return StartWalkMsg(
            self.request_id, self.walk_seq, self.walk, self.node_ranks, slots_to_wire(self.initial)
        )

    def from_wire(self) -> StartWalkMsg:
        """Return this message with its values converted back."""
        return StartWalkMsg(
            self.request_id,
            self.walk_seq,
            self.walk,
            self.node_ranks,
            slots_from_wire(self.initial),
        )


class ReleaseRequest(WireMessage):
    """Conductor to worker: drop what a request holds, for its walks up to `up_to_seq`."""

    request_id: str
    up_to_seq: int


class NodeValuesMsg(WireMessage):
    """Worker to worker: values of one firing for nodes of the receiver, keyed as in
    `WalkRunner`."""

    request_id: str
    walk_seq: int
    keys: list[tuple[str, str, str, str]]
    values: list[Value]

    def to_wire(self) -> NodeValuesMsg:
        """Return this message with its values in wire form."""
        return NodeValuesMsg(
            self.request_id, self.walk_seq, self.keys, [to_wire(v) for v in self.values]
        )

    def from_wire(self) -> NodeValuesMsg:
        """Return this message with its values converted back."""
        return NodeValuesMsg(
            self.request_id, self.walk_seq, self.keys, [from_wire(v) for v in self.values]
        )


class WalkDoneMsg(WireMessage):
    """Worker to conductor: this rank finished its share of a walk instance."""

    request_id: str
    walk_seq: int
    rank: int
    persisted: list[SlotValue]

    def to_wire(self) -> WalkDoneMsg:
        """Return this message with its values in wire form."""
        return WalkDoneMsg(self.request_id, self.walk_seq, self.rank, slots_to_wire(self.persisted))

    def from_wire(self) -> WalkDoneMsg:
        """Return this message with its values converted back."""
        return WalkDoneMsg(
            self.request_id, self.walk_seq, self.rank, slots_from_wire(self.persisted)
        )


class WalkFailedMsg(WireMessage):
    """Worker to conductor: a walk instance failed here; `kind` names the error class."""

    request_id: str
    walk_seq: int
    rank: int
    kind: str
    message: str
    node: str = ""
    walk: str = ""
    cause: str = ""  # the class name of the node's own error
    lost_rank: int = -1  # the rank whose death failed it (`WorkerUnavailableError`), or -1


class EmittedMsg(WireMessage):
    """Worker to conductor: a value a node sent to `EMIT`."""

    request_id: str
    partition: str
    walk: str
    node: str
    name: str
    modality: str
    value: Value

    def to_wire(self) -> EmittedMsg:
        """Return this message with its value in wire form."""
        return EmittedMsg(
            self.request_id,
            self.partition,
            self.walk,
            self.node,
            self.name,
            self.modality,
            to_wire(self.value),
        )

    def from_wire(self) -> EmittedMsg:
        """Return this message with its value converted back."""
        return EmittedMsg(
            self.request_id,
            self.partition,
            self.walk,
            self.node,
            self.name,
            self.modality,
            from_wire(self.value),
        )


class StreamItemMsg(WireMessage):
    """Worker to conductor: one item on a stream into input ``name`` of ``node``."""

    request_id: str
    node: str
    name: str
    value: Value

    def to_wire(self) -> StreamItemMsg:
        """Return this message with its value in wire form."""
        return StreamItemMsg(self.request_id, self.node, self.name, to_wire(self.value))

    def from_wire(self) -> StreamItemMsg:
        """Return this message with its value converted back."""
        return StreamItemMsg(self.request_id, self.node, self.name, from_wire(self.value))


class InitWorker(WireMessage):
    """Engine to a worker process's host: build the worker of ``rank``.

    The model is rebuilt there from its factory path and keyword arguments, which the host
    checks against what it was launched to trust (the zoo, an allow-list); nothing is
    pickled. ``placement_model`` is the placement's model name (None: any).
    """

    rank: int
    model_factory: str
    model_kwargs: dict[str, Any]
    node_groups: list[NodeGroup]
    conductor: ActorId
    workers: dict[int, ActorId]
    config: WorkerConfig
    placement_model: str | None = None


class WorkerReady(WireMessage):
    """A worker process's host: the worker of ``rank`` runs as ``worker``."""

    rank: int
    worker: ActorId


class UpdatePeer(WireMessage):
    """Engine to conductor and workers: the worker of ``rank`` now runs as ``worker``."""

    rank: int
    worker: ActorId


class StatsQuery(WireMessage):
    """Ask a worker for its engines' cumulative counters (answered by `StatsReport`)."""


class WalkStepStats(WireStruct):
    """Cumulative step times of one walk on one node (`mstar.engines.StepTimes` on the wire).

    ``bucket_counts[i]`` counts steps in bucket ``i`` of `mstar.engines.STEP_TIME_BUCKETS`, the
    last one those longer than every bound (not cumulative).
    """

    steps: NonNegative
    inputs: NonNegative
    seconds: float
    bucket_counts: list[NonNegative]


class StatsReport(WireMessage):
    """A worker's counters.

    ``stats``, per node: steps, inputs batched, seconds in steps, KV blocks used/total where
    cached. ``walks``, per node and walk: step times (a step serving several walks counts under
    each). ``transport``, per transport kind: tensor bytes ``sent`` and ``received`` by the
    worker's actor system (`mstar.transport.TransportTally`). The last two are left out by
    older workers and then read as empty.
    """

    stats: dict[str, dict[str, float]]
    walks: dict[str, dict[str, WalkStepStats]] = msgspec.field(default_factory=dict)
    transport: dict[str, dict[str, NonNegative]] = msgspec.field(default_factory=dict)


class LimitsQuery(WireMessage):
    """Ask a worker what its engines accept (answered by `LimitsReport`), once, at start."""


class LimitsReport(WireMessage):
    """A worker's KV-cache nodes and their limits (stateless nodes have none)."""

    limits: dict[str, NodeLimits]


class StateQuery(WireMessage):
    """Ask a conductor or worker how much request state it holds (answered by `StateReport`)."""


class StateReport(WireMessage):
    """Counts of what an actor holds for requests (all zero when idle)."""

    counts: dict[str, int]


RUNTIME_MESSAGES: tuple[type[WireMessage], ...] = (
    StartWalkMsg,
    ReleaseRequest,
    NodeValuesMsg,
    WalkDoneMsg,
    WalkFailedMsg,
    EmittedMsg,
    StreamItemMsg,
    InitWorker,
    WorkerReady,
    UpdatePeer,
    StatsQuery,
    StatsReport,
    LimitsQuery,
    LimitsReport,
    StateQuery,
    StateReport,
)
"""Every runtime message type (adding one: define it above, then list it here)."""

register_messages(*RUNTIME_MESSAGES)
