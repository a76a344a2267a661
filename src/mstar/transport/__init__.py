"""Transports chosen by address scheme: inproc, ipc, tcp; shared-memory and CUDA IPC tensors."""

from __future__ import annotations

from mstar.transport import inproc as _inproc  # noqa: F401  (registers inproc://)
from mstar.transport import zeromq as _zeromq  # noqa: F401  (registers ipc:// and tcp://)
from mstar.transport.allocator import ArenaAllocator
from mstar.transport.base import (
    Address,
    Channel,
    Listener,
    Transport,
    connect,
    get_transport,
    listen,
    parse_address,
    register_transport,
)
from mstar.transport.codec import LinkCodec
from mstar.transport.cuda_ipc import export_cuda_tensor, import_cuda_tensor, is_cuda_ipc_available
from mstar.transport.janitor import sweep_stale
from mstar.transport.shm import ArenaMapping, SharedArena, is_shm_available
from mstar.transport.tally import TRANSPORT_KINDS, TransportTally

__all__ = [
    "Address",
    "ArenaAllocator",
    "ArenaMapping",
    "Channel",
    "LinkCodec",
    "Listener",
    "SharedArena",
    "TRANSPORT_KINDS",
    "Transport",
    "TransportTally",
    "connect",
    "export_cuda_tensor",
    "get_transport",
    "import_cuda_tensor",
    "is_cuda_ipc_available",
    "is_shm_available",
    "listen",
    "parse_address",
    "register_transport",
    "sweep_stale",
]
