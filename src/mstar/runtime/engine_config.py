"""`EngineConfig`: how an `AsyncEngine` runs; `EngineStats` and `EngineLimits`: what it reports."""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass, field

from mstar.actors import SystemConfig
from mstar.engines.limits import NodeLimits
from mstar.engines.stateless import StatelessEngineConfig
from mstar.runtime.messages import WalkStepStats
from mstar.runtime.worker_core import WorkerConfig

__all__ = ["EngineConfig", "EngineLimits", "EngineStats"]


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
        deterministic: Serve deterministically: a request with a given seed produces the
            same bytes (tokens, log-probabilities, audio, images, latents, actions) whatever
            else shares its steps, however its prompt is chunked, whether it was preempted
            or hit the prefix cache, on any placement and at any thread count (CPU ranks;
            see the README's "Deterministic serving"). Each row of a step is computed as
            it would be alone: tiled products, attention and sampling per row, stateless
            nodes one input at a time. Off, the fast paths run (the default).
    """

    worker_processes: bool = False
    devices: dict[int, str] = field(default_factory=dict)
    offload_steps: bool = True
    max_batch_size: int = 32
    max_wait_s: float = 0.0
    loop: str = field(
        default_factory=lambda: "uvloop" if importlib.util.find_spec("uvloop") else "asyncio"
    )
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
    deterministic: bool = False

    def __post_init__(self) -> None:
        stall = self.request_stall_timeout_s
        if stall is not None and not stall > 0:
            raise ValueError(
                f"request_stall_timeout_s must be > 0 seconds, or None for no timeout; got {stall}"
            )

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
            deterministic=self.deterministic,
            own_process=self.is_distributed,
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
        return min(
            (n.max_seq_len for ranks in self.nodes.values() for n in ranks.values()), default=None
        )
