"""FlashInfer paged attention for CUDA (import this module only where FlashInfer exists).

Each step is planned once: decode-only causal batches use
`BatchDecodeWithPagedKVCacheWrapper`, everything else (prefill chunks, mixed batches,
full and block-causal masks) `BatchPrefillWithPagedKVCacheWrapper`, with a custom mask
built from the per-query key limits when some query is not plain causal. The cache
layout is FlashInfer's "NHD" `(k_cache, v_cache)` pair, so no copy is needed.

The page table handed to FlashInfer is the usual CSR triple:

```
 indptr        [0, 2, 3]           sequence i owns indices[indptr[i]:indptr[i+1]]
 indices       [7, 2, 4]           block ids
 last_page_len [3, 1]              filled slots of each sequence's last block
```
"""

from __future__ import annotations

from typing import Any

import flashinfer
import numpy as np
import torch

from mstar.engines.attention.base import AttentionMetadata, write_kv

__all__ = ["FlashInferAttention"]

_WORKSPACE_BYTES = 256 * 1024 * 1024


def page_table(metadata: AttentionMetadata) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Return `(indptr, indices, last_page_len)` (int32) for a step."""
    size = metadata.block_size
    seq_lens = metadata.seq_lens
    num_pages = (seq_lens + size - 1) // size
    indptr = np.zeros(len(seq_lens) + 1, dtype=np.int32)
    np.cumsum(num_pages, out=indptr[1:])
    indices = np.fromiter(
        (b for table, n in zip(metadata.block_tables, num_pages, strict=True) for b in table[:n]),
        dtype=np.int32,
        count=int(indptr[-1]),
    )
    last_page_len = (seq_lens - (num_pages - 1) * size).astype(np.int32)
    return indptr, indices, last_page_len


def custom_mask(metadata: AttentionMetadata) -> np.ndarray:
    """Return the flattened boolean mask (per sequence `[q_len, kv_len]`, row-major)."""
    assert metadata.kv_limits is not None
    parts = []
    starts = metadata.query_start_loc
    for i, kv_len in enumerate(metadata.seq_lens):
        limits = metadata.kv_limits[starts[i] : starts[i + 1]]
        parts.append((np.arange(kv_len)[None, :] < limits[:, None]).reshape(-1))
    return np.concatenate(parts)


class FlashInferAttention:
    """`AttentionBackend` on FlashInfer's paged prefill and decode kernels."""

    def __init__(self, device: torch.device | str = "cuda") -> None:
        """Create the wrappers with one shared workspace on `device`."""
        self.device = torch.device(device)
        self._workspace = torch.empty(_WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
        self._prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self._workspace, "NHD")
        self._decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(self._workspace, "NHD")
        self._metadata: AttentionMetadata | None = None
        self._wrapper: Any = None
        self._slot_mapping: torch.Tensor | None = None

    def plan(self, metadata: AttentionMetadata) -> None:
        """Remember the step; the kernels are planned at the first layer (head counts known)."""
        self._metadata = metadata
        self._slot_mapping = metadata.slot_mapping
        self._wrapper = None

    def _plan_kernels(self, q: torch.Tensor, k_cache: torch.Tensor, scale: float) -> None:
        metadata = self._metadata
        assert metadata is not None, "plan() must run before forward()"
        indptr, indices, last_page_len = page_table(metadata)
        dev = self.device

        def to_dev(a: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(a).to(dev, non_blocking=True)

        num_heads, head_dim = q.shape[1], q.shape[2]
        num_kv_heads = k_cache.shape[2]
        common = {"q_data_type": q.dtype, "kv_data_type": k_cache.dtype, "sm_scale": scale}
        if metadata.is_decode_only:
            self._decode.plan(
                to_dev(indptr), to_dev(indices), to_dev(last_page_len),
                num_heads, num_kv_heads, head_dim, metadata.block_size, **common,
            )
            self._wrapper = self._decode
            return
        qo_indptr = to_dev(metadata.query_start_loc.astype(np.int32))
        mask = None if metadata.kv_limits is None else to_dev(custom_mask(metadata))
        self._prefill.plan(
            qo_indptr, to_dev(indptr), to_dev(indices), to_dev(last_page_len),
            num_heads, num_kv_heads, head_dim, metadata.block_size,
            custom_mask=mask, causal=mask is None, **common,
        )
        self._wrapper = self._prefill

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        scale: float,
    ) -> torch.Tensor:
        """Write the step's K/V into the cache and attend (see `AttentionBackend`)."""
        assert self._slot_mapping is not None, "plan() must run before forward()"
        k_cache, v_cache = kv_cache
        write_kv(kv_cache, self._slot_mapping, k, v)
        q = q.contiguous()  # callers may pass a view of a fused projection
        if self._wrapper is None:
            self._plan_kernels(q, k_cache, scale)
        return self._wrapper.run(q, (k_cache, v_cache))
