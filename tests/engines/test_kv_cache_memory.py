"""The KV cache's allocation: zeroed, and on Linux CPUs advised into huge pages before it is
touched (decode attention reads blocks all over it; 4 KiB pages cost TLB misses per block)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from mstar.engines.kv_cache import KVCacheSpec, advise_huge_pages, allocate_kv_cache


def _kernel_has_huge_pages() -> bool:  # madvise takes the advice (whatever the mode)
    return Path("/sys/kernel/mm/transparent_hugepage/enabled").exists()


def test_the_cache_is_zeroed_with_a_sink_block() -> None:
    spec = KVCacheSpec(num_layers=2, num_kv_heads=3, head_dim=64, dtype=torch.bfloat16)
    cache = allocate_kv_cache(spec, 700, 16, torch.device("cpu"))
    assert cache.shape == (2, 2, 701, 16, 3, 64) and cache.dtype == torch.bfloat16
    assert cache.is_contiguous() and not cache.any()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux only")
def test_huge_pages_are_advised_for_whole_pages_inside_the_tensor() -> None:
    assert not advise_huge_pages(torch.empty(1 << 20, dtype=torch.uint8))  # under 2 MiB
    assert not advise_huge_pages(torch.empty(8 << 20, dtype=torch.uint8, device="meta"))
    big = torch.empty(8 << 20, dtype=torch.uint8)
    assert advise_huge_pages(big) == _kernel_has_huge_pages()
    big.fill_(1)  # still the tensor's own memory, whole
    assert int(big.sum()) == 8 << 20
