"""`AsyncEngine`: the embedded API (DESIGN.md §6) over the conductor and the workers.

    async with await AsyncEngine.start(model, placement=...) as engine:
        async for out in engine.generate(request):
            ...

By default every rank's `Worker` runs in this process, as actors on the in-process
transport. With ``EngineConfig(worker_processes=True)`` each rank runs in a process of its
own, started (with ``spawn``) and stopped by the engine, talking ZeroMQ over ipc sockets
and a shared-memory arena for CPU tensors; the model is rebuilt in each process from its
`ModelSpec`. With ``EngineConfig(ray_address=...)`` each rank's worker runs as a Ray actor on
the node its placement names (`mstar.runtime.ray_launcher`), started, supervised and
restarted by Ray, talking ZeroMQ over tcp with CURVE keys generated here; the conductor
stays in this process. Starting, watching and restarting the workers is `Ranks`'s job
(`mstar.runtime.ranks`); this module is the API.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import weakref
from collections.abc import AsyncGenerator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any, Self

import structlog

from mstar.actors import ActorRef, ActorSystem
from mstar.actors.process import SystemProcess, check_main_guard
from mstar.errors import (
    EngineClosedError,
    MStarError,
    RequestAbortedError,
)
from mstar.runtime.conductor import END, Abort, Conductor, Submit
from mstar.runtime.engine_config import EngineConfig, EngineLimits, EngineStats
from mstar.runtime.messages import (
    LimitsQuery,
    LimitsReport,
    StateQuery,
    StateReport,
    StatsQuery,
    StatsReport,
)
from mstar.runtime.model import Model, ModelSpec, Output, Request
from mstar.runtime.params import parse_options
from mstar.runtime.placement import Placement
from mstar.runtime.ranks import CONDUCTOR, Ranks
from mstar.runtime.ray_launcher import RankInfo, RayLauncher, ray_host_id
from mstar.runtime.trust import check_model_factory
from mstar.transport.curve import CurveKeys
from mstar.transport.janitor import sweep_stale

__all__ = ["CONDUCTOR_PROCESS", "AsyncEngine"]

log = structlog.get_logger(__name__)

# How `EngineStats.transport` names the process that runs the engine (and the conductor).
CONDUCTOR_PROCESS = "conductor"


class _Pending:
    """A request whose `generate` was called and not yet iterated (see `AsyncEngine.abort`)."""

    __slots__ = ("__weakref__", "is_aborted")

    def __init__(self) -> None:
        self.is_aborted = False


class AsyncEngine:
    """Serve one model: submit requests, stream their outputs, abort them; shut down."""

    def __init__(
        self,
        model: Model,
        placement: Placement,
        config: EngineConfig,
        launcher: RayLauncher | None = None,
    ) -> None:
        self.model = model
        self.placement = placement
        self.config = config
        self.graph = model.graph()
        self.resolved = placement.resolve(self.graph)
        self.launcher = launcher
        system = config.system
        if launcher is not None:
            # The workers' systems got the same config (and CURVE keys) with their launch.
            system = replace(
                launcher.system, allow_remote=True, host_id=ray_host_id(launcher.node_id)
            )
        self.system = ActorSystem(system)
        self.ranks = Ranks(
            model, self.graph, self.resolved, placement, config, self.system, launcher
        )
        self.conductor: ActorRef | None = None
        self.spec: ModelSpec | None = None
        self.limits = EngineLimits()  # published by the engines at start (`start`)
        self._preprocessing = ThreadPoolExecutor(2, thread_name_prefix="mstar-preprocess")
        self._not_started: weakref.WeakValueDictionary[str, _Pending] = (
            weakref.WeakValueDictionary()
        )
        self._is_closed = False

    @property
    def workers(self) -> dict[int, ActorRef]:
        """Each rank's worker."""
        return self.ranks.workers

    @property
    def processes(self) -> dict[int, SystemProcess]:
        """Each rank's worker process (with ``worker_processes``)."""
        return self.ranks.processes

    @property
    def rank_info(self) -> dict[int, RankInfo]:
        """Where each rank's Ray actor serves (with ``ray_address``)."""
        return self.ranks.rank_info

    @property
    def num_restarts(self) -> int:
        """How many times a lost worker was started again."""
        return self.ranks.num_restarts

    # --- lifecycle ---------------------------------------------------------------------------

    @classmethod
    async def start(
        cls,
        model: Model | ModelSpec,
        placement: Placement | str | Path | None = None,
        config: EngineConfig | None = None,
    ) -> AsyncEngine:
        """Start the conductor and every rank's worker; return when all are ready.

        Args:
            model: The model, or a `ModelSpec` to build it from (required for worker
                processes, which rebuild the model themselves).
            placement: A `Placement`, a placement YAML file, or None for the model's
                `default_placement` (everything on rank 0 unless the model says otherwise).
            config: How to run.

        Raises:
            PlacementError: The placement does not fit the model.
            RayClusterUnreachableError: The Ray cluster cannot be reached or joined in time.
            ModelLoadError: The model cannot be built.
            MissingMainGuardError: Worker processes were asked for by a script without an
                ``if __name__ == "__main__":`` guard.
        """
        config = config or EngineConfig()
        if config.worker_processes:
            check_main_guard()
        # Segments and socket files of mstar processes that were killed (SIGKILL leaves them).
        await asyncio.to_thread(sweep_stale)
        spec = model if isinstance(model, ModelSpec) else model.spec
        instance = model.build() if isinstance(model, ModelSpec) else model
        if placement is None:
            placement = instance.default_placement() or Placement.colocated(instance.graph())
        elif not isinstance(placement, Placement):
            placement = Placement.from_yaml(placement)
        # backend: ray in the placement file
        ray_address = placement.cluster_address(config.ray_address)
        if ray_address != config.ray_address:
            config = replace(config, ray_address=ray_address)
        if placement.deterministic and not config.deterministic:
            config = replace(config, deterministic=True)
        if config.is_distributed and spec is None:
            raise MStarError(
                "worker processes rebuild the model: pass a ModelSpec (or a model with a .spec)"
            )
        if config.is_distributed and spec is not None:
            # before any process starts
            check_model_factory(spec.factory, config.allowed_model_factories)
        launcher = None
        if config.ray_address is not None:
            # a bad placement fails before the cluster is joined
            placement.resolve(instance.graph())
            launcher = RayLauncher(
                config.ray_address,
                # the same keys for every system
                replace(config.system, curve=CurveKeys.generate()),
                {"allowed_model_factories": list(config.allowed_model_factories)},
                loop=config.loop,
                num_cpus=config.ray_num_cpus,
                max_restarts=config.ray_max_restarts,
                placement_timeout_s=config.ray_placement_timeout_s,
            )
        try:
            if launcher is not None:
                await launcher.connect(config.ray_connect_timeout_s)
            engine = cls(instance, placement, config, launcher)
        except BaseException:
            if launcher is not None:
                await launcher.stop()
            raise
        engine.spec = spec
        await engine.system.__aenter__()
        try:
            await engine._start_actors(spec)
            engine.limits = await engine._gather_limits()
        except BaseException:
            await engine.shutdown()
            raise
        if config.freeze_gc:
            gc.collect()
            gc.freeze()
        log.info(
            "engine_started",
            model=instance.name,
            ranks=list(placement.ranks),
            worker_processes=config.worker_processes,
            ray=config.ray_address is not None,
            deterministic=config.deterministic,
            tensor_parallel=[list(ranks) for _, _, ranks in placement.tensor_parallel_groups()],
        )
        return engine

    async def _start_actors(self, spec: ModelSpec | None) -> None:
        workers = await self.ranks.launch(spec)
        wait_s, stall_s = self.config.restart_wait_s, self.config.request_stall_timeout_s
        self.conductor = await self.system.spawn(
            lambda: Conductor(self.model, self.graph, self.resolved, workers, wait_s, stall_s),
            name=CONDUCTOR,
        )
        await self.ranks.start_workers(self.conductor)

    async def shutdown(self) -> None:
        """Stop the workers, the worker processes and the conductor; fail running requests."""
        if self._is_closed:
            return
        self._is_closed = True
        await self.ranks.stop_watching()
        if self.conductor is not None:
            with contextlib.suppress(Exception):
                await self.system.stop(self.conductor)
        await self.ranks.stop()
        await self.system.__aexit__(None, None, None)
        self._preprocessing.shutdown(wait=False, cancel_futures=True)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.shutdown()

    # --- requests --------------------------------------------------------------------------

    def generate(self, request: Request) -> AsyncGenerator[Output, None]:
        """Run a request; yield its outputs as they are produced.

        Leaving the iteration early (break, cancel, a client that went away) aborts the
        request and frees what it held. An `abort` of the request's id before the first
        iteration aborts it too.

        Raises:
            InvalidRequestError: An option the task declares is malformed (names it).
            ValueError: The model rejected the request.
            WalkExecutionError: A node failed (names node, walk and request).
            RequestAbortedError: The request was aborted.
            WorkerUnavailableError: A worker the request used died, or one it needs is down
                (being restarted, no live replica): retry after its ``retry_after_s`` (a
                `WorkerLostError`).
        """
        pending = _Pending()
        if not self._is_closed:
            # Held by the generator only: a generator dropped unstarted leaves nothing here.
            self._not_started[request.request_id] = pending
        return self._generate(request, pending)

    async def _generate(self, request: Request, pending: _Pending) -> AsyncGenerator[Output, None]:
        try:
            if self._is_closed or self.conductor is None:
                raise EngineClosedError("the engine is shut down")
            if pending.is_aborted:
                raise RequestAbortedError(f"request {request.request_id!r} was aborted")
            if request.options is None:  # the task's declared options, typed once, here
                request.options = parse_options(self.model.task_options(request.task), request.data)
            # Preprocessing (tokenizing a long text, decoding images) can take seconds: off
            # the event loop, which serves every other request meanwhile.
            loop = asyncio.get_running_loop()
            prepared = await loop.run_in_executor(
                self._preprocessing, self.model.preprocess, request
            )
            if pending.is_aborted or self._is_closed:
                raise RequestAbortedError(f"request {request.request_id!r} was aborted")
        finally:
            if self._not_started.get(request.request_id) is pending:
                del self._not_started[request.request_id]
        queue: asyncio.Queue[Any] = asyncio.Queue()
        self.conductor.tell(Submit(request, queue, prepared))
        finished = False
        try:
            while True:
                item = await queue.get()
                if item is END:
                    finished = True
                    return
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                yield item
        finally:
            if not finished and not self._is_closed:
                self.conductor.tell(Abort(request.request_id))

    async def abort(self, request_id: str, reason: str = "") -> None:
        """Abort a request; its `generate` raises `RequestAbortedError` (saying ``reason``).

        A request whose `generate` was called but not yet iterated is aborted as well.
        """
        pending = self._not_started.get(request_id)
        if pending is not None:
            pending.is_aborted = True
        if self.conductor is not None and not self._is_closed:
            self.conductor.tell(Abort(request_id, reason))

    def ranks_up(self) -> dict[int, bool]:
        """Return, per rank, whether its worker serves now (False while a lost one restarts)."""
        return self.ranks.up()

    async def held_state(self) -> dict[str, dict[str, int]]:
        """Ask the conductor and every live worker what they hold for requests (zeros when idle).

        A lost worker (see `ranks_up`) holds nothing and is left out.
        """
        assert self.conductor is not None
        up = self.ranks_up()
        refs = {"conductor": self.conductor} | {
            f"rank{r}": ref for r, ref in self.workers.items() if up[r]
        }
        out: dict[str, dict[str, int]] = {}
        for name, ref in refs.items():
            report = await ref.ask(StateQuery(), timeout=30.0)
            assert isinstance(report, StateReport)
            out[name] = dict(report.counts)
        return out

    async def _gather_limits(self) -> EngineLimits:
        """Ask every worker, once, what its engines accept."""
        reports = {
            rank: await ref.ask(LimitsQuery(), timeout=60.0) for rank, ref in self.workers.items()
        }
        assert all(isinstance(r, LimitsReport) for r in reports.values())
        return EngineLimits({rank: dict(report.limits) for rank, report in reports.items()})

    async def stats(self) -> dict[int, dict[str, dict[str, float]]]:
        """Return each rank's per-node engine counters (steps, batched, step_seconds, KV blocks)."""
        return (await self.engine_stats()).nodes

    async def engine_stats(self, timeout: float = 5.0) -> EngineStats:
        """Ask every worker for its counters; add the tensor bytes of this process's links.

        A lost worker, or one that does not answer within ``timeout`` seconds, is listed in
        `EngineStats.missing_ranks` instead: what is known is reported at once.
        """
        out = EngineStats(transport={CONDUCTOR_PROCESS: self.system.transport_tally.snapshot()})
        up = self.ranks_up()

        async def ask(rank: int, ref: ActorRef) -> StatsReport | None:
            if not up[rank]:
                return None
            try:
                report = await ref.ask(StatsQuery(), timeout=timeout)
            except MStarError as exc:
                log.warning("stats_unavailable", rank=rank, error=str(exc))
                return None
            assert isinstance(report, StatsReport)
            return report

        ranks = list(self.workers)
        reports = await asyncio.gather(*(ask(rank, self.workers[rank]) for rank in ranks))
        for rank, report in zip(ranks, reports, strict=True):
            if report is None:
                out.missing_ranks.append(rank)
                continue
            out.nodes[rank] = {node: dict(values) for node, values in report.stats.items()}
            out.walks[rank] = {node: dict(walks) for node, walks in report.walks.items()}
            if self.ranks.is_remote(rank):  # in-process workers share this process's links
                out.transport[f"rank{rank}"] = {
                    kind: dict(v) for kind, v in report.transport.items()
                }
        return out

    async def run(self, request: Request) -> list[Output]:
        """Run a request to completion and return all its outputs."""
        return [out async for out in self.generate(request)]
