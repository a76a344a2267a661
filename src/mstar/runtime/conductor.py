"""The `Conductor` actor: runs `ConductorCore` and carries out its commands."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from mstar.actors import Actor, ActorRef
from mstar.errors import MStarError, RequestAbortedError, WalkExecutionError, WorkerLostError
from mstar.graph import Emission, ModelGraph
from mstar.messages import (
    EmittedMsg,
    ReleaseRequest,
    StartWalkMsg,
    StateQuery,
    StateReport,
    StreamItemMsg,
    UpdatePeer,
    WalkDoneMsg,
    WalkFailedMsg,
)
from mstar.runtime.conductor_core import (
    Command,
    ConductorCore,
    Deliver,
    Fail,
    Finish,
    Release,
    StartWalk,
)
from mstar.runtime.model import Model, Request
from mstar.runtime.values import from_slots, from_wire, to_slots

__all__ = ["END", "Abort", "Conductor", "Submit", "WorkerLost"]

END = object()
"""Put on a request's output queue after its last output."""


@dataclass(frozen=True)
class Submit:
    """Start a request; its outputs, then `END` or an exception, go to ``queue``.

    In-process only: the conductor lives in the process of the engine that submits.
    """

    request: Request
    queue: asyncio.Queue[Any]


@dataclass(frozen=True)
class Abort:
    """Abort a request (in-process only)."""

    request_id: str


@dataclass(frozen=True)
class WorkerLost:
    """The worker of ``rank`` died (in-process only; sent by the engine's watchdog)."""

    rank: int


class Conductor(Actor):
    """Per-request walk state and stream routing for one model (see `ConductorCore`)."""

    def __init__(
        self, model: Model, graph: ModelGraph, placement: Mapping[tuple[str, str], tuple[int, ...]], workers: Mapping[int, ActorRef]
    ) -> None:
        self.core = ConductorCore(model, graph, placement)
        self.workers = dict(workers)
        self.queues: dict[str, asyncio.Queue[Any]] = {}

    # Outputs arrive once per token or chunk: an idle conductor hands them on at once.
    immediate_types = frozenset({EmittedMsg, StreamItemMsg})

    def handle_now(self, message: EmittedMsg | StreamItemMsg) -> None:
        """Postprocess an output for its client, or route a stream item."""
        m = message
        if isinstance(m, EmittedMsg):
            emission = Emission(m.partition, m.walk, m.node, m.name, m.modality, from_wire(m.value))
            self._execute(self.core.emitted(m.request_id, emission))
        else:
            self._execute(self.core.stream_item(m.request_id, (m.node, m.name), from_wire(m.value)))

    async def handle(self, message: Any) -> Any:
        """Turn one event into the core's commands and carry them out."""
        core = self.core
        if isinstance(message, EmittedMsg | StreamItemMsg):
            self.handle_now(message)
            return None
        if isinstance(message, WalkDoneMsg):
            commands = core.walk_done(message.request_id, message.walk_seq, message.rank, from_slots(message.persisted))
        elif isinstance(message, WalkFailedMsg):
            commands = core.walk_failed(message.request_id, message.walk_seq, _error_of(message))
        elif isinstance(message, Submit):
            self.queues[message.request.request_id] = message.queue
            try:
                commands = core.submit(message.request)
            except Exception as exc:
                del self.queues[message.request.request_id]
                message.queue.put_nowait(exc)
                return None
        elif isinstance(message, Abort):
            commands = core.abort(message.request_id)
        elif isinstance(message, WorkerLost):
            error = WorkerLostError(f"the worker of rank {message.rank} died; it is being restarted")
            commands = core.worker_lost(message.rank, error)
        elif isinstance(message, UpdatePeer):
            self.workers[message.rank] = self.system.ref(message.worker)
            return None
        elif isinstance(message, StateQuery):
            return StateReport({"requests": len(core.requests), "client_queues": len(self.queues)})
        else:
            raise TypeError(f"the conductor does not handle {type(message).__name__}")
        self._execute(commands)
        return None

    def _execute(self, commands: list[Command]) -> None:
        for c in commands:
            if isinstance(c, StartWalk):
                ref = self.workers[c.rank]
                wire = ref.address != self.system.address
                ref.tell(StartWalkMsg(c.request_id, c.walk_seq, c.walk, c.node_ranks, to_slots(c.initial, wire=wire)))
            elif isinstance(c, Deliver):
                queue = self.queues.get(c.output.request_id)
                if queue is not None:
                    queue.put_nowait(c.output)
            elif isinstance(c, Release):
                for rank in c.ranks:
                    self.workers[rank].tell(ReleaseRequest(c.request_id, c.up_to_seq))
            elif isinstance(c, Finish | Fail):
                queue = self.queues.pop(c.request_id, None)
                if queue is not None:
                    queue.put_nowait(END if isinstance(c, Finish) else c.error)

    async def on_stop(self) -> None:
        """Fail every request still running: the engine is shutting down."""
        for request_id, queue in self.queues.items():
            queue.put_nowait(RequestAbortedError(f"request {request_id!r} was aborted: the engine shut down"))
        self.queues.clear()


def _error_of(message: WalkFailedMsg) -> Exception:
    if message.kind == "WalkExecutionError":
        return WalkExecutionError(message.message, node=message.node, walk=message.walk, request_id=message.request_id)
    return MStarError(f"walk failed on rank {message.rank}: {message.message}")
