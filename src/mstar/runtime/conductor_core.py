"""The conductor's decisions, as a pure state machine over request events.

The `Conductor` actor feeds it events (a request arrived, a worker finished its share of a
walk, a stream item or an emission came in, a walk failed, an abort) and carries out the
commands it returns. It works at walk granularity: it starts walks, routes streams between
partitions through their `StreamBuffer`s, delivers emissions and asks the model for the
next walk; inside a walk the workers drive. Its semantics are the reference interpreter's.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from mstar.errors import MStarError, RequestAbortedError
from mstar.graph import Emission, ModelGraph, StreamingGraphEdge
from mstar.runtime.model import Model, Output, PreparedRequest, Request
from mstar.runtime.params import parse_options
from mstar.streaming import Chunk, StreamBuffer

__all__ = [
    "Command",
    "ConductorCore",
    "Deliver",
    "Fail",
    "Finish",
    "Release",
    "StartWalk",
]

Slot = tuple[str, str]


@dataclass(frozen=True)
class StartWalk:
    """Run this rank's share of ``walk`` (instance ``walk_seq``) for a request."""

    request_id: str
    walk_seq: int
    walk: str
    rank: int
    node_ranks: dict[str, int]
    initial: dict[Slot, Any]


@dataclass(frozen=True)
class Deliver:
    """Hand an output to the request's client."""

    output: Output


@dataclass(frozen=True)
class Finish:
    """The request completed; close its client stream."""

    request_id: str


@dataclass(frozen=True)
class Fail:
    """The request failed or was aborted; end its client stream with ``error``."""

    request_id: str
    error: Exception


@dataclass(frozen=True)
class Release:
    """Free everything ``ranks`` hold for the request (walks, engine state, KV blocks).

    Walk instances up to ``up_to_seq`` are over; a later request reusing the id gets
    higher sequence numbers, so nothing of it is dropped.
    """

    request_id: str
    ranks: tuple[int, ...]
    up_to_seq: int


Command = StartWalk | Deliver | Finish | Fail | Release


@dataclass
class _Partition:
    walk: str | None = None  # the walk running, or waiting for a chunk
    walk_seq: int = 0
    outstanding: set[int] = field(default_factory=set)  # ranks still running the walk
    bound: dict[Slot, Chunk[Any]] = field(default_factory=dict)  # chunks taken for the walk
    is_running: bool = False
    is_done: bool = False


@dataclass
class _Request:
    request_id: str
    index: int  # picks a replica among a group's ranks
    state: Any
    persistent: dict[Slot, Any]
    partitions: dict[str, _Partition]
    buffers: dict[Slot, StreamBuffer[Any]]
    ranks_used: set[int] = field(default_factory=set)
    # node -> the rank it runs on for this request
    replicas: dict[str, int] = field(default_factory=dict)


class ConductorCore:
    """Per-request walk state, stream routing and completion; pure and synchronous.

    Args:
        model: The model (its state machine and postprocessing).
        graph: The model's graph.
        placement: (node, walk) to the ranks that host it.
    """

    def __init__(
        self, model: Model, graph: ModelGraph, placement: Mapping[tuple[str, str], tuple[int, ...]]
    ) -> None:
        self.model, self.graph, self.placement = model, graph, placement
        self.requests: dict[str, _Request] = {}
        # Ranks whose worker is lost: a node replicated elsewhere runs on a live replica.
        self.ranks_down: set[int] = set()
        self._num_submitted = 0
        self._num_walks = 0  # walk sequence numbers are unique across requests
        self._stream_slots = {
            w: [
                (n.name, i)
                for n in graph.walk_nodes(w)
                for i in sorted(n.inputs & graph.stream_inputs(n.name))
            ]
            for w in graph.walks
        }
        self._policies: dict[Slot, Any] = {}
        self._streams_from: dict[str, list[Slot]] = {p: [] for p in graph.partitions}
        for src in graph.nodes.values():
            for e in src.outputs:
                if isinstance(e, StreamingGraphEdge) and (e.dst, e.name) not in self._policies:
                    self._policies[(e.dst, e.name)] = graph.connection_for(src.name, e).policy
                    self._streams_from[graph.node_partition[src.name]].append((e.dst, e.name))

    # --- events ----------------------------------------------------------------------------

    def submit(self, request: Request, prepared: PreparedRequest | None = None) -> list[Command]:
        """Start a request: preprocess it (unless ``prepared``) and start each partition's first
        walk.

        Raises:
            ValueError: The model rejected the request, or its id is already running.
        """
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already running")
        if prepared is None:
            if request.options is None:
                request.options = parse_options(self.model.task_options(request.task), request.data)
            prepared = self.model.preprocess(request)
        req = _Request(
            request.request_id,
            self._num_submitted,
            prepared.state,
            {(n, k): v for n, vals in prepared.inputs.items() for k, v in vals.items()},
            {p: _Partition() for p in self.graph.partitions},
            {slot: StreamBuffer(policy) for slot, policy in self._policies.items()},
        )
        self._num_submitted += 1
        self.requests[req.request_id] = req
        out: list[Command] = []
        try:
            for part in self.graph.partitions:
                self._advance(req, part, self.model.first_walk(part, req.state), out)
        except Exception as exc:
            return self._fail(req, exc, out)
        return self._maybe_finish(req, out)

    def walk_done(
        self, request_id: str, walk_seq: int, rank: int, persisted: Mapping[Slot, Any]
    ) -> list[Command]:
        """Record that ``rank`` finished its share of a walk; move on once all have."""
        req = self.requests.get(request_id)
        part = self._partition_of(req, walk_seq)
        if req is None or part is None:
            return []  # late news of an aborted request or walk
        state = req.partitions[part]
        req.persistent.update(persisted)
        state.outstanding.discard(rank)
        if state.outstanding:
            return []
        out: list[Command] = []
        finished, state.walk, state.is_running = state.walk, None, False
        assert finished is not None
        try:
            self._advance(req, part, self.model.next_walk(part, req.state, finished), out)
        except Exception as exc:
            return self._fail(req, exc, out)
        return self._maybe_finish(req, out)

    def stream_item(self, request_id: str, slot: Slot, value: Any) -> list[Command]:
        """Append an item to a request's stream; fire a consumer that waited for a chunk."""
        req = self.requests.get(request_id)
        if req is None:
            return []
        req.buffers[slot].put((value,))
        out: list[Command] = []
        try:
            self._retry_waiting(req, self.graph.node_partition[slot[0]], out)
        except Exception as exc:
            return self._fail(req, exc, out)
        return self._maybe_finish(req, out)

    def emitted(self, request_id: str, emission: Emission) -> list[Command]:
        """Postprocess an emission for the client."""
        if request_id not in self.requests:
            return []
        return [Deliver(self.model.postprocess(request_id, emission))]

    def walk_failed(self, request_id: str, walk_seq: int, error: Exception) -> list[Command]:
        """Fail the request whose walk raised; the others keep running."""
        req = self.requests.get(request_id)
        if req is None or self._partition_of(req, walk_seq) is None:
            return []
        return self._fail(req, error, [])

    def worker_lost(self, rank: int, error: Exception) -> list[Command]:
        """Fail every request that used ``rank`` (its walks or cached state died with it)."""
        out: list[Command] = []
        for req in [r for r in self.requests.values() if rank in r.ranks_used]:
            req.ranks_used.discard(rank)
            self._fail(req, error, out)
        return out

    def abort(self, request_id: str, reason: str = "") -> list[Command]:
        """Abort a request (saying why, if ``reason``) and release everything held for it."""
        why = f": {reason}" if reason else ""
        return self.fail(
            request_id, RequestAbortedError(f"request {request_id!r} was aborted{why}")
        )

    def fail(self, request_id: str, error: Exception) -> list[Command]:
        """Fail a request with ``error`` and release everything held for it."""
        req = self.requests.get(request_id)
        if req is None:
            return []
        return self._fail(req, error, [])

    # --- walks -------------------------------------------------------------------------------

    def _advance(self, req: _Request, part: str, walk: str | None, out: list[Command]) -> None:
        state = req.partitions[part]
        if walk is None:
            self._end_partition(req, part, out)
            return
        if self.graph.walk_partition.get(walk) != part:
            raise MStarError(
                f"the model chose walk {walk!r}, which is not a walk of partition {part!r}"
            )
        state.walk = walk
        for slot in self._stream_slots[walk]:
            if slot in state.bound:
                continue
            chunk = req.buffers[slot].next_chunk()
            if chunk is None:
                if req.buffers[slot].is_over:
                    # the stream is over, and with it the partition
                    self._end_partition(req, part, out)
                return  # wait for the producer
            state.bound[slot] = chunk
        self._start(req, part, walk, out)

    def _start(self, req: _Request, part: str, walk: str, out: list[Command]) -> None:
        state = req.partitions[part]
        state.walk_seq = self._next_seq(req)
        node_ranks = {
            node.name: self._replica(req, node.name, walk) for node in self.graph.walk_nodes(walk)
        }
        initial: dict[int, dict[Slot, Any]] = {r: {} for r in set(node_ranks.values())}
        for slot, value in req.persistent.items():
            if slot[0] in node_ranks:
                initial[node_ranks[slot[0]]][slot] = value
        for slot, chunk in state.bound.items():
            initial[node_ranks[slot[0]]][slot] = chunk
        state.bound = {}
        state.outstanding = set(initial)
        state.is_running = True
        req.ranks_used |= state.outstanding
        for rank, values in sorted(initial.items()):
            out.append(
                StartWalk(req.request_id, state.walk_seq, walk, rank, dict(node_ranks), values)
            )

    def _replica(self, req: _Request, node: str, walk: str) -> int:
        """Return the rank that runs ``node`` in ``walk`` for a request.

        The one it ran on before (its state is there); else the request's pick by its index
        among the group's live ranks (all of them when none is live: the walk then waits for
        a restart, or fails). With every rank up, requests spread over the replicas evenly.
        """
        ranks = self.placement[(node, walk)]
        chosen = req.replicas.get(node)
        if chosen is None or chosen not in ranks:
            live = [r for r in ranks if r not in self.ranks_down] or ranks
            chosen = req.replicas[node] = live[req.index % len(live)]
        return chosen

    def _next_seq(self, req: _Request) -> int:
        self._num_walks += 1
        return self._num_walks

    def _retry_waiting(self, req: _Request, part: str, out: list[Command]) -> None:
        state = req.partitions[part]
        if state.walk is not None and not state.is_running and not state.is_done:
            self._advance(req, part, state.walk, out)

    def _end_partition(self, req: _Request, part: str, out: list[Command]) -> None:
        state = req.partitions[part]
        state.walk, state.is_done, state.is_running = None, True, False
        for slot in self._streams_from[part]:
            req.buffers[slot].close()
            self._retry_waiting(req, self.graph.node_partition[slot[0]], out)

    def _maybe_finish(self, req: _Request, out: list[Command]) -> list[Command]:
        if req.request_id in self.requests and all(p.is_done for p in req.partitions.values()):
            del self.requests[req.request_id]
            out.append(Release(req.request_id, tuple(sorted(req.ranks_used)), self._num_walks))
            out.append(Finish(req.request_id))
        return out

    def _fail(self, req: _Request, error: Exception, out: list[Command]) -> list[Command]:
        self.requests.pop(req.request_id, None)
        out.append(Release(req.request_id, tuple(sorted(req.ranks_used)), self._num_walks))
        out.append(Fail(req.request_id, error))
        return out

    @staticmethod
    def _partition_of(req: _Request | None, walk_seq: int) -> str | None:
        if req is None:
            return None
        for name, p in req.partitions.items():
            if p.is_running and p.walk_seq == walk_seq:
                return name
        return None
