"""The `Conductor` actor: runs `ConductorCore` and carries out its commands.

It also keeps walks away from lost workers. Between a worker's death (`WorkerLost`) and
its restart (`UpdatePeer`), a node replicated on other ranks runs on a live replica. A request
submitted while the rank is down never waits for it: the first of its walks that needs the
rank itself (no replica is up) fails it at once with `WorkerUnavailableError`, naming the
rank and when to retry (about when the restart should be done); refusing it costs the
client one round trip, while holding it would keep it waiting for a restart of unknown
length. A walk of a request that was already running when the rank was lost is parked here
instead, whole (every rank's share of it), since that request holds work on other ranks; it
starts once the rank is back, or fails after ``restart_wait_s``.
The requests that were using the rank when it died fail with `WorkerUnavailableError` too.
The moment the rank is back, requests run again. Nothing is ever sent into a dead worker's
socket, where it would wait forever.

And it fails stalled requests: one of which nothing (an output, a stream item, a walk share
done) arrived for ``request_stall_timeout_s`` seconds, say because a message was lost, fails
with `RequestStalledError` and everything it held is released. A parked walk is not stalled
(``restart_wait_s`` bounds it).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import structlog

from mstar.actors import Actor, ActorRef
from mstar.errors import (
    DuplicateRequestError,
    MailboxFullError,
    MStarError,
    RequestAbortedError,
    RequestStalledError,
    WalkExecutionError,
    WorkerUnavailableError,
)
from mstar.graph import Emission, ModelGraph
from mstar.runtime.conductor_core import (
    Command,
    ConductorCore,
    Deliver,
    Fail,
    Finish,
    Release,
    StartWalk,
)
from mstar.runtime.messages import (
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
from mstar.runtime.model import Model, PreparedRequest, Request
from mstar.runtime.values import from_slots, to_slots

__all__ = ["END", "Abort", "Conductor", "RankWaitExpired", "SweepStalls", "Submit", "WorkerLost"]

log = structlog.get_logger(__name__)

END = object()
"""Put on a request's output queue after its last output."""

# A stalled request is looked for this many times per stall timeout: it fails after between
# one and 1 + 1/_SWEEPS timeouts without progress.
_SWEEPS = 4
_RETRY_S = 0.05  # a timer's message that found the mailbox full is sent again this much later


@dataclass(frozen=True)
class Submit:
    """Start a request; its outputs, then `END` or an exception, go to ``queue``.

    In-process only: the conductor lives in the process of the engine that submits.
    ``prepared`` is the model's preprocessing of it, when the engine did that already.
    """

    request: Request
    queue: asyncio.Queue[Any]
    prepared: PreparedRequest | None = None


@dataclass(frozen=True)
class Abort:
    """Abort a request (in-process only); ``reason`` goes into its error."""

    request_id: str
    reason: str = ""


@dataclass(frozen=True)
class WorkerLost:
    """The worker of ``rank`` died (in-process only; sent by the engine's watchdog).

    ``restart_estimate_s`` is how long its restart should take (how long its last start
    took; 0 when not known): what `WorkerUnavailableError.retry_after_s` counts down from.
    """

    rank: int
    restart_estimate_s: float = 0.0


@dataclass(frozen=True)
class RankWaitExpired:
    """Give up waiting for the restart of ``rank``'s worker (loss number ``epoch``); in-process
    only."""

    rank: int
    epoch: int


@dataclass(frozen=True)
class SweepStalls:
    """Fail the requests that made no progress lately (in-process only; sent by a timer)."""


class Conductor(Actor):
    """Per-request walk state and stream routing for one model (see `ConductorCore`).

    Args:
        model: The model.
        graph: Its graph.
        placement: (node, walk) to the ranks that host it.
        workers: Each rank's worker.
        restart_wait_s: How long a running request's walk waits for a lost worker to come back.
        request_stall_timeout_s: How long a request may go without progress before it fails
            (None: never).
    """

    def __init__(
        self,
        model: Model,
        graph: ModelGraph,
        placement: Mapping[tuple[str, str], tuple[int, ...]],
        workers: Mapping[int, ActorRef],
        restart_wait_s: float = 60.0,
        request_stall_timeout_s: float | None = None,
    ) -> None:
        self.core = ConductorCore(model, graph, placement)
        self.workers = dict(workers)
        self.queues: dict[str, asyncio.Queue[Any]] = {}
        self.restart_wait_s = restart_wait_s
        self.restarting: set[int] = set()  # lost ranks whose restart is awaited
        self.gone: set[int] = set()  # lost ranks that did not come back in time
        self.parked: dict[tuple[str, int], list[StartWalk]] = {}  # (request, walk seq) -> shares
        self._losses: dict[int, int] = {}  # rank -> how often it was lost (tags its timer)
        # lost rank -> when its restart should be done (monotonic)
        self._back_at: dict[int, float] = {}
        self._num_losses = 0  # losses of any rank so far: orders submissions and losses
        self._lost_as: dict[int, int] = {}  # lost rank -> the number of its loss among all
        # running request -> the losses there were at its submission
        self._admitted_as: dict[str, int] = {}
        self.stall_timeout_s = request_stall_timeout_s
        self._progressed: set[str] = set()  # requests something arrived for since the last sweep
        self._quiet: dict[str, int] = {}  # request -> sweeps in a row that found no progress
        self._sweep_timer: asyncio.TimerHandle | None = None

    async def on_start(self) -> None:
        """Start looking for stalled requests (when a stall timeout is set)."""
        self._schedule_sweep()

    # Outputs arrive once per token or chunk: an idle conductor hands them on at once.
    immediate_types = frozenset({EmittedMsg, StreamItemMsg})

    def handle_now(self, message: EmittedMsg | StreamItemMsg) -> None:
        """Postprocess an output for its client, or route a stream item."""
        m = message
        if self.stall_timeout_s is not None:
            self._progressed.add(m.request_id)
        if isinstance(m, EmittedMsg):
            emission = Emission(m.partition, m.walk, m.node, m.name, m.modality, m.value)
            self._execute(self.core.emitted(m.request_id, emission))
        else:
            self._execute(self.core.stream_item(m.request_id, (m.node, m.name), m.value))

    async def handle(self, message: Any) -> Any:
        """Turn one event into the core's commands and carry them out."""
        core = self.core
        if isinstance(message, EmittedMsg | StreamItemMsg):
            self.handle_now(message)
            return None
        if isinstance(message, WalkDoneMsg | WalkFailedMsg) and self.stall_timeout_s is not None:
            self._progressed.add(message.request_id)
        if isinstance(message, WalkDoneMsg):
            commands = core.walk_done(
                message.request_id, message.walk_seq, message.rank, from_slots(message.persisted)
            )
        elif isinstance(message, WalkFailedMsg):
            commands = core.walk_failed(
                message.request_id, message.walk_seq, self._walk_error(message)
            )
        elif isinstance(message, Submit):
            request_id = message.request.request_id
            if request_id in self.queues:
                # Checked before anything is replaced: the running request keeps its stream.
                message.queue.put_nowait(
                    DuplicateRequestError(f"request id {request_id!r} is already running")
                )
                return None
            self.queues[request_id] = message.queue
            self._admitted_as[request_id] = self._num_losses
            if self.stall_timeout_s is not None:
                self._progressed.add(request_id)
            try:
                commands = core.submit(message.request, message.prepared)
            except Exception as exc:
                del self.queues[request_id]
                del self._admitted_as[request_id]
                message.queue.put_nowait(exc)
                return None
        elif isinstance(message, Abort):
            commands = core.abort(message.request_id, message.reason)
        elif isinstance(message, WorkerLost):
            commands = self._worker_lost(message.rank, message.restart_estimate_s)
        elif isinstance(message, UpdatePeer):
            self._worker_back(message.rank, self.system.ref(message.worker))
            return None
        elif isinstance(message, RankWaitExpired):
            if (
                message.rank not in self.restarting
                or self._losses.get(message.rank) != message.epoch
            ):
                return None
            self.restarting.discard(message.rank)
            self.gone.add(message.rank)
            commands = core.worker_lost(message.rank, self._gone_error(message.rank))
        elif isinstance(message, SweepStalls):
            commands = self._sweep_stalls()
            self._schedule_sweep()
        elif isinstance(message, StateQuery):
            counts = {
                "requests": len(core.requests),
                "client_queues": len(self.queues),
                "parked_walks": len(self.parked),
            }
            return StateReport(counts)
        else:
            raise TypeError(f"the conductor does not handle {type(message).__name__}")
        self._execute(commands)
        return None

    def _execute(self, commands: list[Command]) -> None:
        failed: set[str] = set()  # requests failed here: the rest of their commands are moot
        for c in commands:
            if isinstance(c, StartWalk):
                down = self._down_rank(c)
                if c.request_id in failed:
                    continue
                if down is None:
                    self._send_walk(c)
                elif down in self.gone:
                    self._execute(self.core.worker_lost(down, self._gone_error(down)))
                elif self._admitted_as.get(c.request_id, 0) >= self._lost_as[down]:
                    # Submitted while the rank was down: it fails fast (see the module's docstring).
                    failed.add(c.request_id)
                    self._execute(self.core.fail(c.request_id, self._unavailable_error(down)))
                else:
                    self.parked.setdefault((c.request_id, c.walk_seq), []).append(c)
            elif isinstance(c, Deliver):
                queue = self.queues.get(c.output.request_id)
                if queue is not None:
                    queue.put_nowait(c.output)
            elif isinstance(c, Release):
                for key in [k for k in self.parked if k[0] == c.request_id and k[1] <= c.up_to_seq]:
                    del self.parked[key]
                for rank in c.ranks:
                    # A lost worker holds nothing any more, and its socket leads nowhere.
                    if rank not in self.restarting and rank not in self.gone:
                        self.workers[rank].tell(ReleaseRequest(c.request_id, c.up_to_seq))
            elif isinstance(c, Finish | Fail):
                self._admitted_as.pop(c.request_id, None)
                queue = self.queues.pop(c.request_id, None)
                if queue is not None:
                    queue.put_nowait(END if isinstance(c, Finish) else c.error)

    def _send_walk(self, c: StartWalk) -> None:
        self.workers[c.rank].tell(
            StartWalkMsg(c.request_id, c.walk_seq, c.walk, c.node_ranks, to_slots(c.initial))
        )

    def _down_rank(self, c: StartWalk) -> int | None:
        """Return a lost rank the walk needs (any rank's share of it may send values there)."""
        for rank in c.node_ranks.values():
            if rank in self.restarting or rank in self.gone:
                return rank
        return None

    # --- lost workers ----------------------------------------------------------------------

    def _worker_lost(self, rank: int, restart_estimate_s: float) -> list[Command]:
        epoch = self._losses[rank] = self._losses.get(rank, 0) + 1
        self.gone.discard(rank)
        self.restarting.add(rank)
        self.core.ranks_down.add(rank)
        self._back_at[rank] = time.monotonic() + restart_estimate_s
        self._num_losses += 1
        self._lost_as[rank] = self._num_losses
        asyncio.get_running_loop().call_later(
            self.restart_wait_s, self._expire, RankWaitExpired(rank, epoch)
        )
        return self.core.worker_lost(rank, self._died_error(rank))

    def _died_error(self, rank: int) -> WorkerUnavailableError:
        retry = self._retry_after_s(rank)
        return WorkerUnavailableError(
            f"the worker of rank {rank} died; it is being restarted (retry in {retry} s)",
            rank=rank,
            retry_after_s=retry,
        )

    def _walk_error(self, message: WalkFailedMsg) -> Exception:
        """Return the error a failed walk fails its request with.

        A walk failed by a rank's death (its tensor-parallel group's collective noticed it)
        fails the request as the watchdog's notice of that death does, whichever comes first.
        """
        if message.lost_rank >= 0:
            return self._died_error(message.lost_rank)
        return _error_of(message)

    def _retry_after_s(self, rank: int) -> int:
        """Return the whole seconds until the rank's restart should be done (at least 1)."""
        return max(1, math.ceil(self._back_at.get(rank, 0.0) - time.monotonic()))

    def _unavailable_error(self, rank: int) -> WorkerUnavailableError:
        retry = self._retry_after_s(rank)
        if rank in self.gone:
            return self._gone_error(rank)
        return WorkerUnavailableError(
            f"rank {rank} is down (its worker died and is being restarted) and no live "
            "replica can take "
            f"this request; retry in {retry} s",
            rank=rank,
            retry_after_s=retry,
        )

    def _expire(self, message: RankWaitExpired | SweepStalls) -> None:
        if self.system.is_closed:
            return
        try:
            self.ref.tell(message)
        # a burst of outputs: the timer must not be lost, or walks would wait forever
        except MailboxFullError:
            asyncio.get_running_loop().call_later(_RETRY_S, self._expire, message)
        except MStarError:
            pass  # the conductor stopped

    def _worker_back(self, rank: int, ref: ActorRef) -> None:
        """Point at the rank's new worker; start the walks that waited for it."""
        self.workers[rank] = ref
        self.restarting.discard(rank)
        self.gone.discard(rank)
        self.core.ranks_down.discard(rank)
        self._back_at.pop(rank, None)
        for key, shares in list(self.parked.items()):
            if self._down_rank(shares[0]) is None:
                del self.parked[key]
                for c in shares:
                    self._send_walk(c)

    def _gone_error(self, rank: int) -> WorkerUnavailableError:
        retry = self._retry_after_s(rank)
        return WorkerUnavailableError(
            f"the worker of rank {rank} died and did not come back within "
            f"{self.restart_wait_s} s; retry in {retry} s",
            rank=rank,
            retry_after_s=retry,
        )

    # --- stalled requests -------------------------------------------------------------------

    def _schedule_sweep(self) -> None:
        if self.stall_timeout_s is not None:
            delay = self.stall_timeout_s / _SWEEPS
            self._sweep_timer = asyncio.get_running_loop().call_later(
                delay, self._expire, SweepStalls()
            )

    def _sweep_stalls(self) -> list[Command]:
        """Fail the requests that went ``_SWEEPS`` sweeps in a row without progress."""
        parked = {request_id for request_id, _ in self.parked}
        quiet: dict[str, int] = {}
        commands: list[Command] = []
        for request_id in list(self.core.requests):
            if request_id in self._progressed or request_id in parked:
                continue
            num_quiet = quiet[request_id] = self._quiet.get(request_id, 0) + 1
            if num_quiet >= _SWEEPS:
                del quiet[request_id]
                log.warning(
                    "request_stalled", engine_request_id=request_id, timeout_s=self.stall_timeout_s
                )
                error = RequestStalledError(
                    f"request {request_id!r} made no progress for {self.stall_timeout_s} s "
                    "(a message lost on the "
                    "way?); it was failed and everything it held released"
                )
                commands += self.core.fail(request_id, error)
        self._quiet = quiet
        self._progressed.clear()
        return commands

    async def on_stop(self) -> None:
        """Fail every request still running: the engine is shutting down."""
        if self._sweep_timer is not None:
            self._sweep_timer.cancel()
        for request_id, queue in self.queues.items():
            queue.put_nowait(
                RequestAbortedError(f"request {request_id!r} was aborted: the engine shut down")
            )
        self.queues.clear()


def _error_of(message: WalkFailedMsg) -> Exception:
    if message.kind == "WalkExecutionError":
        return WalkExecutionError(
            message.message,
            node=message.node,
            walk=message.walk,
            request_id=message.request_id,
            cause=message.cause,
        )
    return MStarError(f"walk failed on rank {message.rank}: {message.message}")
