"""CUDA IPC handoff: a CUDA tensor crosses processes on one machine as handles, not bytes.

The sender asks torch for its storage's IPC handles (`UntypedStorage._share_cuda_()`); they
are plain bytes and ints, so they travel inside the message (`CudaIpcLoc`). The receiver
opens them with torch's own rebuild helper, and the CUDA event that torch records on export
orders the receiver's reads after the sender's writes.

Who frees the memory (torch's protocol, `torch/csrc/CudaIPCTypes.cpp`): every export takes a
fresh slot in a shared-memory file of counters and sets it to 1, one reference held for the
receiver. The sender's block stays allocated (in torch's "limbo", after the sender dropped its
own tensor) while that slot is above zero; the receiver's storage decrements it when it dies,
and the sender frees the block at its next allocation miss or `torch.cuda.ipc_collect()`. A
receiver that does not open a handle must therefore give the reference back itself:
`release_cuda_handle`, which every refusing path of `import_cuda_tensor` calls.

Devices are named by UUID, not by index: two processes may see the same GPU under different
indices (or not at all) through `CUDA_VISIBLE_DEVICES`. Each side of a link advertises the
UUIDs it sees (`local_cuda_device_uuids`); a handle is sent only for a device both see, and
the receiver opens it on its own index of that UUID.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence

import torch

from mstar.errors import ProtocolError
from mstar.wire import CudaIpcLoc

__all__ = [
    "cuda_device_index",
    "export_cuda_tensor",
    "import_cuda_tensor",
    "is_cuda_ipc_available",
    "local_cuda_device_uuids",
    "release_cuda_handle",
]

log = logging.getLogger(__name__)


def is_cuda_ipc_available() -> bool:
    """Return whether this process can export and open CUDA IPC handles."""
    return torch.cuda.is_available()


@functools.cache
def local_cuda_device_uuids() -> tuple[str, ...]:
    """Return the UUID of each CUDA device this process sees, by index; () without CUDA.

    Reading a device's properties initializes torch's CUDA state in this process (children
    started with ``fork`` afterwards cannot use CUDA; mstar starts its own with ``spawn``). The
    answer is cached: the visible devices are fixed once CUDA is initialized.
    """
    if not is_cuda_ipc_available():
        return ()
    return tuple(
        str(torch.cuda.get_device_properties(i).uuid) for i in range(torch.cuda.device_count())
    )


def cuda_device_index(uuid: str) -> int | None:
    """Return this process's index of the CUDA device named `uuid`, or None if it does not see
    it."""
    uuids = local_cuda_device_uuids()
    return uuids.index(uuid) if uuid in uuids else None


def export_cuda_tensor(tensor: torch.Tensor) -> CudaIpcLoc:
    """Describe a CUDA tensor by the IPC handles of its storage.

    The export holds one reference for the receiver (see the module's docstring): a loc that
    is never delivered must be given back with `release_cuda_handle`.

    Raises:
        ProtocolError: the tensor is not a dense CUDA tensor with storage.
    """
    if not tensor.is_cuda or tensor.layout != torch.strided:
        raise ProtocolError("CUDA IPC takes dense CUDA tensors only")
    storage = tensor.untyped_storage()
    if storage.nbytes() == 0:
        raise ProtocolError("an empty CUDA storage has no IPC handle")
    (
        device,
        handle,
        storage_size_bytes,
        storage_offset_bytes,
        ref_counter_handle,
        ref_counter_offset,
        event_handle,
        event_sync_required,
    ) = storage._share_cuda_()
    return CudaIpcLoc(
        device=int(device),
        handle=bytes(handle),
        storage_size_bytes=int(storage_size_bytes),
        storage_offset_bytes=int(storage_offset_bytes),
        ref_counter_handle=bytes(ref_counter_handle),
        ref_counter_offset=int(ref_counter_offset),
        event_handle=None if event_handle is None else bytes(event_handle),
        event_sync_required=bool(event_sync_required),
        stride=tuple(tensor.stride()),
        storage_offset=int(tensor.storage_offset()),
        device_uuid=local_cuda_device_uuids()[int(device)],
    )


def release_cuda_handle(ref_counter_handle: bytes, ref_counter_offset: int) -> None:
    """Give back the reference an exported loc holds on the sender's block, without opening it.

    Either side may call it, with the loc's `ref_counter_handle` and `ref_counter_offset`:
    the receiver for a handle it refuses, the sender for one it never delivered or whose
    receiver exited. It decrements that slot of the sender's counter file through torch
    (`UntypedStorage._release_ipc_counter_cuda`, as torch's own `rebuild_cuda_tensor` does
    for a storage it already holds), which needs CUDA in this process: where there is none it
    only logs, and the block stays pinned until the sender exits. Links therefore send
    handles only to peers that said they can open them. Releasing a slot twice is harmless
    while no tensor opened from it is alive (torch frees a block whose slot is at or below
    zero, and never reuses a slot); releasing one whose tensor is alive frees memory in use.
    """
    try:
        torch.UntypedStorage._release_ipc_counter_cuda(ref_counter_handle, ref_counter_offset)
    except (RuntimeError, TypeError) as exc:
        log.warning("cannot release a CUDA IPC handle here (%s): its block stays pinned", exc)


def _refuse(loc: CudaIpcLoc, reason: str) -> ProtocolError:
    release_cuda_handle(loc.ref_counter_handle, loc.ref_counter_offset)
    return ProtocolError(reason)


def import_cuda_tensor(loc: CudaIpcLoc, dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
    """Open the tensor another process exported with `export_cuda_tensor`.

    A handle refused here is released (`release_cuda_handle`) before the error is raised,
    so the sender's block is not pinned by a message this side threw away.

    Raises:
        ProtocolError: CUDA is not available here, the loc's device is not one this process
            sees, the strides reach outside the storage, or CUDA fails to open the handle.
    """
    if not is_cuda_ipc_available():
        raise _refuse(loc, "received a CUDA IPC tensor but CUDA is not available here")
    if not loc.device_uuid:
        raise _refuse(
            loc, "received a CUDA IPC tensor that names no device UUID (a peer from before UUIDs)"
        )
    device = cuda_device_index(loc.device_uuid)
    if device is None:
        raise _refuse(
            loc, f"received a tensor on CUDA device {loc.device_uuid}, which does not exist here"
        )
    if len(loc.stride) != len(shape):
        raise _refuse(loc, f"stride {loc.stride} does not match shape {tuple(shape)}")
    itemsize = torch.empty((), dtype=dtype).element_size()
    if all(n > 0 for n in shape):
        last = loc.storage_offset + sum((n - 1) * s for n, s in zip(shape, loc.stride, strict=True))
        if min(loc.stride, default=0) < 0 or (last + 1) * itemsize > loc.storage_size_bytes:
            raise _refuse(loc, "CUDA IPC tensor reaches outside its storage")
    # Imported lazily: this module must not need the multiprocessing machinery on CPU hosts.
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    try:
        return rebuild_cuda_tensor(
            torch.Tensor,
            torch.Size(shape),
            tuple(loc.stride),
            loc.storage_offset,
            torch.storage.TypedStorage,
            dtype,
            device,
            loc.handle,
            loc.storage_size_bytes,
            loc.storage_offset_bytes,
            False,
            loc.ref_counter_handle,
            loc.ref_counter_offset,
            loc.event_handle,
            loc.event_sync_required,
        )
    except (RuntimeError, TypeError) as exc:
        # Nothing holds the reference when the open fails. (Should torch have released it
        # already, this takes the slot below zero, which torch reads as released too.)
        raise _refuse(loc, f"cannot open a CUDA IPC handle on cuda:{device}: {exc}") from exc
