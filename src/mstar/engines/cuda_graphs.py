"""Decode steps replayed from CUDA graphs, one per batch-size bucket.

Graphs are captured largest bucket first into one shared memory pool. Every input lives
in a static buffer; a step of `n` sequences runs the smallest bucket `>= n`, and the
padded slots compute garbage that nobody reads: their tokens write K/V into the sink
block and attend only to it.

With FlashInfer (the CUDA default) the graphs replay FlashInfer's own decode kernel: one
`BatchDecodeWithPagedKVCacheWrapper(use_cuda_graph=True)` per bucket, its page-table
buffers fixed at construction, planned outside the graph before each replay (host arrays:
the plan copies them into the fixed buffers) so each step reads just its sequences' keys:

```
 indptr        [0, 2, 3, 4, 5]     bucket 4, n = 2: rows 2 and 3 are padding
 indices       [7, 2, 4, S, S]     S: the sink block
 last_page_len [3, 1, 1, 1]
```

Without FlashInfer (the torch backend on CUDA) the graph's attention is a fixed-shape
gather of every sequence's first `max_len` key slots:

```
 static input_ids  [ t0 t1 t2 | 0  0  0  0  0 ]     bucket 8, n = 3
 static slots      [ s0 s1 s2 | sink ...      ]
 gather slots      row i: the slots of positions [0, max_len) of sequence i (sink-padded)
 mask              row i: positions < seq_len[i]; padded rows see the sink only
```

It reads `max_len` keys per sequence whatever their lengths; steps whose sequences are
longer than `max_len` run eagerly on either route.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from mstar.engines.attention.base import AttentionMetadata, write_kv
from mstar.engines.attention.flashinfer_plan import decode_uses_tensor_cores, padded_page_table
from mstar.engines.interfaces import PagedKVContext, PagedModel

__all__ = ["CudaGraphDecodeRunner", "batch_size_buckets"]


def batch_size_buckets(max_batch_size: int) -> list[int]:
    """Return the captured batch sizes: 1, 2, 4, 8, then multiples of 16, and the maximum."""
    sizes = {b for b in (1, 2, 4, 8) if b <= max_batch_size}
    sizes.update(range(16, max_batch_size + 1, 16))
    sizes.add(max_batch_size)
    return sorted(sizes)


class _GatherDecodeAttention:
    """Fixed-shape paged decode attention over gathered key slots (the torch route)."""

    def __init__(
        self, slot_mapping: torch.Tensor, gather: torch.Tensor, mask: torch.Tensor, sink_slot: int
    ) -> None:
        self.slot_mapping = slot_mapping
        self.gather = gather
        self.mask = mask
        self.sink_slot = sink_slot
        self.batch_size = 1
        self.workspace: torch.Tensor | None = None

    def native_decode(self, k_cache: torch.Tensor) -> None:
        """Return None: the graph replays its own decode."""
        return None

    def plan(self, metadata: AttentionMetadata) -> None:
        """Do nothing: `prepare` fills the static buffers before each replay."""

    def prepare(self, metadata: AttentionMetadata, bs: int) -> None:
        """Fill the gather table and mask of a step's sequences (padding rows see the sink)."""
        size, max_len = metadata.block_size, self.gather.shape[1]
        gather = np.full((bs, max_len), self.sink_slot, dtype=np.int64)
        mask = np.zeros((bs, max_len), dtype=bool)
        mask[:, 0] = True
        pos = np.arange(max_len)
        for row, (table, length) in enumerate(
            zip(metadata.block_tables, metadata.seq_lens, strict=True)
        ):
            blocks = np.asarray(table[: -(-int(length) // size)], dtype=np.int64)
            gather[row, :length] = (blocks[:, None] * size + np.arange(size)).reshape(-1)[:length]
            mask[row] = pos < length
        self.gather[:bs].copy_(torch.from_numpy(gather), non_blocking=True)
        self.mask[:bs, 0, 0].copy_(torch.from_numpy(mask), non_blocking=True)

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


class _FlashInferDecodeAttention:
    """FlashInfer's decode kernel in CUDA-graph mode: one wrapper per bucket, fixed buffers.

    A bucket's wrapper is made and planned (on the padding rows alone) at its warm-up run,
    outside the capture, where the head counts and scale are first seen; `prepare` plans it
    on a step's page table before each replay.
    """

    def __init__(
        self,
        workspace: torch.Tensor,
        slot_mapping: torch.Tensor,
        *,
        max_batch_size: int,
        max_pages: int,
        sink_block: int,
        block_size: int,
        device: torch.device,
    ) -> None:
        self.workspace = workspace
        self.slot_mapping = slot_mapping
        self.sink_block = sink_block
        self.block_size = block_size
        self.indptr = torch.zeros(max_batch_size + 1, dtype=torch.int32, device=device)
        self.indices = torch.full(
            (max_batch_size * max_pages,), sink_block, dtype=torch.int32, device=device
        )
        self.last_page_len = torch.ones(max_batch_size, dtype=torch.int32, device=device)
        self.wrappers: dict[int, Any] = {}
        self.head_args: tuple[int, int, int] | None = None  # heads, KV heads, head size
        self.types: dict[str, Any] = {}
        self.batch_size = 1

    def native_decode(self, k_cache: torch.Tensor) -> None:
        """Return None: the graph replays FlashInfer's decode."""
        return None

    def plan(self, metadata: AttentionMetadata) -> None:
        """Do nothing: `prepare` plans the bucket's wrapper before each replay."""

    def _wrapper(self, bs: int, q: torch.Tensor, k_cache: torch.Tensor, scale: float) -> Any:
        import flashinfer

        self.head_args = (q.shape[1], k_cache.shape[2], q.shape[2])
        self.types = {"q_data_type": q.dtype, "kv_data_type": k_cache.dtype, "sm_scale": scale}
        wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, "NHD", use_cuda_graph=True,
            use_tensor_cores=decode_uses_tensor_cores(q.shape[1], k_cache.shape[2]),
            paged_kv_indptr_buffer=self.indptr[: bs + 1],
            paged_kv_indices_buffer=self.indices,
            paged_kv_last_page_len_buffer=self.last_page_len[:bs],
        )  # fmt: skip
        self.wrappers[bs] = wrapper
        self._plan(
            wrapper,
            *padded_page_table(np.zeros(0, np.int64), [], self.block_size, bs, self.sink_block),
        )
        return wrapper

    def _plan(
        self, wrapper: Any, indptr: np.ndarray, indices: np.ndarray, last: np.ndarray
    ) -> None:
        assert self.head_args is not None
        wrapper.plan(
            torch.from_numpy(indptr), torch.from_numpy(indices), torch.from_numpy(last),
            *self.head_args, self.block_size, **self.types,
        )  # fmt: skip

    def prepare(self, metadata: AttentionMetadata, bs: int) -> None:
        """Plan the bucket's wrapper on the step's page table (host arrays, outside the graph)."""
        tables = padded_page_table(
            metadata.seq_lens, metadata.block_tables, self.block_size, bs, self.sink_block
        )
        self._plan(self.wrappers[bs], *tables)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        scale: float,
    ) -> torch.Tensor:
        """Write K/V of the bucket's tokens and run the bucket's planned decode."""
        bs = self.batch_size
        write_kv(kv_cache, self.slot_mapping[:bs], k, v)
        wrapper = self.wrappers.get(bs)
        if wrapper is None:  # the bucket's warm-up run, before its capture
            wrapper = self._wrapper(bs, q, kv_cache[0], scale)
        return wrapper.run(q.contiguous(), kv_cache)


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
        flashinfer_workspace: torch.Tensor | None = None,
    ) -> None:
        """Allocate static buffers; call `capture()` next.

        ``flashinfer_workspace``: replay FlashInfer's decode kernel, with this float
        workspace (the eager backend's); None: the gather route.
        """
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
        self.attention: _GatherDecodeAttention | _FlashInferDecodeAttention
        if flashinfer_workspace is not None:
            self.attention = _FlashInferDecodeAttention(
                flashinfer_workspace, slot_mapping, max_batch_size=max_batch_size,
                max_pages=self.max_len // block_size, sink_block=sink_slot // block_size,
                block_size=block_size, device=device,
            )  # fmt: skip
        else:
            gather = torch.full(
                (max_batch_size, self.max_len), sink_slot, dtype=torch.long, device=device
            )
            mask = torch.zeros(max_batch_size, 1, 1, self.max_len, dtype=torch.bool, device=device)
            mask[..., 0] = True
            self.attention = _GatherDecodeAttention(slot_mapping, gather, mask, sink_slot)
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
        att = self.attention
        att.batch_size = bs
        att.prepare(metadata, bs)
        self.input_ids[:n].copy_(input_ids)
        self.input_ids[n:bs].zero_()
        self.positions[:n].copy_(positions)
        self.positions[n:bs].zero_()
        att.slot_mapping[:n].copy_(metadata.slot_mapping)
        att.slot_mapping[n:bs].fill_(self.sink_slot)
        self.graphs[bs].replay()
        return self.outputs[bs][:n]
