"""Workers on a Ray cluster: each rank's worker process started, placed and restarted by Ray.

    launcher = RayLauncher("ray://head:10001" or "auto", system_config, ...)
    infos = await launcher.start({0: {"node_a": 1}, 1: {"node_b": 1}})   # a Ray actor per rank
    ...
    await launcher.wait_lost(rank)        # returns when that process died
    info = await launcher.restarted(rank, info)   # Ray restarted it (on a node with the resources)

Each rank runs in a Ray actor (`RankHost`) pinned by custom resources that the placement file
names per node group (``ray_resources: {node_a: 1}``; the cluster's nodes advertise them,
``ray start --resources '{"node_a": 4}'``). The launcher reserves them first, all at once, as
one Ray placement group with a bundle per rank (its CPUs and resources; strategy ``PACK``, so
ranks that name no resource share nodes), and schedules each rank's actor on its bundle: a
placement the cluster cannot satisfy fails within ``placement_timeout_s`` with a
`PlacementError` naming the ranks and what the nodes offer, before any worker starts. When a
node dies, Ray reschedules its bundles on nodes that still offer the resources and restarts
the actors there. The actor's process runs an mstar actor system on
a thread of its own, serving tcp on its node's address with the deployment's CURVE keys, and
a worker host there, exactly as a local worker process does. Ray starts, supervises and
restarts these processes (``max_restarts``); the data plane stays mstar's: ZeroMQ over tcp,
tensors out of band, never Ray's object store. The conductor and the HTTP server stay on
the driver.

Joining the cluster (`RayLauncher.connect`) is bounded: an address where nothing listens fails
at once, and one that does not take this driver in within ``connect_timeout_s`` fails then,
both with `RayClusterUnreachableError` naming the address; ``ray.init`` runs on a thread of
its own meanwhile, so that the event loop (and a SIGTERM) is never held up by Ray's retries.
A loopback address (``127.0.0.1:6379``) means a cluster on this machine: Ray is then kept on
loopback (``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` before it is imported), since otherwise it
rewrites the address to the machine's network address, where a head bound to loopback
refuses it.

Ray is an optional dependency (``pip install 'mstar[ray]'``): it is imported only here, and
only when a launcher is made.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import os
import socket
import sys
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import msgspec
import structlog

from mstar.actors.config import SystemConfig
from mstar.errors import MStarError, PlacementError, RayClusterUnreachableError, WorkerLostError

__all__ = ["LOOPBACK_ENV", "RankHost", "RankInfo", "RayLauncher", "cluster_endpoint", "ray_host_id"]

log = structlog.get_logger(__name__)

# Ray reads it once, when imported: "0" keeps this process's Ray on loopback (127.0.0.1) rather
# than the machine's network address.
LOOPBACK_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
# "1" keeps Ray's crash handler out of this process: it takes SIGTERM too, and aborts the
# process 3 s later (an alarm it arms), cutting a graceful drain short.
NO_SIGNAL_HANDLER_ENV = "RAY_DISABLE_FAILURE_SIGNAL_HANDLER"
# How long a tcp connection to the cluster's address may take before it counts as unreachable.
_PROBE_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class RankInfo:
    """Where a rank's Ray actor runs now (one incarnation of it)."""

    addresses: list[str]
    system_id: str
    node_id: str
    pid: int


def ray_host_id(node_id: str) -> str:
    """Return the host id of actor systems on the Ray node ``node_id``.

    Ray nodes are the unit of placement: two ranks on one node share memory, two ranks on
    different nodes talk tcp, also when a test cluster runs its nodes on one machine.
    """
    from mstar.actors.system import default_host_id

    return f"{default_host_id()}/ray:{node_id}"


def cluster_endpoint(address: str) -> tuple[str, int] | None:
    """Return the host and port that ``address`` names, or None where Ray finds the cluster itself.

    ``"auto"`` stands for ``$RAY_ADDRESS`` when set, else for the cluster ``ray start`` last
    started on this machine (the file Ray reads for it); ``"ray://host:port"`` (Ray Client)
    and ``"host:port"`` name their head; anything else is left to Ray.
    """
    if address == "auto":
        address = os.environ.get("RAY_ADDRESS") or _current_cluster() or "auto"
    address = address.removeprefix("ray://")
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or not host:
        return None
    return host.removeprefix("[").removesuffix("]"), int(port)


def _current_cluster() -> str | None:
    """Return the address ``ray start --head`` recorded on this machine, if any (read as Ray
    does)."""
    temp = os.environ.get("RAY_TMPDIR") or os.environ.get("TMPDIR") or "/tmp"
    try:
        return (Path(temp) / "ray" / "ray_current_cluster").read_text().strip() or None
    except OSError:
        return None


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _keep_ray_on_loopback(address: str) -> None:
    """Before Ray is imported: keep it on loopback where the cluster is on loopback.

    Ray otherwise replaces a loopback address by the machine's network address (to be
    reachable by other machines) and retries that for many minutes, while a head started on
    loopback listens on 127.0.0.1 only. With the variable Ray stays on loopback; a head bound
    to every address accepts loopback as well, so this is safe for any cluster named by a
    loopback address.

    Raises:
        RayClusterUnreachableError: Ray was imported before, without the variable.
    """
    endpoint = cluster_endpoint(address)
    if endpoint is None or not _is_loopback(endpoint[0]):
        return
    if "ray" not in sys.modules:
        os.environ.setdefault(LOOPBACK_ENV, "0")
    elif os.environ.get(LOOPBACK_ENV) != "0":
        raise RayClusterUnreachableError(
            f"the Ray cluster at {address} is on loopback, but Ray was imported already and "
            "would use this "
            f"machine's network address instead: set {LOOPBACK_ENV}=0 before Ray is imported "
            "(or call ray.init "
            f"yourself)"
        )


def _probe(address: str) -> None:
    """Fail at once where nothing listens at the address of the cluster's head.

    Raises:
        RayClusterUnreachableError: The connection was refused or timed out.
    """
    endpoint = cluster_endpoint(address)
    if endpoint is None:
        return
    host, port = endpoint
    try:
        with socket.create_connection((host, port), timeout=_PROBE_TIMEOUT_S):
            pass
    except OSError as exc:
        raise RayClusterUnreachableError(
            f"cannot reach the Ray cluster at {address}: {exc.strerror or exc}; check that "
            "its head runs there "
            "(ray start --head --port "
            f"{port}{' --node-ip-address ' + host if _is_loopback(host) else ''}) "
            f"and that this machine reaches {host}:{port}"
        ) from None


class RankHost:
    """The Ray actor hosting one rank's worker: an mstar actor system on a thread of its own.

    Its methods are coroutines, so that Ray runs it as an async actor: `wait_stopped` stays
    open on Ray's event loop without holding up `info` and `stop`.

    Args:
        config_json: The system's `SystemConfig` (msgspec JSON; CURVE keys included).
        setup_args_json: Keyword arguments of `mstar.runtime.worker.setup_worker_host`.
        loop: ``"asyncio"`` or ``"uvloop"``.
    """

    def __init__(self, config_json: str, setup_args_json: str, loop: str = "asyncio") -> None:
        import ray

        node_id = ray.get_runtime_context().get_node_id()
        host = ray.util.get_node_ip_address()
        config = msgspec.json.decode(config_json, type=SystemConfig)
        self._config = replace(config, allow_remote=True, host_id=ray_host_id(node_id))
        self._setup_args = msgspec.json.decode(setup_args_json)
        self._serve_at = f"tcp://{'[' + host + ']' if ':' in host else host}:0"
        self._node_id = node_id
        self._ready = threading.Event()
        self._error: str | None = None
        self._info: RankInfo | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._stopped = threading.Event()
        self._on_stopped: list[Any] = []
        self._thread = threading.Thread(
            target=self._main, args=(loop,), name="mstar-rank-host", daemon=True
        )
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            raise MStarError(f"the rank host did not start: {self._error}")

    def _main(self, loop: str) -> None:
        try:
            if loop == "uvloop":
                import uvloop

                uvloop.run(self._serve())
            else:
                asyncio.run(self._serve())
        finally:
            self._stopped.set()
            self._ready.set()
            for notify in list(self._on_stopped):
                notify()

    async def _serve(self) -> None:
        from mstar.actors.system import ActorSystem
        from mstar.runtime.worker import setup_worker_host

        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        try:
            async with ActorSystem(self._config) as system:
                address = await system.serve(self._serve_at)
                await setup_worker_host(system, **self._setup_args)
                self._info = RankInfo([address], system.system_id, self._node_id, os.getpid())
                self._ready.set()
                await self._stop.wait()
        except Exception as exc:
            self._error = f"{type(exc).__name__}: {exc}"
            self._ready.set()

    async def info(self) -> RankInfo:
        """Return where this incarnation serves."""
        assert self._info is not None
        return self._info

    async def wait_stopped(self) -> None:
        """Return once the host stopped (a call the driver keeps open, to hear of this process's
        death)."""
        ray_loop = asyncio.get_running_loop()
        stopped: asyncio.Future[None] = ray_loop.create_future()

        def resolve() -> None:
            if not stopped.done():
                stopped.set_result(None)

        def notify() -> None:
            ray_loop.call_soon_threadsafe(resolve)

        self._on_stopped.append(notify)
        if self._stopped.is_set():
            return
        await stopped

    async def stop(self) -> None:
        """Shut the actor system down (the worker's engines close); return once it did."""
        loop, stop = self._loop, self._stop
        if loop is not None and stop is not None and not self._stopped.is_set():
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(stop.set)
        await asyncio.get_running_loop().run_in_executor(None, self._stopped.wait, 30.0)


STOP_GRACE_S = 10.0
"""How long `RayLauncher.stop` lets the ranks' actors stop by themselves before killing them."""


async def _ray_call(ref: Any) -> Any:
    """Await a Ray object ref on any event loop (asyncio or uvloop)."""
    return await asyncio.wrap_future(ref.future())


class RayLauncher:
    """Start, watch and stop the rank actors of one engine on a Ray cluster.

    Args:
        address: The cluster (``"auto"``, ``"ray://host:10001"``, ``"host:6379"``); an
            already initialised Ray (``ray.init`` called by the application) is used as it is.
        system: The `SystemConfig` of every rank's actor system (with the CURVE keys).
        setup_args: Keyword arguments of the worker host (the model allow-list).
        loop: Event loop of the rank hosts.
        num_cpus: CPUs each rank's actor reserves.
        max_restarts: How often Ray restarts a rank's process (-1: without limit).
        placement_timeout_s: How long the cluster may take to reserve every rank's resources.

    Raises:
        RayClusterUnreachableError: The address is on loopback and Ray was imported without
            `LOOPBACK_ENV` (it would not stay there).
    """

    def __init__(
        self,
        address: str,
        system: SystemConfig,
        setup_args: Mapping[str, Any],
        *,
        loop: str = "asyncio",
        num_cpus: float = 1.0,
        max_restarts: int = -1,
        placement_timeout_s: float = 60.0,
    ) -> None:
        ray_module = sys.modules.get("ray")
        if ray_module is None:
            os.environ.setdefault(NO_SIGNAL_HANDLER_ENV, "1")  # Ray reads it when imported
        if ray_module is None or not ray_module.is_initialized():
            _keep_ray_on_loopback(address)
        try:
            import ray
        except ImportError as exc:
            raise MStarError(
                "serving on a Ray cluster needs Ray: pip install 'mstar[ray]'"
            ) from exc
        self._ray = ray
        self.address = address
        self._owns_ray = False  # set once connect joined the cluster
        self.system = system
        self._config_json = msgspec.json.encode(system).decode()
        self._setup_json = msgspec.json.encode(dict(setup_args)).decode()
        self._loop = loop
        self._num_cpus = num_cpus
        self._max_restarts = max_restarts
        self._placement_timeout_s = placement_timeout_s
        self._actors: dict[int, Any] = {}
        self._groups: list[Any] = []  # the placement groups reserving the ranks' bundles
        self._remote = ray.remote(RankHost)

    async def connect(self, timeout_s: float = 60.0) -> None:
        """Join the cluster (unless the application initialised Ray); give up after ``timeout_s``.

        ``ray.init`` runs on a daemon thread: it blocks for as long as Ray retries the head
        (minutes), and neither the event loop nor a signal should wait for it. A thread left
        behind by a timeout or a cancellation leaves the cluster again if it joins late.

        Raises:
            RayClusterUnreachableError: Nothing listens at the address, Ray refused it, or
                joining took longer than ``timeout_s``.
        """
        ray = self._ray
        if ray.is_initialized():
            return
        address = self.address
        log.info("ray_connecting", address=address, timeout_s=timeout_s)
        await asyncio.to_thread(_probe, address)
        loop = asyncio.get_running_loop()
        joined: asyncio.Future[BaseException | None] = loop.create_future()
        abandoned = threading.Event()

        def settle(outcome: BaseException | None) -> None:
            if abandoned.is_set():  # this gave up just before: leave the cluster again
                if outcome is None:
                    ray.shutdown()
            elif not joined.done():
                joined.set_result(outcome)

        def join() -> None:
            outcome: BaseException | None = None
            try:
                ray.init(address=address, log_to_driver=False)
            # reported to the awaiting task, which raises its own error
            except BaseException as exc:
                outcome = exc
            if abandoned.is_set():
                if outcome is None:
                    ray.shutdown()
                return
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                loop.call_soon_threadsafe(settle, outcome)

        threading.Thread(target=join, name="mstar-ray-connect", daemon=True).start()
        try:
            async with asyncio.timeout(timeout_s):
                outcome = await asyncio.shield(joined)
        except BaseException as exc:
            abandoned.set()
            if joined.done() and joined.result() is None:
                ray.shutdown()  # it joined just as this gave up
            if isinstance(exc, TimeoutError):
                raise RayClusterUnreachableError(
                    f"joining the Ray cluster at {address} took longer than {timeout_s:g} s: "
                    "check that it is the "
                    f"address of a Ray head (ray status --address {address}), that this "
                    "machine can reach "
                    "every node of the cluster, and, if the cluster uses token "
                    "authentication (ray start "
                    f"says so), that RAY_AUTH_MODE=token is set here as well"
                ) from None
            raise
        if outcome is not None:
            raise RayClusterUnreachableError(
                f"cannot join the Ray cluster at {address}: {type(outcome).__name__}: "
                f"{outcome}; if the cluster "
                "uses token authentication (ray start says so), set RAY_AUTH_MODE=token "
                "here as well"
            ) from outcome
        self._owns_ray = True
        log.info("ray_connected", address=address, node_ip=self.node_ip())

    @property
    def node_id(self) -> str:
        """The Ray node of this driver (where the conductor runs)."""
        return str(self._ray.get_runtime_context().get_node_id())

    def node_ip(self) -> str:
        """The address of this driver's node, as the cluster sees it."""
        return str(self._ray.util.get_node_ip_address())

    def bundle(self, rank: int, resources: Mapping[str, float]) -> dict[str, float]:
        """Return the placement-group bundle of ``rank``: its actor's CPUs and ``resources``.

        Raises:
            PlacementError: The bundle would be empty (Ray cannot reserve nothing).
        """
        out = {"CPU": float(self._num_cpus)} if self._num_cpus > 0 else {}
        out.update({name: float(amount) for name, amount in resources.items()})
        if not any(v > 0 for v in out.values()):
            raise PlacementError(
                f"rank {rank} asks Ray for nothing: give it ray_resources, or CPUs "
                "(ray_num_cpus > 0)"
            )
        return out

    async def start(
        self,
        resources: Mapping[int, Mapping[str, float]],
        together: Sequence[Sequence[int]] = (),
    ) -> dict[int, RankInfo]:
        """Reserve a bundle per rank (``rank -> resources``), start each rank's actor on its own.

        The ranks of each set in ``together`` (a tensor-parallel group's) are reserved as a
        placement group of their own with strategy ``STRICT_PACK``: on one node; the others
        together with ``PACK``. Returns where each rank serves.

        Raises:
            PlacementError: The cluster did not reserve every bundle within the timeout.
        """
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        ranks = sorted(resources)
        packed = {r for group in together for r in group}
        sets = [("STRICT_PACK", sorted(g)) for g in together]
        rest = [r for r in ranks if r not in packed]
        if rest:
            sets.append(("PACK", rest))
        where: dict[int, tuple[Any, int]] = {}  # rank -> (its placement group, bundle index)
        for strategy_name, members in sets:
            bundles = [self.bundle(r, resources[r]) for r in members]
            group = placement_group(bundles, strategy=strategy_name)
            self._groups.append(group)
            try:
                await asyncio.wait_for(_ray_call(group.ready()), self._placement_timeout_s)
            except TimeoutError:
                raise PlacementError(self._unplaced(members, bundles, strategy_name)) from None
            where.update({r: (group, i) for i, r in enumerate(members)})
        log.info("ray_placed", ranks=ranks, together=[list(g) for g in together])
        for rank in ranks:
            group, index = where[rank]
            strategy = PlacementGroupSchedulingStrategy(
                placement_group=group, placement_group_bundle_index=index
            )
            self._actors[rank] = self._remote.options(
                num_cpus=self._num_cpus,
                resources=dict(resources[rank]),
                max_restarts=self._max_restarts,
                max_task_retries=0,
                scheduling_strategy=strategy,
            ).remote(self._config_json, self._setup_json, self._loop)
        infos = await asyncio.gather(*(self.info(r) for r in ranks))
        return dict(zip(ranks, infos, strict=True))

    def _unplaced(
        self, ranks: list[int], bundles: list[dict[str, float]], strategy: str = "PACK"
    ) -> str:
        """Say why the placement group of ``bundles`` is not ready: what no node has, or is free
        now."""
        nodes = [n for n in self._ray.nodes() if n.get("Alive")]
        offers = (
            "; ".join(f"{n['NodeID'][:8]}: {_fmt(n.get('Resources', {}))}" for n in nodes)
            or "no node"
        )
        never = [
            f"rank {r} {_fmt(b)}"
            for r, b in zip(ranks, bundles, strict=True)
            if not any(
                all(n.get("Resources", {}).get(k, 0.0) >= v for k, v in b.items()) for n in nodes
            )
        ]
        what = (
            f"no node of the cluster offers {', '.join(never)}"
            if never
            else f"no node offers ranks {ranks} all at once (a tensor-parallel group's share a "
            "node)"
            if strategy == "STRICT_PACK"
            else "every rank fits some node, but not all of them at once with what is free now"
        )
        return (
            f"the Ray cluster did not place the ranks within {self._placement_timeout_s:g} "
            f"s: {what} "
            f"(nodes: {offers}); name resources the cluster's nodes advertise (ray start "
            "--resources)"
        )

    async def info(self, rank: int) -> RankInfo:
        """Return where the actor of ``rank`` serves (waiting while Ray restarts it)."""
        ray = self._ray
        while True:
            try:
                return await _ray_call(self._actors[rank].info.remote())
            except ray.exceptions.ActorUnavailableError:
                await asyncio.sleep(0.1)  # restarting: Ray answers once it is back
            except ray.exceptions.RayActorError as exc:
                raise WorkerLostError(
                    f"the Ray actor of rank {rank} is dead for good: {exc}"
                ) from exc

    async def wait_lost(self, rank: int) -> None:
        """Return when the process of ``rank``'s current incarnation is gone."""
        ray = self._ray
        with contextlib.suppress(ray.exceptions.RayError):
            await _ray_call(self._actors[rank].wait_stopped.remote())

    async def restarted(self, rank: int, old: RankInfo) -> RankInfo:
        """Return the next incarnation of ``rank``'s actor (forcing a restart if the old one
        lives)."""
        info = await self.info(rank)
        if info.system_id == old.system_id:
            # The call broke but the process lives: restart it, so that nothing stale serves.
            self._ray.kill(self._actors[rank], no_restart=False)
            while info.system_id == old.system_id:
                await asyncio.sleep(0.1)
                info = await self.info(rank)
        return info

    def kill(self, rank: int) -> None:
        """Kill the process of ``rank`` (Ray restarts it): what a rank that will not come back in
        gets."""
        with contextlib.suppress(self._ray.exceptions.RayError):
            self._ray.kill(self._actors[rank], no_restart=False)

    async def stop(self) -> None:
        """Stop every rank's actor (for good), then leave the cluster if this launcher joined it."""
        ray = self._ray
        stops = []
        for actor in self._actors.values():
            with contextlib.suppress(ray.exceptions.RayError):
                stops.append(actor.stop.remote())
        # Together and bounded: an actor still starting (importing, loading on a busy machine)
        # answers only once it has started, and a stop must not wait for that, rank by rank.
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(
                asyncio.gather(*map(_ray_call, stops), return_exceptions=True), STOP_GRACE_S
            )
        for actor in self._actors.values():
            with contextlib.suppress(ray.exceptions.RayError):
                ray.kill(actor, no_restart=True)
        self._actors.clear()
        if self._groups:
            from ray.util.placement_group import remove_placement_group

            for group in self._groups:
                with contextlib.suppress(ray.exceptions.RayError):
                    remove_placement_group(group)
            self._groups = []
        if self._owns_ray:
            ray.shutdown()


def _fmt(resources: Mapping[str, float]) -> str:
    return (
        "{"
        + ", ".join(
            f"{k}: {v:g}" for k, v in sorted(resources.items()) if not k.startswith("node:")
        )
        + "}"
    )
