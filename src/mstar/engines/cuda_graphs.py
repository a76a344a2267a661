"""Decode steps replayed from CUDA graphs, one per batch-size bucket.

Graphs are captured largest bucket first into one shared memory pool. Every input lives
in a static buffer; a step of `n` sequences runs the smallest bucket `>= n`, and the
padded slots compute garbage that nobody reads: their tokens write K/V into the sink
block and attend only to it.

```
 static input_ids  [ t0 t1 t2 | 0  0  0  0  0 ]     bucket 8, n = 3
 static slots      [ s0 s1 s2 | sink ...      ]
 gather slots      row i: the slots of positions [0, max_len) of sequence i (sink-padded)
 mask              row i: positions < seq_len[i]; padded rows see the sink only
```

The graph's attention is a fixed-shape gather over `max_len` key positions (steps whose
sequences are longer fall back to eager execution).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from mstar.engines.attention.base import AttentionMetadata, write_kv
from mstar.engines.paged_model import PagedKVContext, PagedModel

__all__ = ["CudaGraphDecodeRunner", "batch_size_buckets"]


def batch_size_buckets(max_batch_size: int) -> list[int]:
    """Return the captured batch sizes: 1, 2, 4, 8, then multiples of 16, and the maximum."""
    sizes = {b for b in (1, 2, 4, 8) if b <= max_batch_size}
    sizes.update(range(16, max_batch_size + 1, 16))
    sizes.add(max_batch_size)
    return sorted(sizes)


class _StaticDecodeAttention:
    """Fixed-shape paged decode attention reading the graph's static buffers."""

    def __init__(self, slot_mapping: torch.Tensor, gather: torch.Tensor, mask: torch.Tensor) -> None:
        self.slot_mapping = slot_mapping
        self.gather = gather
        self.mask = mask
        self.batch_size = 1

    def plan(self, metadata: AttentionMetadata) -> None:
        """Do nothing: the runner fills the static buffers before each replay."""

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        scale: float,
    ) -> torch.Tensor:
        """Write K/V of the bucket's tokens and attend over the gathered keys."""
        bs = self.batch_size
        k_flat, v_flat = write_kv(kv_cache, self.slot_mapping[:bs], k, v)
        num_kv_heads, head_dim = k_flat.shape[-2], k_flat.shape[-1]
        max_len = self.gather.shape[1]
        index = self.gather[:bs].reshape(-1)
        ks = k_flat.index_select(0, index).view(bs, max_len, num_kv_heads, head_dim)
        vs = v_flat.index_select(0, index).view(bs, max_len, num_kv_heads, head_dim)
        o = F.scaled_dot_product_attention(
            q.unsqueeze(2),
            ks.transpose(1, 2),
            vs.transpose(1, 2),
            attn_mask=self.mask[:bs],
            scale=scale,
            enable_gqa=q.shape[1] != num_kv_heads,
        )
        return o.squeeze(2)


class CudaGraphDecodeRunner:
    """Capture and replay decode forwards of a `PagedModel` per batch-size bucket."""

    def __init__(
        self,
        model: PagedModel,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        *,
        max_batch_size: int,
        max_len: int,
        block_size: int,
        sink_slot: int,
        device: torch.device,
    ) -> None:
        """Allocate static buffers; call `capture()` next."""
        self.model = model
        self.block_size = block_size
        self.sink_slot = sink_slot
        self.device = device
        self.buckets = batch_size_buckets(max_batch_size)
        self.max_batch_size = max_batch_size
        self.max_len = -(-max_len // block_size) * block_size
        self.input_ids = torch.zeros(max_batch_size, dtype=torch.long, device=device)
        self.positions = torch.zeros(max_batch_size, dtype=torch.long, device=device)
        slot_mapping = torch.full((max_batch_size,), sink_slot, dtype=torch.long, device=device)
        gather = torch.full(
            (max_batch_size, self.max_len), sink_slot, dtype=torch.long, device=device
        )
        mask = torch.zeros(max_batch_size, 1, 1, self.max_len, dtype=torch.bool, device=device)
        mask[..., 0] = True
        self.attention = _StaticDecodeAttention(slot_mapping, gather, mask)
        self.ctx = PagedKVContext(self.attention, kv_caches)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.pool: Any = None

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture one graph per bucket, largest first, sharing one memory pool."""
        stream = torch.cuda.Stream(self.device)
        for bs in reversed(self.buckets):
            self.attention.batch_size = bs
            args = (self.input_ids[:bs], self.positions[:bs], self.ctx)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                self.model(*args)  # warm-up: lazy init and autotuning outside the graph
            torch.cuda.current_stream(self.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                self.outputs[bs] = self.model(*args)
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[bs] = graph
        torch.cuda.synchronize(self.device)

    def can_run(self, metadata: AttentionMetadata) -> bool:
        """Whether a step is a decode-only batch that fits the captured shapes."""
        return (
            metadata.is_decode_only
            and metadata.num_seqs <= self.max_batch_size
            and int(metadata.seq_lens.max()) <= self.max_len
        )

    def run(
        self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        """Replay the bucket for this step; return hidden states `[num_seqs, hidden]`."""
        n = metadata.num_seqs
        bs = next(b for b in self.buckets if b >= n)
        size = self.block_size
        gather = np.full((bs, self.max_len), self.sink_slot, dtype=np.int64)
        mask = np.zeros((bs, self.max_len), dtype=bool)
        mask[:, 0] = True
        pos = np.arange(self.max_len)
        for row, (table, length) in enumerate(zip(metadata.block_tables, metadata.seq_lens, strict=True)):
            blocks = np.asarray(table[: -(-int(length) // size)], dtype=np.int64)
            gather[row, :length] = (blocks[:, None] * size + np.arange(size)).reshape(-1)[:length]
            mask[row] = pos < length
        att = self.attention
        att.batch_size = bs
        self.input_ids[:n].copy_(input_ids)
        self.input_ids[n:bs].zero_()
        self.positions[:n].copy_(positions)
        self.positions[n:bs].zero_()
        att.slot_mapping[:n].copy_(metadata.slot_mapping)
        att.slot_mapping[n:bs].fill_(self.sink_slot)
        att.gather[:bs].copy_(torch.from_numpy(gather), non_blocking=True)
        att.mask[:bs, 0, 0].copy_(torch.from_numpy(mask), non_blocking=True)
        self.graphs[bs].replay()
        return self.outputs[bs][:n]
