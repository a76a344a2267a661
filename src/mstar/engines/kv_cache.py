"""KV-cache geometry, sizing from a memory budget, and allocation.

```
 cache tensor  [num_layers, 2 (K, V), num_blocks + 1, block_size, num_kv_heads, head_dim]
 layer l       (cache[l, 0], cache[l, 1])      each an "NHD" paged cache
 block num_blocks (the extra one) is a sink for padded tokens (CUDA-graph batch slots)
```
"""

from __future__ import annotations

import ctypes
import os
import sys
from dataclasses import dataclass

import torch

from mstar.errors import KVCacheCapacityError

__all__ = [
    "KVCacheSpec",
    "advise_huge_pages",
    "allocate_kv_cache",
    "available_memory_bytes",
    "budget_bytes",
    "num_blocks_for_budget",
]

_CPU_DEFAULT_CAP = 1 << 30
_HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14


@dataclass(frozen=True, slots=True)
class KVCacheSpec:
    """What a model needs per cached token."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    def bytes_per_block(self, block_size: int) -> int:
        """Return the bytes one block takes across all layers (K and V)."""
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * block_size * self.num_kv_heads * self.head_dim * itemsize


def available_memory_bytes(device: torch.device) -> int:
    """Return the free memory of `device` (CUDA: free device memory; CPU: MemAvailable)."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


def budget_bytes(budget: int | float | None, device: torch.device) -> int:
    """Return a KV-cache budget in bytes.

    Args:
        budget: bytes (an int), a fraction in (0, 1] of `device`'s free memory (a float), or
            None for the default: 0.8 of free memory on CUDA, min(1 GiB, 0.25 of free) elsewhere.
        device: where the cache will live.
    """
    if budget is None:
        if device.type == "cuda":
            return budget_bytes(0.8, device)
        return min(budget_bytes(0.25, device), _CPU_DEFAULT_CAP)
    if isinstance(budget, float):
        if not 0.0 < budget <= 1.0:
            raise KVCacheCapacityError(
                f"a fractional KV-cache budget must be in (0, 1], got {budget}"
            )
        return int(available_memory_bytes(device) * budget)
    return int(budget)


def num_blocks_for_budget(
    spec: KVCacheSpec, block_size: int, budget: int | float, device: torch.device
) -> int:
    """Return how many blocks fit in `budget`.

    Args:
        spec: the model's per-token cache needs.
        block_size: slots per block.
        budget: bytes (an int), or a fraction in (0, 1] of `device`'s free memory.
        device: where the cache will live.
    """
    num_bytes = budget_bytes(budget, device)
    num_blocks = num_bytes // spec.bytes_per_block(block_size) - 1  # minus the sink block
    if num_blocks < 1:
        raise KVCacheCapacityError(
            f"a KV-cache budget of {num_bytes} bytes holds no block of {block_size} tokens "
            f"({spec.bytes_per_block(block_size)} bytes each); raise the budget"
        )
    return num_blocks


def advise_huge_pages(tensor: torch.Tensor) -> bool:
    """Ask Linux to back a CPU tensor's untouched memory with transparent huge pages (2 MiB).

    Decode attention reads a paged cache block by block in table order, all over the cache: with
    4 KiB pages nearly every block costs TLB misses (about a fifth of a long-context decode
    step's attention, measured); 2 MiB pages cover a cache with few TLB entries. Advice only:
    pages already touched stay as they are, and a kernel without transparent huge pages (or
    with them off) ignores it. Returns whether the advice was taken.
    """
    if tensor.device.type != "cpu" or not sys.platform.startswith("linux"):
        return False
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    first = -(-start // _HUGE_PAGE) * _HUGE_PAGE  # whole huge pages inside the tensor
    last = end // _HUGE_PAGE * _HUGE_PAGE
    if last <= first:
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return bool(libc.madvise(first, last - first, _MADV_HUGEPAGE) == 0)


def allocate_kv_cache(
    spec: KVCacheSpec, num_blocks: int, block_size: int, device: torch.device
) -> torch.Tensor:
    """Allocate the zeroed cache tensor (zeros: masked-out reads must stay finite); on CPU in
    huge pages where the kernel allows (`advise_huge_pages`: advised before zeroing touches it)."""
    shape = (spec.num_layers, 2, num_blocks + 1, block_size, spec.num_kv_heads, spec.head_dim)
    if device.type != "cpu":
        return torch.zeros(shape, dtype=spec.dtype, device=device)
    cache = torch.empty(shape, dtype=spec.dtype, device=device)
    advise_huge_pages(cache)
    return cache.zero_()
