"""The attention-backend interface and the per-step batch description backends read.

A step's tokens are one flat batch: the chunks of all scheduled sequences, concatenated.

```
 tokens      | s0: 5 prefill tokens | s1: 1 | s2: 1 |      query_start_loc = [0, 5, 6, 7]
 kv (after)  | s0: 5                | s1: 9 | s2: 33|      seq_lens        = [5, 9, 33]
```

The paged K/V cache of one layer is a pair of tensors `(k_cache, v_cache)`, each
`[num_slots // block_size, block_size, num_kv_heads, head_dim]` (FlashInfer's "NHD"
layout); the last block is a sink that padded tokens write into.

Attention patterns are data: query `t` of sequence `i` sees keys `[0, kv_limits[t])` of
its sequence (causal: its own position + 1; full within a segment: the segment's end;
block-causal: its block's end). Patterns mix freely within one step. A *read-only*
sequence (a query: denoising tokens over a context, action tokens over a prefix) writes
nothing: its first `seq_lens[i] - query_len` keys come from the cache and its last
`query_len` from the step's own `k`, `v`; its slots in `slot_mapping` are the sink's.

```
 read-only chunk, query_len 3, seq_lens 8:   keys | cache 0..4 | step k 5..7 |
                              kv_limits 8 8 8  (all see the context and each other)
```
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

__all__ = ["AttentionBackend", "AttentionMetadata", "write_kv"]


@dataclass(slots=True)
class AttentionMetadata:
    """Host-side description of one step's batch, shared by every layer.

    Attributes:
        num_tokens: tokens in the flat batch.
        slot_mapping: `[num_tokens]` int64 cache slot each token's K/V is written to (device).
        query_start_loc: `[num_seqs + 1]` offsets of each sequence's chunk in the batch.
        seq_lens: `[num_seqs]` K/V length of each sequence once this step has written.
        block_tables: per sequence, its blocks covering `seq_lens` (host lists).
        kv_limits: `[num_tokens]` exclusive end of the keys each query sees (positions
            within its own sequence), or None when every query is plain causal.
        block_size: slots per block.
        seq_keys: `[num_seqs]` ids of the sequences, unique within the engine and stable
            across steps (lets a backend keep per-sequence state between steps), or None.
        read_only: `[num_seqs]` bool: the sequence's step K/V are not written and its last
            `query_len` keys are the step's own (see the module docstring); None: none is.
    """

    num_tokens: int
    slot_mapping: torch.Tensor
    query_start_loc: np.ndarray
    seq_lens: np.ndarray
    block_tables: list[list[int]]
    kv_limits: np.ndarray | None
    block_size: int
    seq_keys: np.ndarray | None = None
    read_only: np.ndarray | None = None

    @property
    def num_seqs(self) -> int:
        """Count the sequences in the batch."""
        return len(self.seq_lens)

    @property
    def query_lens(self) -> np.ndarray:
        """Return each sequence's number of query tokens in this step."""
        return np.diff(self.query_start_loc)

    @property
    def is_decode_only(self) -> bool:
        """Whether every sequence contributes exactly one (causal) query token."""
        return (
            self.num_tokens == self.num_seqs and self.kv_limits is None and self.read_only is None
        )


class AttentionBackend(Protocol):
    """Paged attention for one step; `plan` once, then `forward` once per layer."""

    @property
    def workspace(self) -> torch.Tensor | None:
        """The kernels' scratch memory, which CUDA graph buckets share (FlashInfer's float
        workspace; None for backends without one)."""
        ...

    def native_decode(
        self, k_cache: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """Return ``(slots, block tables, lengths)`` of a decode-only step for native decoder
        layers that read the cache themselves, or None where the backend offers none (only
        the CPU backend with the native kernels does; see `TorchPagedAttention`)."""
        ...

    def plan(self, metadata: AttentionMetadata) -> None:
        """Prepare the step (index tensors, kernel plans) from `metadata`."""
        ...

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        scale: float,
    ) -> torch.Tensor:
        """Write `k`, `v` into the cache, then attend `q` over each sequence's keys.

        Args:
            q: `[num_tokens, num_heads, head_dim]`.
            k: `[num_tokens, num_kv_heads, head_dim]` (new keys of this step).
            v: like `k`.
            kv_cache: this layer's `(k_cache, v_cache)`.
            scale: the softmax scale (usually `head_dim ** -0.5`).

        Returns:
            `[num_tokens, num_heads, head_dim]`.
        """
        ...


def write_kv(
    kv_cache: tuple[torch.Tensor, torch.Tensor],
    slots: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Write a step's keys and values into their cache slots; return the flat cache views.

    Args:
        kv_cache: One layer's `(k_cache, v_cache)`, `[blocks, block_size, kv_heads, head_dim]`.
        slots: `[tokens]` flat slot of each token (`block * block_size + offset`).
        k: `[tokens, kv_heads, head_dim]`; `v` likewise.

    Returns:
        The caches viewed as `[slots, kv_heads, head_dim]`.
    """
    k_cache, v_cache = kv_cache
    k_flat = k_cache.view(-1, *k_cache.shape[-2:])
    v_flat = v_cache.view(-1, *v_cache.shape[-2:])
    k_flat.index_copy_(0, slots, k)
    v_flat.index_copy_(0, slots, v)
    return k_flat, v_flat
