"""Shared-memory tensor handoff: one preallocated, reused arena per actor system.

The owner writes a tensor into a slot of its arena and sends only the slot's offset; a peer
on the same machine maps the arena once and builds a zero-copy tensor view of the slot. When
the last reference to that view dies, the peer hands the slot back (`ArenaRelease`), so the
owner reuses the same pages: fresh shared memory costs a page fault per 4 KiB, which is what
makes a new segment per tensor an order of magnitude slower.

    owner: SharedArena                       peer: ArenaMapping
    [slot A: in flight][free][slot B]  ==>   view(A) -- freed -> release(A) --> owner.free(A)

The segment lives in /dev/shm under an owner-tagged name (see `janitor`): the owner unlinks it
on close; if the owner crashes, the peer that notices, or the next mstar process, sweeps it.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import weakref
from collections.abc import Callable, Sequence

import numpy as np
import torch

from mstar.errors import ProtocolError
from mstar.transport.allocator import ArenaAllocator
from mstar.transport.janitor import SHM_DIR, make_owned_name, sweep_stale
from mstar.transport.memcopy import AdaptiveCopier

__all__ = ["ArenaMapping", "SharedArena", "is_shm_available"]

log = logging.getLogger(__name__)

# 64-byte slots keep every dtype (and AVX-512 loads) aligned.
_ALIGNMENT = 64
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)


def is_shm_available() -> bool:
    """Return whether /dev/shm exists and is writable here."""
    return SHM_DIR.is_dir() and os.access(SHM_DIR, os.W_OK)


class SharedArena:
    """The owner side: a shared segment, prefaulted once, carved into slots by an allocator.

    Args:
        nbytes: arena size in bytes.
    """

    def __init__(self, nbytes: int) -> None:
        if nbytes <= 0:
            raise ValueError(f"arena size must be > 0 bytes, got {nbytes}")
        # Crashed owners leave segments behind; each new arena sweeps them first.
        sweep_stale()
        self.name = make_owned_name()
        self.path = SHM_DIR / self.name
        fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, nbytes)
            self._mmap: mmap.mmap | None = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED | _POPULATE)
        except BaseException:
            os.unlink(self.path)
            raise
        finally:
            os.close(fd)
        self.nbytes = nbytes
        self._bytes: torch.Tensor | None = torch.frombuffer(self._mmap, dtype=torch.uint8)
        # Touch every page now so that no send pays for page faults later.
        self._bytes.zero_()
        self.allocator = ArenaAllocator(nbytes, _ALIGNMENT)
        self.copier = AdaptiveCopier()

    @property
    def is_closed(self) -> bool:
        """Whether `close` ran."""
        return self._bytes is None

    def write(self, tensor: torch.Tensor) -> int | None:
        """Copy a CPU tensor into a new slot; return its offset, or None if the arena is full."""
        if self._bytes is None:
            return None
        nbytes = tensor.numel() * tensor.element_size()
        offset = self.allocator.allocate(nbytes)
        if offset is None:
            return None
        view = self._bytes[offset : offset + nbytes].view(tensor.dtype).view(tensor.shape)
        self.copier.copy(view, tensor)
        return offset

    def free(self, offset: int) -> None:
        """Return a slot to the allocator.

        Raises:
            KeyError: no slot starts at `offset`.
        """
        self.allocator.free(offset)

    def close(self) -> None:
        """Unlink the segment and unmap it here (peers keep their mappings until they unmap)."""
        if self._bytes is None:
            return
        self._bytes = None
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        if self._mmap is not None:
            # A view still alive somewhere keeps the mapping; the GC unmaps it later then.
            with contextlib.suppress(BufferError):
                self._mmap.close()
            self._mmap = None


class ArenaMapping:
    """The peer side: a mapping of another system's arena that yields zero-copy tensor views.

    Args:
        name: the arena's segment name (from the owner's `Hello`).
        nbytes: its size; the segment must be exactly this big.
        on_release: called with a slot's offset once no view of it is alive; may be called
            from any thread (whichever drops the last reference).
    """

    def __init__(self, name: str, nbytes: int, on_release: Callable[[int], None]) -> None:
        if "/" in name or not name.startswith("mstar-"):
            raise ProtocolError(f"invalid arena name {name!r}")
        fd = os.open(SHM_DIR / name, os.O_RDWR)
        try:
            size = os.fstat(fd).st_size
            if size != nbytes:
                raise ProtocolError(f"arena {name!r} holds {size} bytes, the peer said {nbytes}")
            self._mmap: mmap.mmap | None = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED | _POPULATE)
        finally:
            os.close(fd)
        self.name = name
        self.nbytes = nbytes
        self._on_release = on_release

    def tensor(
        self, offset: int, nbytes: int, dtype: torch.dtype, shape: Sequence[int]
    ) -> torch.Tensor:
        """Return a tensor viewing `nbytes` at `offset`; the slot is released when it dies.

        Raises:
            ProtocolError: the slot lies outside the arena or the mapping is closed.
        """
        if self._mmap is None:
            raise ProtocolError(f"arena {self.name!r} is no longer mapped")
        if offset % _ALIGNMENT or offset + nbytes > self.nbytes:
            raise ProtocolError(
                f"slot [{offset}, {offset + nbytes}) is outside arena {self.name!r}"
            )
        # The numpy array is the one object every view of the slot keeps alive (torch holds it
        # as the storage's owner), so its finalizer runs exactly when the last view dies.
        array = np.frombuffer(self._mmap, dtype=np.uint8, count=nbytes, offset=offset)
        weakref.finalize(array, self._on_release, offset)
        return torch.from_numpy(array).view(dtype).view(tuple(shape))

    def close(self) -> None:
        """Unmap now if no view is alive; otherwise leave the unmapping to the GC."""
        if self._mmap is None:
            return
        with contextlib.suppress(BufferError):
            self._mmap.close()
        self._mmap = None
