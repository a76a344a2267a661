"""`Ranks`: every rank's worker, started, watched, restarted when it dies, and stopped.

In this process (actors on the in-process transport), in worker processes of their own
(``spawn``-started `SystemProcess`es, talking ZeroMQ over ipc sockets), or as Ray actors
(`RayLauncher`, ZeroMQ over tcp with CURVE keys). A worker process that exits, or a Ray
actor whose link breaks or that Ray reports dead, is reported to the conductor
(`WorkerLost`: its requests fail) and started again; once it is back, the conductor and the
other workers are pointed at it (`UpdatePeer`).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import structlog

from mstar.actors import ActorRef, ActorSystem
from mstar.actors.process import SystemProcess
from mstar.errors import (
    ActorDeadError,
    MStarError,
    PeerLostError,
    PlacementError,
    WorkerLostError,
)
from mstar.graph import ModelGraph
from mstar.runtime.conductor import WorkerLost
from mstar.runtime.engine_config import EngineConfig
from mstar.runtime.messages import InitWorker, UpdatePeer, WorkerReady
from mstar.runtime.model import Model, ModelSpec
from mstar.runtime.placement import Placement, TensorParallelRole
from mstar.runtime.ray_launcher import RankInfo, RayLauncher
from mstar.runtime.worker import HOST_NAME, Worker, worker_name
from mstar.runtime.worker_core import WorkerConfig
from mstar.transport.janitor import SHM_DIR, make_owned_name
from mstar.wire import ActorId

__all__ = ["CONDUCTOR", "Ranks"]

log = structlog.get_logger(__name__)

CONDUCTOR = "conductor"
"""The conductor's actor name."""


class Ranks:
    """The workers of a placement's ranks, and their supervision."""

    def __init__(
        self,
        model: Model,
        graph: ModelGraph,
        resolved: dict[tuple[str, str], tuple[int, ...]],
        placement: Placement,
        config: EngineConfig,
        system: ActorSystem,
        launcher: RayLauncher | None,
    ) -> None:
        self.model, self.graph, self.resolved = model, graph, resolved
        self.placement, self.config, self.system, self.launcher = (
            placement,
            config,
            system,
            launcher,
        )
        self.workers: dict[int, ActorRef] = {}
        self.processes: dict[int, SystemProcess] = {}
        self.rank_info: dict[int, RankInfo] = {}  # where each rank's Ray actor serves
        self.spec: ModelSpec | None = None
        self.conductor: ActorRef | None = None
        self.num_restarts = 0
        self._served = ""  # the address worker processes reach the conductor at
        self._lost: set[int] = set()  # ranks whose worker died and is not back yet
        self._start_s: dict[int, float] = {}  # rank -> how long its worker's last start took
        self._started_at = 0.0
        self._exited = asyncio.Event()
        self._sentinels: set[int] = set()
        self._watchdog: asyncio.Task[None] | None = None
        self._ray_watchers: list[asyncio.Task[None]] = []
        self._links_lost: dict[int, asyncio.Event] = {}  # rank -> the link to its Ray actor broke
        self._is_closed = False
        # Tensor-parallel groups (node group index, nodes, ranks), each one's shared-memory
        # channel (a fresh one each time the group restarts), and those restarting now.
        self._tp_groups = placement.tensor_parallel_groups()
        self._tp_channels = [make_owned_name() for _ in self._tp_groups]
        self._tp_restarting: set[int] = set()
        # Groups spread over machines (allow_cross_node_tp) meet at a TCPStore this process
        # serves: group -> its address.
        self._tp_stores: dict[int, str] = {}
        self._store: Any = None

    def up(self) -> dict[int, bool]:
        """Return, per rank, whether its worker serves now (False while a lost one restarts)."""
        return {rank: rank not in self._lost for rank in self.placement.ranks}

    def is_remote(self, rank: int) -> bool:
        """Whether the worker of ``rank`` runs in a process of its own."""
        return rank in self.processes or rank in self.rank_info

    async def launch(self, spec: ModelSpec | None) -> dict[int, ActorRef]:
        """Start the processes or Ray actors the workers will run in; return the workers' refs.

        In-process workers are spawned by `start_workers`, once the conductor is.
        """
        self.spec = spec
        self._started_at = time.monotonic()
        ranks = self.placement.ranks
        self._cuda_groups()
        if self.launcher is not None:
            launcher = self.launcher
            host = launcher.node_ip()
            self._served = await self.system.serve(
                f"tcp://{'[' + host + ']' if ':' in host else host}:0"
            )
            self.rank_info = await launcher.start(
                {r: self.placement.ray_resources(r) for r in ranks},
                together=[
                    group
                    for i, _, group in self._tp_groups
                    if not self.placement.groups[i].allow_cross_node_tp
                ],
            )
            self.workers = {
                r: self.system.ref(worker_name(r), info.addresses[0])
                for r, info in self.rank_info.items()
            }
            for g, (i, _, group) in enumerate(self._tp_groups):
                nodes = {self.rank_info[r].node_id for r in group}
                if len(nodes) == 1:
                    continue
                if not self.placement.groups[i].allow_cross_node_tp:  # STRICT_PACK prevents it
                    raise PlacementError(
                        f"node_groups[{i}]: the tensor-parallel ranks {list(group)} landed on "
                        f"{len(nodes)} Ray nodes without allow_cross_node_tp"
                    )
                self._tp_stores[g] = self._store_address(host)
        elif self.config.worker_processes:
            self._served = await self.system.serve("ipc://")
            for rank in ranks:
                self.processes[rank] = self._make_process()
            await asyncio.gather(*(asyncio.to_thread(p.start) for p in self.processes.values()))
            self.workers = {
                r: self.system.ref(worker_name(r), p.addresses[0])
                for r, p in self.processes.items()
            }
        else:
            self.workers = {r: self.system.ref(worker_name(r)) for r in ranks}
        return self.workers

    async def start_workers(self, conductor: ActorRef) -> None:
        """Build every rank's worker (talking to ``conductor``); watch those in processes of their
        own."""
        self.conductor = conductor
        ranks = self.placement.ranks
        if not self.config.is_distributed:
            for rank in ranks:
                try:
                    await self.system.spawn(
                        self._worker_factory(rank, conductor), name=worker_name(rank)
                    )
                except ActorDeadError as exc:
                    if isinstance(exc.__cause__, MStarError):  # a typed error says it best
                        raise exc.__cause__ from None
                    raise
            return
        await asyncio.gather(*(self._init_worker(rank) for rank in ranks))
        self._start_s = dict.fromkeys(ranks, time.monotonic() - self._started_at)
        if self.launcher is not None:
            loop = asyncio.get_running_loop()
            self._links_lost = {r: asyncio.Event() for r in ranks}
            self.system.on_link_lost(self._link_lost)
            self._ray_watchers = [
                loop.create_task(self._watch_ray(r), name=f"mstar-ray-watch-{r}") for r in ranks
            ]
            return
        for rank in ranks:
            self._watch_exit(rank)
        self._watchdog = asyncio.get_running_loop().create_task(
            self._watch(), name="mstar-watchdog"
        )

    async def stop_watching(self) -> None:
        """Stop restarting workers (the first step of a shutdown)."""
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

    async def stop(self) -> None:
        """Stop every worker, and the processes or Ray actors they ran in."""
        if not self.config.is_distributed:
            for ref in self.workers.values():
                with contextlib.suppress(Exception):
                    await self.system.stop(ref)
        for proc in self.processes.values():
            await asyncio.to_thread(proc.stop)
        if self.launcher is not None:
            with contextlib.suppress(Exception):
                await self.launcher.stop()
        for channel, (_, nodes, _) in zip(self._tp_channels, self._tp_groups, strict=True):
            _remove_channel(channel, len(nodes))  # what a killed rank left

    def _make_process(self) -> SystemProcess:
        return SystemProcess(
            "mstar.runtime.worker:setup_worker_host",
            config=self.config.system,
            loop=self.config.loop,
            setup_args={"allowed_model_factories": list(self.config.allowed_model_factories)},
        )

    async def _init_worker(self, rank: int) -> None:
        assert self.spec is not None
        address = (
            self.rank_info[rank].addresses[0]
            if self.launcher is not None
            else self.processes[rank].addresses[0]
        )
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
        """Wake the watchdog as soon as the process of ``rank`` exits (its sentinel turns
        readable)."""
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
                    self.system.drop_link(
                        address, PeerLostError(f"the worker process of rank {rank} died")
                    )
                if proc.sentinel is not None and proc.sentinel in self._sentinels:
                    self._sentinels.discard(proc.sentinel)
                    asyncio.get_running_loop().remove_reader(proc.sentinel)
                proc.kill()  # reap it (its sentinel closes)
                self._restart_tensor_parallel_peers(rank)
                try:
                    await self._restart(rank)
                except Exception:
                    log.exception("worker_restart_failed", rank=rank)

    def _cuda_groups(self) -> None:
        """Tensor-parallel groups of CUDA ranks sum through torch.distributed (NCCL), a process
        per rank, meeting at a store this process serves (shared memory holds CPU tensors)."""
        host = self.launcher.node_ip() if self.launcher is not None else "127.0.0.1"
        for g, (i, _, group) in enumerate(self._tp_groups):
            if not any(self.config.devices.get(r, "cpu").startswith("cuda") for r in group):
                continue
            if not self.config.is_distributed:
                raise PlacementError(
                    f"node_groups[{i}]: tensor parallelism over CUDA ranks takes a process per "
                    "rank (worker processes, or Ray)"
                )
            self._tp_stores[g] = self._store_address(host)

    def _store_address(self, host: str) -> str:
        """Serve the TCPStore where groups over machines meet (once); return its address."""
        if self._store is None:
            import torch.distributed as dist

            self._store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False)
        return f"{host}:{self._store.port}"

    def _restart_tensor_parallel_peers(self, rank: int) -> None:
        """A tensor-parallel group restarts as a unit: when one of its ranks is lost, the others
        are stopped too (their requests fail, as the lost one's) and the group comes back on a
        fresh channel."""
        for g, (_, nodes, ranks) in enumerate(self._tp_groups):
            if rank not in ranks or g in self._tp_restarting:
                continue
            self._tp_restarting.add(g)
            _remove_channel(self._tp_channels[g], len(nodes))
            self._tp_channels[g] = make_owned_name()
            for other in ranks:
                if other == rank or other in self._lost:
                    continue
                proc = self.processes.get(other)
                if proc is not None and not proc.is_alive:
                    continue
                log.warning("tensor_parallel_group_restarts", rank=other, lost=rank)
                # Down from now on (the group restarts once all of it is back); its watcher
                # reports and restarts it next (a process's sentinel fires; Ray restarts an
                # actor it sees die).
                self._lost.add(other)
                if proc is not None:
                    proc.kill()
                elif self.launcher is not None:
                    self.launcher.kill(other)

    async def _restart(self, rank: int) -> None:
        started = time.monotonic()
        proc = self.processes[rank] = self._make_process()
        await asyncio.to_thread(proc.start)  # a child that dies starting is reaped (and retried)
        self._watch_exit(rank)
        self.workers[rank] = self.system.ref(worker_name(rank), proc.addresses[0])
        await self._worker_back(rank)
        self._start_s[rank] = time.monotonic() - started
        log.info(
            "worker_restarted", rank=rank, pid=proc.pid, restart_s=round(self._start_s[rank], 3)
        )

    def _link_lost(self, addresses: list[str], error: Exception) -> None:
        """Wake the watcher of a Ray rank whose link broke (sooner than Ray tells of the death)."""
        for rank, info in self.rank_info.items():
            if rank not in self._lost and set(info.addresses) & set(addresses):
                self._links_lost[rank].set()

    async def _wait_ray_lost(self, rank: int) -> None:
        """Return when ``rank``'s process is gone: Ray says so, or its tcp connection closed."""
        assert self.launcher is not None
        link_lost = self._links_lost[rank]
        waits = [
            asyncio.ensure_future(self.launcher.wait_lost(rank)),
            asyncio.ensure_future(link_lost.wait()),
        ]
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
            self._restart_tensor_parallel_peers(rank)
            self.conductor.tell(WorkerLost(rank, self._start_s.get(rank, 0.0)))
            for address in old.addresses:
                self.system.drop_link(address, PeerLostError(f"the worker of rank {rank} died"))
            try:
                info = self.rank_info[rank] = await launcher.restarted(rank, old)
                self.workers[rank] = self.system.ref(worker_name(rank), info.addresses[0])
                await self._worker_back(rank)
                # Ray's restart and the worker's build
                self._start_s[rank] = time.monotonic() - lost_at
            except WorkerLostError:
                # Ray gave up on it: walks fail after restart_wait_s
                log.error("worker_gone", rank=rank)
                return
            except Exception:
                if self._is_closed:
                    return
                log.exception("worker_restart_failed", rank=rank)
                launcher.kill(rank)  # its next incarnation gets another try
                continue
            log.info("worker_restarted", rank=rank, pid=info.pid, ray_node=info.node_id)

    async def _worker_back(self, rank: int) -> None:
        """Build the restarted worker of ``rank``; point the conductor and the other workers at
        it."""
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
        self._tp_restarting -= {
            g for g in self._tp_restarting if not self._lost & set(self._tp_groups[g][2])
        }

    def _worker_config(self, rank: int) -> WorkerConfig:
        shares = self.placement.kv_cache_shares(rank)
        config = self.config.worker_config(rank, len(self.placement.ranks), shares)
        roles = tuple(
            TensorParallelRole(
                nodes, ranks, self._tp_channels[g], f"node_groups[{i}]", self._tp_stores.get(g)
            )
            for g, (i, nodes, ranks) in enumerate(self._tp_groups)
            if rank in ranks
        )
        return replace(config, tensor_parallel=roles) if roles else config

    def _worker_factory(self, rank: int, conductor: ActorRef) -> Callable[[], Worker]:
        config = self._worker_config(rank)
        return lambda: Worker(
            rank, self.model, self.graph, self.resolved, conductor, self.workers, config
        )


def _remove_channel(channel: str, num_nodes: int) -> None:
    """Remove a tensor-parallel group's shared-memory files (one per node)."""
    for i in range(num_nodes):
        (SHM_DIR / f"{channel}.{i}").unlink(missing_ok=True)
