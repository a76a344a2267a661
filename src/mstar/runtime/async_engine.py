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
stays in this process.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import importlib.util
import os
import time
import weakref
from collections.abc import AsyncGenerator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Self

import structlog

from mstar.actors import ActorRef, ActorSystem, SystemConfig
from mstar.actors.process import SystemProcess, check_main_guard
from mstar.engines.limits import NodeLimits
from mstar.engines.stateless import StatelessEngineConfig
from mstar.errors import (
    EngineClosedError,
    MStarError,
    PeerLostError,
    RequestAbortedError,
    WorkerLostError,
)
from mstar.runtime.conductor import END, Abort, Conductor, Submit, WorkerLost
from mstar.runtime.messages import (
    InitWorker,
    LimitsQuery,
    LimitsReport,
    StateQuery,
    StateReport,
    StatsQuery,
    StatsReport,
    UpdatePeer,
    WalkStepStats,
    WorkerReady,
)
from mstar.runtime.model import Model, ModelSpec, Output, Request
from mstar.runtime.params import parse_options
from mstar.runtime.placement import Placement
from mstar.runtime.ray_launcher import RankInfo, RayLauncher, ray_host_id
from mstar.runtime.trust import check_model_factory
from mstar.runtime.worker import HOST_NAME, Worker, worker_name
from mstar.runtime.worker_core import WorkerConfig
from mstar.transport.curve import CurveKeys
from mstar.transport.janitor import sweep_stale
from mstar.wire import ActorId

__all__ = ["CONDUCTOR_PROCESS", "AsyncEngine", "EngineConfig", "EngineStats"]

log = structlog.get_logger(__name__)

CONDUCTOR = "conductor"
# How `EngineStats.transport` names the process that runs the engine (and the conductor).
CONDUCTOR_PROCESS = "conductor"


@dataclass(frozen=True)
class EngineConfig:
    """How an `AsyncEngine` runs.

    Attributes:
        worker_processes: Run each rank's worker in a process of its own.
        devices: Torch device of each rank (default "cpu" for every rank).
        offload_steps: Run engine steps off the event loop (see `WorkerConfig`).
        max_batch_size: Largest batch of a stateless node.
        max_wait_s: How long a short stateless batch waits to fill.
        loop: Event loop of worker processes, "uvloop" (the default where it is installed)
            or "asyncio".
        system: Actor-system settings (heartbeats, arena size).
        watchdog_interval_s: How often worker processes are checked (besides at once when
            one exits); a dead one fails the requests that used it (`WorkerLostError`) and
            is restarted.
        restart_wait_s: How long a running request's next walk that needs a lost worker
            (no live replica) waits for its restart; then it fails with
            `WorkerUnavailableError`. New requests that need it do not wait: they fail at
            once with `WorkerUnavailableError` (naming the rank, with ``retry_after_s``
            counting down to when the restart should be done), and run again as soon as the
            worker is back.
        request_stall_timeout_s: How long a request may go without progress (an output, a
            stream item, or a walk share done reaching the conductor) before it fails with
            `RequestStalledError` and everything it held is released: a message lost on the
            way no longer hangs it. Set it above the longest quiet spell a request may have:
            a long loop inside one walk, or a long wait for KV-cache blocks in an engine
            queued full of requests. None: never (an offline batch that queues thousands of
            requests in one engine may want that).
        cpu_threads: Torch threads of each rank's engine steps (default: the machine's
            cores shared evenly among the ranks, in worker processes or in this one; one
            rank in this process leaves torch's setting as it is). Oversubscribed OpenMP
            threads spin against each other, and small ops then run many times slower.
        freeze_gc: Once started (and in each worker process once it has loaded), collect
            garbage and freeze what lives (models, imports) out of the garbage collector's
            full passes, as a process that only serves wants: in a process holding
            hundreds of thousands of objects a full pass stalls serving for 100+ ms.
            Objects frozen are never collected, so an embedding application that keeps
            creating and dropping large object graphs should leave this off.
        kv_cache_memory: KV-cache budget of each rank, shared by the KV-cache nodes placed on
            it (bytes, or a fraction of the device's free memory; see `WorkerConfig`).
        kv_cache_shares: Node -> fraction of its rank's budget (overrides the placement
            file's ``kv_cache_share``); the nodes not named split the rest evenly.
        allowed_model_factories: Model factories worker processes may build besides the
            zoo's: exact ``module:callable`` paths, modules, or prefixes ending in ``.`` or
            ``:`` (see `mstar.runtime.trust`). A worker refuses any other.
        ray_address: Run each rank's worker as a Ray actor on this cluster (``"auto"``,
            ``"ray://head:10001"``; an application that called ``ray.init`` itself passes
            any value), pinned by the placement's ``ray_resources``. A placement file with
            ``backend: ray`` sets it too (`Placement.cluster_address`).
        ray_num_cpus: CPUs each rank's Ray actor reserves (and its torch threads).
        ray_max_restarts: How often Ray restarts a rank's process (-1: without limit).
        ray_placement_timeout_s: How long the Ray cluster may take to reserve every rank's
            resources (one placement group) before the start fails with `PlacementError`.
        ray_connect_timeout_s: How long joining the Ray cluster may take before the start
            fails with `RayClusterUnreachableError` (an address where nothing listens fails
            at once).
    """

    worker_processes: bool = False
    devices: dict[int, str] = field(default_factory=dict)
    offload_steps: bool = True
    max_batch_size: int = 32
    max_wait_s: float = 0.0
    loop: str = field(default_factory=lambda: "uvloop" if importlib.util.find_spec("uvloop") else "asyncio")
    # A loaded 2-core host can starve an event loop for seconds; a dead process is caught by
    # the watchdog at once (and a link to a peer on this host watches its process, not its
    # silence), so links to other hosts may wait longer before giving a peer up.
    system: SystemConfig = field(default_factory=lambda: SystemConfig(heartbeat_timeout_s=20.0))
    watchdog_interval_s: float = 0.25
    restart_wait_s: float = 60.0
    request_stall_timeout_s: float | None = 600.0
    cpu_threads: int | None = None
    freeze_gc: bool = False
    kv_cache_memory: int | float | None = None
    kv_cache_shares: dict[str, float] = field(default_factory=dict)
    allowed_model_factories: tuple[str, ...] = ()
    ray_address: str | None = None
    ray_num_cpus: float = 1.0
    ray_max_restarts: int = -1
    ray_placement_timeout_s: float = 60.0
    ray_connect_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        stall = self.request_stall_timeout_s
        if stall is not None and not stall > 0:
            raise ValueError(f"request_stall_timeout_s must be > 0 seconds, or None for no timeout; got {stall}")

    @property
    def is_distributed(self) -> bool:
        """Whether workers run in processes of their own (local ones, or Ray actors)."""
        return self.worker_processes or self.ray_address is not None

    def worker_config(
        self, rank: int, num_ranks: int = 1, kv_cache_shares: dict[str, float] | None = None
    ) -> WorkerConfig:
        """Return the config of the worker of ``rank`` (one of ``num_ranks``).

        ``kv_cache_shares`` are the placement's shares of the nodes on this rank (this
        config's own override them).
        """
        threads = self.cpu_threads
        if threads is None and self.ray_address is not None:
            threads = max(1, int(self.ray_num_cpus))  # its own node's share, not this machine's
        elif threads is None and (self.worker_processes or num_ranks > 1):
            threads = max(1, (os.cpu_count() or 1) // num_ranks)
        return WorkerConfig(
            device=self.devices.get(rank, "cpu"),
            offload_steps=self.offload_steps,
            stateless=StatelessEngineConfig(self.max_batch_size, self.max_wait_s),
            num_threads=threads,
            freeze_gc=self.freeze_gc and self.is_distributed,
            kv_cache_memory=self.kv_cache_memory,
            kv_cache_shares={**(kv_cache_shares or {}), **self.kv_cache_shares},
        )


@dataclass
class EngineStats:
    """The engine's counters, gathered from every worker (all cumulative).

    Attributes:
        nodes: Per rank, per node: steps, inputs batched, seconds in steps, KV blocks.
        walks: Per rank, per node, per walk: step times (`WalkStepStats`; a step whose batch
            mixes walks counts in full under each of them).
        transport: Per process (`CONDUCTOR_PROCESS`, or ``rank<N>`` for a worker process),
            per transport kind: tensor bytes ``sent`` and ``received``.
        missing_ranks: Ranks whose worker is lost or did not answer (no counters above).
    """

    nodes: dict[int, dict[str, dict[str, float]]] = field(default_factory=dict)
    walks: dict[int, dict[str, dict[str, WalkStepStats]]] = field(default_factory=dict)
    transport: dict[str, dict[str, dict[str, int]]] = field(default_factory=dict)
    missing_ranks: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class EngineLimits:
    """What the engine accepts, as its KV-cache nodes published it when they started.

    Attributes:
        nodes: Per rank, per KV-cache node: its `NodeLimits`.
    """

    nodes: dict[int, dict[str, NodeLimits]] = field(default_factory=dict)

    @property
    def max_seq_len(self) -> int | None:
        """The longest sequence every KV-cache node can hold (None: the model has none)."""
        return min((n.max_seq_len for ranks in self.nodes.values() for n in ranks.values()), default=None)


class _Pending:
    """A request whose `generate` was called and not yet iterated (see `AsyncEngine.abort`)."""

    __slots__ = ("__weakref__", "is_aborted")

    def __init__(self) -> None:
        self.is_aborted = False


class AsyncEngine:
    """Serve one model: submit requests, stream their outputs, abort them; shut down."""

    def __init__(
        self, model: Model, placement: Placement, config: EngineConfig, launcher: RayLauncher | None = None
    ) -> None:
        self.model = model
        self.placement = placement
        self.config = config
        self.graph = model.graph()
        self.resolved = placement.resolve(self.graph)
        self.launcher = launcher
        self.rank_info: dict[int, RankInfo] = {}  # where each rank's Ray actor serves
        system = config.system
        if launcher is not None:
            # The workers' systems got the same config (and CURVE keys) with their launch.
            system = replace(launcher.system, allow_remote=True, host_id=ray_host_id(launcher.node_id))
        self.system = ActorSystem(system)
        self.conductor: ActorRef | None = None
        self.workers: dict[int, ActorRef] = {}
        self.processes: dict[int, SystemProcess] = {}
        self.spec: ModelSpec | None = None
        self.limits = EngineLimits()  # published by the engines at start (`start`)
        self._served = ""  # the ipc address worker processes reach the conductor at
        self.num_restarts = 0
        self._lost: set[int] = set()  # ranks whose worker process died and is not back yet
        self._start_s: dict[int, float] = {}  # rank -> how long its worker's last start took
        self._exited = asyncio.Event()
        self._sentinels: set[int] = set()
        self._preprocessing = ThreadPoolExecutor(2, thread_name_prefix="mstar-preprocess")
        self._not_started: weakref.WeakValueDictionary[str, _Pending] = weakref.WeakValueDictionary()
        self._watchdog: asyncio.Task[None] | None = None
        self._ray_watchers: list[asyncio.Task[None]] = []
        self._links_lost: dict[int, asyncio.Event] = {}  # rank -> the link to its Ray actor broke
        self._is_closed = False

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
        ray_address = placement.cluster_address(config.ray_address)  # backend: ray in the placement file
        if ray_address != config.ray_address:
            config = replace(config, ray_address=ray_address)
        if config.is_distributed and spec is None:
            raise MStarError("worker processes rebuild the model: pass a ModelSpec (or a model with a .spec)")
        if config.is_distributed and spec is not None:
            check_model_factory(spec.factory, config.allowed_model_factories)  # before any process starts
        launcher = None
        if config.ray_address is not None:
            placement.resolve(instance.graph())  # a bad placement fails before the cluster is joined
            launcher = RayLauncher(
                config.ray_address,
                replace(config.system, curve=CurveKeys.generate()),  # the same keys for every system
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
        )
        return engine

    async def _start_actors(self, spec: ModelSpec | None) -> None:
        ranks = self.placement.ranks
        started = time.monotonic()
        if self.launcher is not None:
            launcher = self.launcher
            host = launcher.node_ip()
            self._served = await self.system.serve(f"tcp://{'[' + host + ']' if ':' in host else host}:0")
            self.rank_info = await launcher.start({r: self.placement.ray_resources(r) for r in ranks})
            self.workers = {r: self.system.ref(worker_name(r), info.addresses[0]) for r, info in self.rank_info.items()}
        elif self.config.worker_processes:
            self._served = await self.system.serve("ipc://")
            for rank in ranks:
                self.processes[rank] = self._make_process()
            await asyncio.gather(*(asyncio.to_thread(p.start) for p in self.processes.values()))
            self.workers = {r: self.system.ref(worker_name(r), p.addresses[0]) for r, p in self.processes.items()}
        else:
            self.workers = {r: self.system.ref(worker_name(r)) for r in ranks}
        wait_s, stall_s = self.config.restart_wait_s, self.config.request_stall_timeout_s
        self.conductor = await self.system.spawn(
            lambda: Conductor(self.model, self.graph, self.resolved, self.workers, wait_s, stall_s), name=CONDUCTOR
        )
        if not self.config.is_distributed:
            for rank in ranks:
                await self.system.spawn(self._worker_factory(rank, self.conductor), name=worker_name(rank))
            return
        await asyncio.gather(*(self._init_worker(rank) for rank in ranks))
        self._start_s = dict.fromkeys(ranks, time.monotonic() - started)
        if self.launcher is not None:
            loop = asyncio.get_running_loop()
            self._links_lost = {r: asyncio.Event() for r in ranks}
            self.system.on_link_lost(self._link_lost)
            self._ray_watchers = [loop.create_task(self._watch_ray(r), name=f"mstar-ray-watch-{r}") for r in ranks]
            return
        for rank in ranks:
            self._watch_exit(rank)
        self._watchdog = asyncio.get_running_loop().create_task(self._watch(), name="mstar-watchdog")

    def _make_process(self) -> SystemProcess:
        return SystemProcess(
            "mstar.runtime.worker:setup_worker_host",
            config=self.config.system,
            loop=self.config.loop,
            setup_args={"allowed_model_factories": list(self.config.allowed_model_factories)},
        )

    async def _init_worker(self, rank: int) -> None:
        assert self.spec is not None
        address = self.rank_info[rank].addresses[0] if self.launcher is not None else self.processes[rank].addresses[0]
        host = self.system.ref(HOST_NAME, address)
        init = InitWorker(
            rank,
            self.spec.factory,
            dict(self.spec.kwargs),
            list(self.placement.groups),
            ActorId(self._served, CONDUCTOR),
            {r: ActorId(ref.address, ref.name) for r, ref in self.workers.items()},
            self._worker_config(rank),
            self.placement.model,
        )
        ready = await host.ask(init, timeout=300.0)
        if not isinstance(ready, WorkerReady):
            raise MStarError(f"rank {rank} did not start: {ready!r}")

    def _watch_exit(self, rank: int) -> None:
        """Wake the watchdog as soon as the process of ``rank`` exits (its sentinel turns readable)."""
        sentinel = self.processes[rank].sentinel
        if sentinel is None:
            return
        loop = asyncio.get_running_loop()

        def exited() -> None:
            loop.remove_reader(sentinel)
            self._sentinels.discard(sentinel)
            self._exited.set()

        loop.add_reader(sentinel, exited)
        self._sentinels.add(sentinel)

    async def _watch(self) -> None:
        """Restart dead worker processes; fail the requests that were using them."""
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.config.watchdog_interval_s):
                    await self._exited.wait()
            self._exited.clear()
            for rank, proc in list(self.processes.items()):
                if proc.is_alive or self._is_closed:
                    continue
                log.error("worker_lost", rank=rank, pid=proc.pid)
                self._lost.add(rank)
                assert self.conductor is not None
                self.conductor.tell(WorkerLost(rank, self._start_s.get(rank, 0.0)))
                # Asks waiting on the dead process fail now, not at the heartbeat timeout.
                for address in proc.addresses:
                    self.system.drop_link(address, PeerLostError(f"the worker process of rank {rank} died"))
                if proc.sentinel is not None and proc.sentinel in self._sentinels:
                    self._sentinels.discard(proc.sentinel)
                    asyncio.get_running_loop().remove_reader(proc.sentinel)
                proc.kill()  # reap it (its sentinel closes)
                try:
                    await self._restart(rank)
                except Exception:
                    log.exception("worker_restart_failed", rank=rank)

    async def _restart(self, rank: int) -> None:
        started = time.monotonic()
        proc = self.processes[rank] = self._make_process()
        await asyncio.to_thread(proc.start)  # a child that dies starting is reaped (and retried)
        self._watch_exit(rank)
        self.workers[rank] = self.system.ref(worker_name(rank), proc.addresses[0])
        await self._worker_back(rank)
        self._start_s[rank] = time.monotonic() - started
        log.info("worker_restarted", rank=rank, pid=proc.pid, restart_s=round(self._start_s[rank], 3))

    def _link_lost(self, addresses: list[str], error: Exception) -> None:
        """Wake the watcher of a Ray rank whose link broke (sooner than Ray tells of the death)."""
        for rank, info in self.rank_info.items():
            if rank not in self._lost and set(info.addresses) & set(addresses):
                self._links_lost[rank].set()

    async def _wait_ray_lost(self, rank: int) -> None:
        """Return when ``rank``'s process is gone: Ray says so, or its tcp connection closed."""
        assert self.launcher is not None
        link_lost = self._links_lost[rank]
        waits = [asyncio.ensure_future(self.launcher.wait_lost(rank)), asyncio.ensure_future(link_lost.wait())]
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()
            await asyncio.gather(*waits, return_exceptions=True)
            link_lost.clear()

    async def _watch_ray(self, rank: int) -> None:
        """Hear of the death of ``rank``'s Ray actor; once Ray restarted it, bring it back in."""
        assert self.launcher is not None and self.conductor is not None
        launcher = self.launcher
        while not self._is_closed:
            await self._wait_ray_lost(rank)
            if self._is_closed:
                return
            old = self.rank_info[rank]
            log.error("worker_lost", rank=rank, pid=old.pid, ray_node=old.node_id)
            lost_at = time.monotonic()
            self._lost.add(rank)
            self.conductor.tell(WorkerLost(rank, self._start_s.get(rank, 0.0)))
            for address in old.addresses:
                self.system.drop_link(address, PeerLostError(f"the worker of rank {rank} died"))
            try:
                info = self.rank_info[rank] = await launcher.restarted(rank, old)
                self.workers[rank] = self.system.ref(worker_name(rank), info.addresses[0])
                await self._worker_back(rank)
                self._start_s[rank] = time.monotonic() - lost_at  # Ray's restart and the worker's build
            except WorkerLostError:
                log.error("worker_gone", rank=rank)  # Ray gave up on it: walks fail after restart_wait_s
                return
            except Exception:
                if self._is_closed:
                    return
                log.exception("worker_restart_failed", rank=rank)
                launcher.kill(rank)  # its next incarnation gets another try
                continue
            log.info("worker_restarted", rank=rank, pid=info.pid, ray_node=info.node_id)

    async def _worker_back(self, rank: int) -> None:
        """Build the restarted worker of ``rank``; point the conductor and the other workers at it."""
        ref = self.workers[rank]
        await self._init_worker(rank)
        update = UpdatePeer(rank, ActorId(ref.address, ref.name))
        assert self.conductor is not None
        self.conductor.tell(update)
        for other, peer in self.workers.items():
            if other != rank and other not in self._lost:
                peer.tell(update)
        self._lost.discard(rank)
        self.num_restarts += 1

    def _worker_config(self, rank: int) -> WorkerConfig:
        shares = self.placement.kv_cache_shares(rank)
        return self.config.worker_config(rank, len(self.placement.ranks), shares)

    def _worker_factory(self, rank: int, conductor: ActorRef) -> Callable[[], Worker]:
        config = self._worker_config(rank)
        return lambda: Worker(rank, self.model, self.graph, self.resolved, conductor, self.workers, config)

    async def shutdown(self) -> None:
        """Stop the workers, the worker processes and the conductor; fail running requests."""
        if self._is_closed:
            return
        self._is_closed = True
        if self._watchdog is not None:
            self._watchdog.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watchdog
        for watcher in self._ray_watchers:
            watcher.cancel()
        await asyncio.gather(*self._ray_watchers, return_exceptions=True)
        loop = asyncio.get_running_loop()
        for sentinel in self._sentinels:
            loop.remove_reader(sentinel)
        if self.conductor is not None:
            with contextlib.suppress(Exception):
                await self.system.stop(self.conductor)
        if not self.config.is_distributed:
            for ref in self.workers.values():
                with contextlib.suppress(Exception):
                    await self.system.stop(ref)
        for proc in self.processes.values():
            await asyncio.to_thread(proc.stop)
        if self.launcher is not None:
            with contextlib.suppress(Exception):
                await self.launcher.stop()
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
            prepared = await loop.run_in_executor(self._preprocessing, self.model.preprocess, request)
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
        return {rank: rank not in self._lost for rank in self.placement.ranks}

    async def held_state(self) -> dict[str, dict[str, int]]:
        """Ask the conductor and every live worker what they hold for requests (zeros when idle).

        A lost worker (see `ranks_up`) holds nothing and is left out.
        """
        assert self.conductor is not None
        up = self.ranks_up()
        refs = {"conductor": self.conductor} | {f"rank{r}": ref for r, ref in self.workers.items() if up[r]}
        out: dict[str, dict[str, int]] = {}
        for name, ref in refs.items():
            report = await ref.ask(StateQuery(), timeout=30.0)
            assert isinstance(report, StateReport)
            out[name] = dict(report.counts)
        return out

    async def _gather_limits(self) -> EngineLimits:
        """Ask every worker, once, what its engines accept."""
        reports = {rank: await ref.ask(LimitsQuery(), timeout=60.0) for rank, ref in self.workers.items()}
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
            if rank in self.processes or rank in self.rank_info:  # in-process workers share this process's links
                out.transport[f"rank{rank}"] = {kind: dict(v) for kind, v in report.transport.items()}
        return out

    async def run(self, request: Request) -> list[Output]:
        """Run a request to completion and return all its outputs."""
        return [out async for out in self.generate(request)]




