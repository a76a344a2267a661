"""CUDA IPC handoff: a CUDA tensor crosses processes on one machine as handles, not bytes.

The sender asks torch for its storage's IPC handles (`UntypedStorage._share_cuda_()`); they
are plain bytes and ints, so they travel inside the message (`CudaIpcLoc`). The receiver
opens them with torch's own rebuild helper, which also maintains torch's cross-process
reference count: the sender's caching allocator keeps the block until every receiver has
dropped its view (the sending process must stay alive meanwhile), and the CUDA event that
torch records on export orders the receiver's reads after the sender's writes.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mstar.actors.wire import CudaIpcLoc
from mstar.errors import ProtocolError

__all__ = ["export_cuda_tensor", "import_cuda_tensor", "is_cuda_ipc_available"]


def is_cuda_ipc_available() -> bool:
    """Return whether this process can export and open CUDA IPC handles."""
    return torch.cuda.is_available()


def export_cuda_tensor(tensor: torch.Tensor) -> CudaIpcLoc:
    """Describe a CUDA tensor by the IPC handles of its storage.

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
    )


def import_cuda_tensor(loc: CudaIpcLoc, dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
    """Open the tensor another process exported with `export_cuda_tensor`.

    Raises:
        ProtocolError: CUDA is not available here, the device does not exist, or the
            strides reach outside the storage.
    """
    if not torch.cuda.is_available():
        raise ProtocolError("received a CUDA IPC tensor but CUDA is not available here")
    if loc.device >= torch.cuda.device_count():
        raise ProtocolError(f"received a tensor on cuda:{loc.device}, which does not exist here")
    if len(loc.stride) != len(shape):
        raise ProtocolError(f"stride {loc.stride} does not match shape {tuple(shape)}")
    itemsize = torch.empty((), dtype=dtype).element_size()
    if all(n > 0 for n in shape):
        last = loc.storage_offset + sum((n - 1) * s for n, s in zip(shape, loc.stride, strict=True))
        if min(loc.stride, default=0) < 0 or (last + 1) * itemsize > loc.storage_size_bytes:
            raise ProtocolError("CUDA IPC tensor reaches outside its storage")
    # Imported lazily: this module must not need the multiprocessing machinery on CPU hosts.
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    return rebuild_cuda_tensor(
        torch.Tensor,
        torch.Size(shape),
        tuple(loc.stride),
        loc.storage_offset,
        torch.storage.TypedStorage,
        dtype,
        loc.device,
        loc.handle,
        loc.storage_size_bytes,
        loc.storage_offset_bytes,
        False,
        loc.ref_counter_handle,
        loc.ref_counter_offset,
        loc.event_handle,
        loc.event_sync_required,
    )
