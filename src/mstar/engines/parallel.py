"""Tensor parallelism: one KV-cache node's network sharded over the ranks of a group.

A placement group with ``tensor_parallel: N`` runs each of its nodes as N shards, one per rank
(`mstar.runtime.placement`). The network of each shard holds its part of every weight
(`TensorShard`, Megatron's split, as vLLM's layers make it):

```
q, k, v, gate, up    column-parallel: this rank's heads / MLP columns, no communication
o, down              row-parallel: partial sums, one all-reduce each (the bias on rank 0 only)
embedding, head      vocabulary-parallel: this rank's ids; the lookup is summed over the
                     group, greedy rows compare each rank's best (two numbers a row), sampled
                     rows gather the logits
KV heads             split over the ranks, or, with fewer KV heads than ranks, each rank keeps
                     the one its query heads read (replicated)
MoE experts          tensor parallel within the experts: every rank its columns of every
                     expert, the router whole (no rank idles when the rows pick the other's)
```

One scheduler serves the group. The leader (the group's first rank) runs the node's
`KVCacheEngine` as any node's: it schedules, prepares each step and samples. Each step's plan
(its inputs, attention metadata, block copies, and which head call follows) goes to the other
ranks as a command (`TensorParallelLeader`) before the leader runs it itself; each follower
(`TensorParallelFollower`) runs the same step on its shard, with a cache of the same blocks
(block tables are the leader's) and its KV heads. The conductor sees the group as one node:
the leader's rank.

Collectives go through a `TensorParallelGroup`: `ShmGroup` for CPU ranks on one machine
(shared memory; the native kernels' spin-then-sleep waits, and the decoder's native decode step
sums inside its own call), `GlooGroup` (``torch.distributed``: gloo on CPU, NCCL on CUDA) for
CUDA ranks and for a group whose ranks a Ray placement spreads over machines
(``allow_cross_node_tp``). ``scripts/bench_tp.py`` times both (gloo's all-reduce took 150x
shared memory's between two processes of one machine). A leader whose step raises closes its
group: its ranks may be out of step, and the group restarts as a unit.

A model that can be sharded declares `SupportsTensorParallel` and reads `current_shard()`
while it builds (the worker loads it under `sharded`): it then builds, or loads from its
checkpoint's slices, only its own shard. Its payload types travel to the followers once
registered (`tensor_payload`); a method its node calls between steps that changes what the
model keeps for a sequence runs on the followers too (`mirrored`).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import mmap
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, ClassVar, Literal, Protocol, TypeGuard, TypeVar, cast

import msgspec
import numpy as np
import structlog
import torch

from mstar.engines.attention.base import AttentionMetadata
from mstar.engines.interfaces import StepChunk, StepInputs
from mstar.engines.native import cpu_kernels
from mstar.errors import MStarError

__all__ = [
    "GlooGroup",
    "ShmGroup",
    "SupportsTensorParallel",
    "TensorParallelError",
    "TensorParallelFollower",
    "TensorParallelGroup",
    "TensorParallelLeader",
    "TensorParallelRankLostError",
    "TensorShard",
    "current_shard",
    "mirrored",
    "sharded",
    "supports_tensor_parallel",
    "tensor_payload",
]

_log = structlog.get_logger(__name__)
_P = TypeVar("_P")
_F = TypeVar("_F", bound=Callable[..., Any])

SLOT_BYTES = 1 << 20
"""Bytes of one rank's part of a shared-memory collective round (larger tensors take several)."""
COMMAND_BYTES = 4 << 20
"""Bytes of the shared-memory command area (larger commands go in several parts)."""
TIMEOUT_S = 300.0
"""How long a collective waits for the other ranks before it fails."""


class TensorParallelError(MStarError):
    """A tensor-parallel group cannot run: a rank is gone, stopped, or the layout cannot split."""


class TensorParallelRankLostError(TensorParallelError):
    """A rank of the group is gone (its process exited); ``rank`` is its worker rank."""

    def __init__(self, message: str, *, rank: int) -> None:
        super().__init__(message)
        self.rank = rank


class TensorParallelGroup(Protocol):
    """The collectives of the ranks of one tensor-parallel group (rank 0 leads)."""

    @property
    def rank(self) -> int:
        """This rank's index in the group."""
        ...

    @property
    def world(self) -> int:
        """How many ranks the group has."""
        ...

    def all_reduce_(self, x: torch.Tensor) -> None:
        """Sum ``x`` over the ranks, in place."""
        ...

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Return every rank's ``x`` (the same shape on each), stacked: `[world, *x.shape]`."""
        ...

    leader: TensorParallelLeader | None
    """Rank 0's side of the group once its engine runs (see `mirrored`)."""

    def send(self, data: bytes) -> None:
        """Send a command to every other rank (rank 0 only; one at a time, from any thread)."""
        ...

    def receive(self) -> bytes:
        """Return rank 0's next command (blocks)."""
        ...

    def close(self) -> None:
        """Stop: the other ranks' waits fail from now on."""
        ...

    def rank_lost(self, error: BaseException) -> TensorParallelRankLostError | None:
        """Return a native call's `error` as the loss of the rank whose process the group's
        collectives found gone, or None where they found none (or cannot tell)."""
        ...


class ShmGroup:
    """A `TensorParallelGroup` over a shared-memory file every rank maps (one machine).

    ``path`` (under /dev/shm) is created by whichever rank comes first; every rank of the
    group must name the same one, and a group that restarts takes a fresh file. ``ranks`` are
    the members' worker ranks (default ``0 .. world - 1``): a call that finds one's process
    gone raises `TensorParallelRankLostError` naming it.
    """

    def __init__(
        self,
        path: str | Path,
        rank: int,
        world: int,
        *,
        ranks: Sequence[int] | None = None,
        slot_bytes: int = SLOT_BYTES,
        command_bytes: int = COMMAND_BYTES,
        timeout_s: float = TIMEOUT_S,
    ) -> None:
        kernels = cpu_kernels()
        if kernels is None:
            raise TensorParallelError(
                "shared-memory tensor parallelism needs mstar's native kernels (a C++ compiler)"
            )
        self.path = Path(path)
        self.ranks = tuple(range(world) if ranks is None else ranks)
        if len(self.ranks) != world:
            raise TensorParallelError(f"{world} ranks in the group, {len(self.ranks)} named")
        size = kernels.ShmGroup.region_bytes(world, slot_bytes, command_bytes)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            if os.fstat(fd).st_size < size:
                os.ftruncate(fd, size)  # every rank asks for the same size: idempotent
            self._map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        region = torch.frombuffer(self._map, dtype=torch.uint8)
        self.native = kernels.ShmGroup(region, rank, world, slot_bytes, command_bytes, timeout_s)
        self._region = region
        self.leader: TensorParallelLeader | None = None  # rank 0's, once its engine runs
        self._sending = threading.Lock()  # one command at a time (steps and mirrored calls)

    @property
    def rank(self) -> int:
        """This rank's index in the group."""
        return int(self.native.rank)

    @property
    def world(self) -> int:
        """How many ranks the group has."""
        return int(self.native.world)

    def all_reduce_(self, x: torch.Tensor) -> None:
        """Sum ``x`` over the ranks in place (rank order: every rank gets the same bits)."""
        self._call(self.native.all_reduce_, x)

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Return every rank's ``x``, stacked."""
        return cast(torch.Tensor, self._call(self.native.all_gather, x))

    def send(self, data: bytes) -> None:
        """Send a command to the followers."""
        with self._sending:
            self._call(self.native.send, _byte_tensor(data))

    def receive(self) -> bytes:
        """Return the leader's next command."""
        return bytes(self._call(self.native.receive).numpy())

    def close(self) -> None:
        """Stop the group and remove its file (the first rank to close does)."""
        self.native.abort()
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()

    def rank_lost(self, error: BaseException) -> TensorParallelRankLostError | None:
        """Return a native call's `error` as the loss of the member whose process this group's
        collectives found gone, or None when they found none (its own collectives raise it
        themselves; a native call that sums over the group inside, as a decode step does, is
        asked about by the leader's step, `ModelRunner.execute`)."""
        lost = int(self.native.lost)
        if lost < 0:
            return None
        return TensorParallelRankLostError(str(error).splitlines()[0], rank=self.ranks[lost])

    def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        try:
            return fn(*args)
        except RuntimeError as exc:
            raise self.rank_lost(exc) or TensorParallelError(str(exc).splitlines()[0]) from None


class GlooGroup:
    """A `TensorParallelGroup` over ``torch.distributed`` (gloo on CPU, NCCL on CUDA).

    Each rank joins the process group at ``init_method`` (``tcp://host:port``: rank 0 serves
    there), or through the key-value store at ``store`` (``host:port`` of a ``TCPStore`` some
    process serves; keys under ``prefix``, one per group incarnation). Commands travel as byte
    tensors through a broadcast. A process holds one such group (torch's default group), which
    lives until the process exits.
    """

    def __init__(
        self,
        rank: int,
        world: int,
        *,
        init_method: str | None = None,
        store: str | None = None,
        prefix: str = "",
        device: torch.device | str = "cpu",
        timeout_s: float = TIMEOUT_S,
    ) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            raise TensorParallelError(
                "this process is in a torch.distributed group already: a rank takes part in one "
                "tensor-parallel group across machines"
            )
        self.device = torch.device(device)
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        timeout = timedelta(seconds=timeout_s)
        if store is not None:
            host, _, port = store.rpartition(":")
            client = dist.TCPStore(host, int(port), is_master=False, timeout=timeout)
            dist.init_process_group(
                backend,
                store=dist.PrefixStore(prefix, client),
                rank=rank,
                world_size=world,
                timeout=timeout,
            )
        else:
            dist.init_process_group(
                backend, init_method=init_method, rank=rank, world_size=world, timeout=timeout
            )
        self._dist = dist
        self._rank, self._world = rank, world
        self.leader: TensorParallelLeader | None = None
        self._sending = threading.Lock()

    @property
    def rank(self) -> int:
        """This rank's index in the group."""
        return self._rank

    @property
    def world(self) -> int:
        """How many ranks the group has."""
        return self._world

    def all_reduce_(self, x: torch.Tensor) -> None:
        """Sum ``x`` over the ranks in place."""
        self._dist.all_reduce(x)

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Return every rank's ``x``, stacked."""
        flat = x.contiguous().reshape(-1)
        out = flat.new_empty(self._world * flat.numel())
        self._dist.all_gather_into_tensor(out, flat)
        return out.view(self._world, *x.shape)

    def send(self, data: bytes) -> None:
        """Send a command to the followers (its length, then its bytes)."""
        size = torch.tensor([len(data)], dtype=torch.int64, device=self.device)
        payload = _byte_tensor(data).to(self.device)
        with self._sending:
            self._dist.broadcast(size, 0)
            self._dist.broadcast(payload, 0)

    def receive(self) -> bytes:
        """Return the leader's next command."""
        size = torch.zeros(1, dtype=torch.int64, device=self.device)
        self._dist.broadcast(size, 0)
        payload = torch.empty(int(size.item()), dtype=torch.uint8, device=self.device)
        self._dist.broadcast(payload, 0)
        return bytes(payload.cpu().numpy())

    def close(self) -> None:
        """Nothing to do: the process group lives until the process exits (a follower's thread
        may still wait in a broadcast, which destroying the group under it would crash)."""

    def rank_lost(self, error: BaseException) -> None:
        """Return None: gloo's and NCCL's errors do not say which peer is gone."""
        return None


def _byte_tensor(data: bytes) -> torch.Tensor:
    if not data:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


@dataclass(frozen=True)
class TensorShard:
    """This rank's place in a tensor-parallel group: which part of each weight it holds."""

    rank: int
    world: int
    group: TensorParallelGroup | None = None  # None: shapes only (a model built to be loaded)

    def split(self, total: int) -> tuple[int, int]:
        """Return this rank's `[start, stop)` of ``total`` items split as evenly as they go (the
        ranks' counts differ by one at most)."""
        return self.rank * total // self.world, (self.rank + 1) * total // self.world

    def vocab_range(self, vocab: int) -> tuple[int, int, int]:
        """Return this rank's ids `[start, stop)` and its rows (`ceil(vocab / world)`: the last
        rank's are padded)."""
        rows = -(-vocab // self.world)
        start = min(self.rank * rows, vocab)
        return start, min(start + rows, vocab), rows

    def all_reduce_(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the group in place; return it."""
        if self.group is not None and self.world > 1:
            self.group.all_reduce_(x)
        return x


_SHARD: contextvars.ContextVar[TensorShard | None] = contextvars.ContextVar(
    "mstar_tensor_shard", default=None
)


@contextlib.contextmanager
def sharded(shard: TensorShard | None) -> Iterator[None]:
    """Within it, models that support tensor parallelism build (or load) ``shard`` only."""
    token = _SHARD.set(shard)
    try:
        yield
    finally:
        _SHARD.reset(token)


def current_shard() -> TensorShard | None:
    """The shard a model built now must hold (see `sharded`), or None for the whole model."""
    return _SHARD.get()


class SupportsTensorParallel(Protocol):
    """A `PagedModel` that builds only its shard under `sharded` and reduces through its group."""

    supports_tensor_parallel: ClassVar[Literal[True]]

    @property
    def tensor_shard(self) -> TensorShard | None:
        """The shard this network holds (None: all of it)."""
        ...


def supports_tensor_parallel(model: object) -> TypeGuard[SupportsTensorParallel]:
    """Whether `model` declares `SupportsTensorParallel`."""
    return getattr(model, "supports_tensor_parallel", False) is True  # compiled wrappers forward it


_MIRRORING = threading.local()


def mirrored(method: _F) -> _F:
    """Mark a model method that changes what the model keeps between steps (a sequence's state,
    set by its node outside the steps): on a tensor-parallel leader, the followers' shards run it
    too, in order with the steps."""

    @functools.wraps(method)
    def call(self: Any, *args: Any) -> Any:
        if getattr(_MIRRORING, "active", False):  # inside another mirrored call: told already
            return method(self, *args)
        shard: TensorShard | None = self.tensor_shard
        if shard is not None and shard.rank == 0 and shard.group is not None:
            leader = shard.group.leader
            if leader is not None:
                leader.call(method.__name__, args)
        _MIRRORING.active = True
        try:
            return method(self, *args)
        finally:
            _MIRRORING.active = False

    call.mirrored = True  # type: ignore[attr-defined]
    return cast(_F, call)


# -- the leader's commands ----------------------------------------------------------------------


class _Tensor(msgspec.Struct, array_like=True):
    dtype: str
    shape: list[int]
    data: bytes


def _pack(x: torch.Tensor | np.ndarray | None) -> _Tensor | None:
    if x is None:
        return None
    t = torch.from_numpy(x) if isinstance(x, np.ndarray) else x.detach()
    t = t.contiguous().cpu().reshape(-1)
    raw = t.view(torch.uint8) if t.dtype != torch.bool else t.to(torch.uint8)
    shape = list(x.shape)
    return _Tensor(str(t.dtype).removeprefix("torch."), shape, raw.numpy().tobytes())


def _unpack(x: _Tensor, device: torch.device | None = None) -> torch.Tensor:
    dtype = getattr(torch, x.dtype)
    raw = _byte_tensor(x.data)
    t = raw.to(torch.bool) if dtype is torch.bool else raw.view(dtype)
    t = t.reshape(x.shape)
    return t if device is None else t.to(device)


def _unpack_np(x: _Tensor | None) -> np.ndarray | None:
    return None if x is None else _unpack(x).numpy()


_PAYLOAD_TYPES: dict[str, type] = {}


_LOCAL_FIELDS: dict[str, tuple[str, ...]] = {}


def tensor_payload(cls: type[_P] | None = None, *, local: tuple[str, ...] = ()) -> Any:
    """Register a dataclass payload type (a class decorator) that a tensor-parallel leader may
    send its followers: its fields hold tensors, numbers, strings, None, registered payloads,
    or lists, tuples and string-keyed dicts of those. Fields named in ``local`` stay on the
    leader (the followers get None: what only the leader's part of a step reads)."""

    def register(cls: type[_P]) -> type[_P]:
        if not dataclasses.is_dataclass(cls):
            raise TypeError(f"{cls.__name__} is not a dataclass")
        name = f"{cls.__module__}.{cls.__qualname__}"
        _PAYLOAD_TYPES[name] = cls
        _LOCAL_FIELDS[name] = local
        return cls

    return register if cls is None else register(cls)


def _encode_value(value: Any) -> Any:
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, torch.Tensor | np.ndarray):
        return {"t": _pack(value), "np": isinstance(value, np.ndarray)}
    if isinstance(value, list | tuple):
        return {"seq": [_encode_value(v) for v in value], "tuple": isinstance(value, tuple)}
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return {"map": {k: _encode_value(v) for k, v in value.items()}}
    name = f"{type(value).__module__}.{type(value).__qualname__}"
    if name in _PAYLOAD_TYPES and dataclasses.is_dataclass(value):
        local = _LOCAL_FIELDS[name]
        fields = {
            f.name: None if f.name in local else _encode_value(getattr(value, f.name))
            for f in dataclasses.fields(value)
        }
        return {"payload": name, "fields": fields}
    raise TensorParallelError(
        f"a tensor-parallel node's payload cannot hold {type(value).__name__} (register its "
        "dataclass with mstar.engines.parallel.tensor_payload)"
    )


def _decode_value(value: Any, device: torch.device) -> Any:
    if not isinstance(value, dict):
        return value
    if "t" in value:
        t = _unpack(msgspec.convert(value["t"], _Tensor))
        return t.numpy() if value["np"] else t.to(device)
    if "seq" in value:
        items = [_decode_value(v, device) for v in value["seq"]]
        return tuple(items) if value["tuple"] else items
    if "map" in value:
        return {k: _decode_value(v, device) for k, v in value["map"].items()}
    cls = _PAYLOAD_TYPES.get(value["payload"])
    if cls is None:
        raise TensorParallelError(f"the leader sent an unknown payload type {value['payload']}")
    return cls(**{k: _decode_value(v, device) for k, v in value["fields"].items()})


class _Chunk(msgspec.Struct, array_like=True):
    seq_key: str
    row_start: int
    row_end: int
    position: int
    expert: int
    is_read_only: bool
    payload: Any  # `_encode_value`'s


class InitCache(msgspec.Struct, tag=True, array_like=True):
    """Allocate the follower's cache: the leader's blocks, the follower's KV heads."""

    num_blocks: int
    block_size: int
    deterministic: bool
    attention_backend: str = "auto"


class Forward(msgspec.Struct, tag=True, array_like=True):
    """Run one step's forward pass (a `PreparedBatch`, less what only the leader reads)."""

    input_ids: _Tensor
    positions: _Tensor
    slot_mapping: _Tensor
    query_start_loc: _Tensor
    seq_lens: _Tensor
    block_tables: list[list[int]]
    block_size: int
    kv_limits: _Tensor | None
    seq_keys: _Tensor | None
    read_only: _Tensor | None
    chunks: list[_Chunk] | None  # None: the decode fast path (no step inputs)
    expert_ids: _Tensor | None


class CopyBlocks(msgspec.Struct, tag=True, array_like=True):
    """Copy whole blocks (copy-on-write), as the leader's runner does."""

    copies: list[tuple[int, int]]


class Head(msgspec.Struct, tag=True, array_like=True):
    """Call the head as the leader does next: greedy tokens, logits, or logits in id ranges."""

    op: Literal["greedy", "logits", "logits_in"]
    rows: _Tensor
    ranges: list[list[tuple[int, int]]] | None = None


class Call(msgspec.Struct, tag=True, array_like=True):
    """Call a `mirrored` method of the model with these arguments."""

    method: str
    args: list[Any]


class Stop(msgspec.Struct, tag=True, array_like=True):
    """End the follower's loop."""


Command = InitCache | Forward | CopyBlocks | Head | Call | Stop
_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(Command)


class TensorParallelLeader:
    """The leader's side of a group: tells the followers each step before running it."""

    def __init__(self, group: TensorParallelGroup) -> None:
        self.group = group
        group.leader = self

    def _send(self, command: Command) -> None:
        self.group.send(_ENCODER.encode(command))

    def init_cache(
        self, num_blocks: int, block_size: int, deterministic: bool, attention_backend: str
    ) -> None:
        """Have the followers allocate their caches (and attend as the leader's engine does)."""
        self._send(InitCache(num_blocks, block_size, deterministic, attention_backend))

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        metadata: AttentionMetadata,
        step: StepInputs | None,
    ) -> None:
        """Send a step's forward pass."""
        chunks = None
        if step is not None:
            chunks = []
            for c in step.chunks:
                payload = _encode_value(c.payload)
                chunks.append(
                    _Chunk(
                        c.seq_key,
                        c.row_start,
                        c.row_end,
                        c.position,
                        c.expert,
                        c.is_read_only,
                        payload,
                    )
                )
        m = metadata
        self._send(
            Forward(
                cast(_Tensor, _pack(input_ids)),
                cast(_Tensor, _pack(positions)),
                cast(_Tensor, _pack(m.slot_mapping)),
                cast(_Tensor, _pack(m.query_start_loc)),
                cast(_Tensor, _pack(m.seq_lens)),
                [list(t) for t in m.block_tables],
                m.block_size,
                _pack(m.kv_limits),
                _pack(m.seq_keys),
                _pack(m.read_only),
                chunks,
                _pack(step.expert_ids) if step is not None else None,
            )
        )

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Send a step's block copies."""
        self._send(CopyBlocks(copies))

    def head(
        self,
        op: Literal["greedy", "logits", "logits_in"],
        rows: torch.Tensor,
        ranges: list[list[tuple[int, int]]] | None = None,
    ) -> None:
        """Send the head call the leader makes next."""
        self._send(Head(op, cast(_Tensor, _pack(rows)), ranges))

    def call(self, method: str, args: tuple[Any, ...]) -> None:
        """Have the followers call a `mirrored` method of their model."""
        self._send(Call(method, [_encode_value(a) for a in args]))

    def abort(self) -> None:
        """Close the group after a step failed here: the ranks may be out of step (the followers
        fail, see `TensorParallelFollower`)."""
        self.group.close()

    def stop(self) -> None:
        """End the followers' loops."""
        with contextlib.suppress(TensorParallelError):
            self._send(Stop())


class TensorParallelFollower:
    """A follower rank's shard of a node: runs the leader's commands on a thread of its own.

    The loop ends at the leader's `Stop` or at `close`. Any other end is a failure: a command
    that raised here (the group is closed: the leader's step fails), the group closed by the
    leader (its step raised: the ranks may be out of step, which no rank can repair), or a rank
    gone. ``on_failure`` is then called on that thread: the group cannot serve again, so a worker
    in a process of its own exits and its group restarts as a unit.
    """

    def __init__(
        self,
        node: str,
        model: Any,
        group: TensorParallelGroup,
        device: torch.device | str,
        *,
        num_threads: int | None = None,
        on_failure: Callable[[BaseException], None] | None = None,
    ) -> None:
        self.node, self.model, self.group = node, model, group
        self.device = torch.device(device)
        self.num_threads = num_threads
        self.on_failure = on_failure
        self.runner: Any = None
        self.num_commands = 0
        self.num_steps = 0  # forward passes run
        self.error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._closing = False

    def start(self) -> None:
        """Start serving commands."""
        self._thread = threading.Thread(
            target=self._loop, name=f"mstar-tp-{self.node}-{self.group.rank}", daemon=True
        )
        self._thread.start()

    def close(self, timeout: float = 10.0) -> None:
        """Stop serving: the group is closed (the leader's waits fail) and the loop ends."""
        self._closing = True
        self.group.close()
        if self._thread is not None:
            self._thread.join(timeout)

    def stats(self) -> dict[str, float]:
        """Return the follower's counters: the steps it ran, its rank in the group."""
        return {"steps": float(self.num_steps), "tensor_parallel_rank": float(self.group.rank)}

    @property
    def is_running(self) -> bool:
        """Whether the loop still serves."""
        return self._thread is not None and self._thread.is_alive()

    def _loop(self) -> None:
        if self.num_threads is not None:
            torch.set_num_threads(self.num_threads)
        try:
            with torch.inference_mode():
                while True:
                    command = _DECODER.decode(self.group.receive())
                    self.num_commands += 1
                    if isinstance(command, Stop):
                        return
                    self.run(command)
        except BaseException as exc:  # a follower that cannot go on fails its group
            self.error = exc
            with contextlib.suppress(Exception):
                self.group.close()
            if not self._closing:
                self._failed(exc)

    def _failed(self, exc: BaseException) -> None:
        _log.error("tensor_parallel_follower_failed", node=self.node, error=repr(exc))
        if self.on_failure is not None:
            self.on_failure(exc)

    def run(self, command: Command) -> None:
        """Run one command on this shard."""
        from mstar.engines.attention.torch_paged import TorchPagedAttention
        from mstar.engines.kv_cache import allocate_kv_cache
        from mstar.engines.kv_engine import make_attention_backend
        from mstar.engines.model_runner import ModelRunner, PreparedBatch

        if isinstance(command, InitCache):
            cache = allocate_kv_cache(
                self.model.kv_cache_spec, command.num_blocks, command.block_size, self.device
            )
            backend = (
                TorchPagedAttention(self.device, deterministic=True)
                if command.deterministic
                else make_attention_backend(command.attention_backend, self.device)
            )
            self.runner = ModelRunner(
                self.model, cache, backend, block_size=command.block_size, device=self.device
            )
            return
        runner = self.runner
        if runner is None:
            raise TensorParallelError("the leader sent a step before the cache's size")
        if isinstance(command, CopyBlocks):
            runner.copy_blocks(command.copies)
        elif isinstance(command, Forward):
            device = self.device
            metadata = AttentionMetadata(
                num_tokens=command.input_ids.shape[0],
                slot_mapping=_unpack(command.slot_mapping, device),
                query_start_loc=cast(np.ndarray, _unpack_np(command.query_start_loc)),
                seq_lens=cast(np.ndarray, _unpack_np(command.seq_lens)),
                block_tables=command.block_tables,
                kv_limits=_unpack_np(command.kv_limits),
                block_size=command.block_size,
                seq_keys=_unpack_np(command.seq_keys),
                read_only=_unpack_np(command.read_only),
            )
            step = None
            if command.chunks is not None:
                step = StepInputs(
                    [
                        StepChunk(
                            c.seq_key,
                            c.row_start,
                            c.row_end,
                            c.position,
                            _decode_value(c.payload, device),
                            c.expert,
                            c.is_read_only,
                        )
                        for c in command.chunks
                    ],
                    None if command.expert_ids is None else _unpack(command.expert_ids, device),
                )
            batch = PreparedBatch(
                _unpack(command.input_ids, device),
                _unpack(command.positions, device),
                metadata,
                torch.empty(0, dtype=torch.long),
                [],
                step,
            )
            runner.forward(batch)
            self.num_steps += 1
        elif isinstance(command, Call):
            method = getattr(self.model, command.method, None)
            if getattr(method, "mirrored", False) is not True:
                raise TensorParallelError(f"the leader called {command.method!r}, not mirrored")
            assert method is not None
            method(*[_decode_value(a, self.device) for a in command.args])
        elif isinstance(command, Head):
            rows = _unpack(command.rows, self.device)
            if command.op == "greedy":
                self.model.greedy_tokens(rows)
            elif command.op == "logits":
                self.model.compute_logits(rows)
            else:
                self.model.compute_logits_in(rows, command.ranges)
