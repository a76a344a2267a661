"""`ArenaAllocator`: first-fit free-list allocation of slots in a fixed-size arena.

Pure bookkeeping (no memory is touched): the shared-memory arena asks it for offsets.
Free blocks are kept sorted by offset and coalesced with their neighbours on `free`:

    offset 0                                                          capacity
    |[ used ][  free  ][ used ][ used ][      free      ][ used ][ free ]|
              ^ _free_offsets[0]        ^ _free_offsets[1]        ^ [2]
"""

from __future__ import annotations

import bisect

__all__ = ["ArenaAllocator"]


class ArenaAllocator:
    """Hand out aligned `[offset, offset + size)` slots of `[0, capacity)`; reuse freed ones.

    Args:
        capacity: arena size in bytes.
        alignment: every offset is a multiple of this (a power of two).
    """

    def __init__(self, capacity: int, alignment: int = 64) -> None:
        if capacity < 0:
            raise ValueError(f"capacity must be >= 0, got {capacity}")
        if alignment < 1 or alignment & (alignment - 1):
            raise ValueError(f"alignment must be a power of two, got {alignment}")
        self.capacity = capacity - capacity % alignment
        self.alignment = alignment
        # Free blocks as two parallel lists sorted by offset (bisect needs a plain list).
        self._free_offsets: list[int] = [0] if self.capacity else []
        self._free_sizes: list[int] = [self.capacity] if self.capacity else []
        self._allocated: dict[int, int] = {}

    @property
    def num_free_bytes(self) -> int:
        """Bytes not allocated (possibly fragmented)."""
        return sum(self._free_sizes)

    @property
    def num_allocated(self) -> int:
        """Number of live slots."""
        return len(self._allocated)

    def size_of(self, offset: int) -> int | None:
        """Return the rounded size of the live slot at `offset`, or None if there is none."""
        return self._allocated.get(offset)

    def can_allocate(self, nbytes: int) -> bool:
        """Return whether `allocate(nbytes)` would succeed now."""
        size = self._round(nbytes)
        return any(free >= size for free in self._free_sizes)

    def allocate(self, nbytes: int) -> int | None:
        """Return the offset of a new slot of at least `nbytes`, or None if none fits."""
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        size = self._round(nbytes)
        for i, free in enumerate(self._free_sizes):
            if free >= size:
                offset = self._free_offsets[i]
                if free == size:
                    del self._free_offsets[i]
                    del self._free_sizes[i]
                else:
                    self._free_offsets[i] = offset + size
                    self._free_sizes[i] = free - size
                self._allocated[offset] = size
                return offset
        return None

    def free(self, offset: int) -> None:
        """Return the slot at `offset` to the free list.

        Raises:
            KeyError: no live slot starts at `offset` (a double free or a foreign offset).
        """
        size = self._allocated.pop(offset)
        i = bisect.bisect_left(self._free_offsets, offset)
        # Coalesce with the free block just after, then with the one just before.
        if i < len(self._free_offsets) and offset + size == self._free_offsets[i]:
            size += self._free_sizes[i]
            del self._free_offsets[i]
            del self._free_sizes[i]
        if i > 0 and self._free_offsets[i - 1] + self._free_sizes[i - 1] == offset:
            self._free_sizes[i - 1] += size
            return
        self._free_offsets.insert(i, offset)
        self._free_sizes.insert(i, size)

    def free_all(self) -> None:
        """Free every slot at once."""
        self._allocated.clear()
        self._free_offsets = [0] if self.capacity else []
        self._free_sizes = [self.capacity] if self.capacity else []

    def _round(self, nbytes: int) -> int:
        # A zero-byte slot still needs a distinct offset.
        mask = self.alignment - 1
        return max(self.alignment, (nbytes + mask) & ~mask)
