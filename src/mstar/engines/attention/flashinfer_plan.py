"""FlashInfer's plan arguments, computed on the host (no FlashInfer needed to import this).

The page table handed to FlashInfer is the usual CSR triple:

```
 indptr        [0, 2, 3]           sequence i owns indices[indptr[i]:indptr[i+1]]
 indices       [7, 2, 4]           block ids
 last_page_len [3, 1]              filled slots of each sequence's last block (>= 1)
```
"""

from __future__ import annotations

import numpy as np

from mstar.engines.attention.base import AttentionMetadata

__all__ = [
    "decode_uses_tensor_cores",
    "mask_plan",
    "offsets",
    "padded_page_table",
    "page_table",
    "row_limits",
]

# The GQA group sizes FlashInfer's CUDA-core decode kernel is compiled for (v0.2.0: 1, 2, 3, 4,
# 8; later 6 too). Wider groups (BAGEL-7B's Qwen2.5: 28 query heads over 4 KV heads, 7) raise
# "Unsupported group_size" there, and from 5 up the tensor-core kernel is the faster one anyway.
_CUDA_CORE_GROUPS = frozenset({1, 2, 3, 4})


def decode_uses_tensor_cores(num_heads: int, num_kv_heads: int) -> bool:
    """Whether decode runs FlashInfer's tensor-core kernel: every GQA group wider than 4."""
    return num_heads // num_kv_heads not in _CUDA_CORE_GROUPS


def offsets(lens: np.ndarray) -> np.ndarray:
    """Return the int32 CSR offsets `[0, l0, l0 + l1, ...]` of `lens`."""
    indptr = np.zeros(len(lens) + 1, dtype=np.int32)
    np.cumsum(lens, out=indptr[1:])
    return indptr


def page_table(
    kv_lens: np.ndarray, block_tables: list[list[int]], size: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Return `(indptr, indices, last_page_len)` (int32) covering keys `[0, kv_lens[i])`."""
    num_pages = (kv_lens + size - 1) // size
    indptr = offsets(num_pages)
    indices = np.fromiter(
        (b for table, n in zip(block_tables, num_pages, strict=True) for b in table[:n]),
        dtype=np.int32,
        count=int(indptr[-1]),
    )
    last_page_len = (kv_lens - (num_pages - 1) * size).astype(np.int32)
    return indptr, indices, last_page_len


def row_limits(metadata: AttentionMetadata) -> np.ndarray:
    """Return each query's key limit within its sequence (plain causal when none is given)."""
    seq_lens, q_lens = metadata.seq_lens, metadata.query_lens
    if metadata.kv_limits is not None:
        return np.minimum(metadata.kv_limits, np.repeat(seq_lens, q_lens))
    seq_of_row = np.repeat(np.arange(metadata.num_seqs), q_lens)
    offset = np.arange(metadata.num_tokens) - metadata.query_start_loc[seq_of_row]
    return seq_lens[seq_of_row] - q_lens[seq_of_row] + offset + 1


def mask_plan(
    q_lens: np.ndarray, kv_lens: np.ndarray, visible: np.ndarray
) -> tuple[np.ndarray | None, bool]:
    """Return `(custom_mask, causal)` for one kernel whose query row t sees keys `[0, visible[t])`.

    No mask when every query sees all its keys, or exactly FlashInfer's causal prefix (the
    queries aligned to the end of the keys); otherwise the flattened boolean mask, one
    row-major `[q_len, kv_len]` block per sequence (FlashInfer's mask layout).
    """
    kv_of_row = np.repeat(kv_lens, q_lens)
    if (visible == kv_of_row).all():
        return None, False
    q_of_row = np.repeat(q_lens, q_lens)
    offset = np.arange(len(visible)) - np.repeat(offsets(q_lens)[:-1], q_lens)
    if (visible == kv_of_row - q_of_row + offset + 1).all():
        return None, True
    parts = []
    lo = 0
    for q_len, kv_len in zip(q_lens.tolist(), kv_lens.tolist(), strict=True):
        rows = visible[lo : lo + q_len]
        lo += q_len
        parts.append((np.arange(kv_len)[None, :] < rows[:, None]).reshape(-1))
    return np.concatenate(parts), False


def padded_page_table(
    seq_lens: np.ndarray,
    block_tables: list[list[int]],
    block_size: int,
    batch_size: int,
    sink_block: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Return a decode step's page table padded to `batch_size` rows (a CUDA graph's bucket):
    each padding row one page, the sink block, holding one key (its own)."""
    indptr, indices, last = page_table(seq_lens, block_tables, block_size)
    pad = batch_size - len(seq_lens)
    return (
        np.concatenate([indptr, indptr[-1] + np.arange(1, pad + 1, dtype=np.int32)]),
        np.concatenate([indices, np.full(pad, sink_block, dtype=np.int32)]),
        np.concatenate([last, np.ones(pad, dtype=np.int32)]),
    )
