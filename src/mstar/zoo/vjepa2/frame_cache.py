"""A paged KV cache of frame blocks, and the attention of a frame-block step.

A block holds exactly one frame block (``F = cond_tokens + patches`` tokens) of one rollout
row, so a row's block table lists its frames in order and a step appends one block per row::

    pool, layer l  [ blk 0 | blk 1 | ... | blk num_blocks-1 | sink ]   each [F, heads, head_dim]
    row r          block table [7, 2, 9]  = frames 0, 1, 2 of the row
    step           row r writes frame 3 into a fresh block, then its F queries attend to
                   the 4 * F keys of blocks [7, 2, 9, new]  (block-causal: all of them)

Allocation and ref counts are `mstar.engines.BlockManager`'s (block size ``F``, no prefix
hashing: a frame's keys depend on the row's whole history). The per-step description is the
engines' `AttentionMetadata`, so the engines' backends run it too (`TorchPagedAttention` as
a reference, FlashInfer's paged kernels on CUDA); `FrameBlockAttention` is the pure-torch
backend for this access pattern: one block-granular write and, per group of rows with the
same number of frames, one gather and one unmasked SDPA.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from mstar.engines.attention.base import AttentionBackend, AttentionMetadata
from mstar.engines.block_manager import BlockManager
from mstar.engines.kv_cache import KVCacheSpec, allocate_kv_cache
from mstar.engines.sampling_params import SamplingParams
from mstar.engines.sequence import Sequence

__all__ = ["FrameBlockAttention", "FrameKVPool", "frame_metadata", "make_attention_backend"]


class FrameKVPool:
    """Paged K/V storage for frame blocks, with `BlockManager` bookkeeping.

    Args:
        spec: Layers, heads, head size and dtype of the predictor.
        frame_tokens: Tokens per frame block (the block size).
        num_blocks: Blocks in the pool (one per row per cached frame).
        device: Where the pool lives.
    """

    def __init__(self, spec: KVCacheSpec, frame_tokens: int, num_blocks: int, device: torch.device) -> None:
        self.spec = spec
        self.frame_tokens = frame_tokens
        self.num_blocks = num_blocks
        self.tensor = allocate_kv_cache(spec, num_blocks, frame_tokens, device)
        self.layers = [(layer[0], layer[1]) for layer in self.tensor]
        self.blocks = BlockManager(num_blocks, frame_tokens, enable_prefix_caching=False)
        self._next_key = 0

    @property
    def num_free_blocks(self) -> int:
        """Count the blocks no row holds."""
        return self.blocks.num_free_blocks

    def new_row(self, request_id: str) -> Sequence:
        """Return an empty row (a sequence whose block table will list its frames)."""
        self._next_key += 1
        # Rows carry frames, not tokens: only the block table and computed count are used.
        return Sequence(request_id, [], SamplingParams(), arrival=self._next_key)

    def append_frame(self, row: Sequence) -> int:
        """Give ``row`` a block for its next frame (if it has none yet); return that block."""
        copies = self.blocks.append(row, self.frame_tokens)
        assert not copies, "frame blocks are never shared"
        return row.block_table[row.num_computed_tokens // self.frame_tokens]

    def free(self, row: Sequence) -> None:
        """Return a row's blocks to the pool."""
        self.blocks.free(row)


def frame_metadata(rows: list[Sequence], frame_tokens: int, device: torch.device) -> AttentionMetadata:
    """Describe a step where every row appends one frame block and attends to all its frames.

    Each row's next frame must already have its block (`FrameKVPool.append_frame`).
    """
    f = frame_tokens
    num = len(rows)
    seq_lens = np.fromiter((r.num_computed_tokens + f for r in rows), np.int64, num)
    new_blocks = np.fromiter((r.block_table[r.num_computed_tokens // f] for r in rows), np.int64, num)
    slots = (new_blocks[:, None] * f + np.arange(f)[None, :]).reshape(-1)
    return AttentionMetadata(
        num_tokens=num * f,
        slot_mapping=torch.from_numpy(slots).to(device),
        query_start_loc=np.arange(num + 1, dtype=np.int64) * f,
        seq_lens=seq_lens,
        block_tables=[r.block_table for r in rows],
        kv_limits=np.repeat(seq_lens, f),  # every query sees its whole sequence
        block_size=f,
        seq_keys=np.fromiter((r.arrival for r in rows), np.int64, num),
    )


class FrameBlockAttention:
    """`AttentionBackend` for frame-block steps, in plain torch (CPU and CUDA).

    Requires every sequence of a step to query exactly one whole block that it attends to
    entirely (what `frame_metadata` describes).
    """

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self._new_blocks: torch.Tensor | None = None
        self._num_rows = 0
        # Per group of rows with equal length: (row indices or None for all, gathered blocks, frames).
        self._groups: list[tuple[torch.Tensor | None, torch.Tensor, int]] = []
        self._scratch: dict[tuple[torch.dtype, int], torch.Tensor] = {}

    def plan(self, metadata: AttentionMetadata) -> None:
        """Check the step's shape; build the write and gather indices."""
        f = metadata.block_size
        if not (metadata.query_lens == f).all() or (metadata.seq_lens % f).any():
            raise ValueError("FrameBlockAttention runs steps of whole frame blocks only")
        if metadata.kv_limits is not None and not (metadata.kv_limits == np.repeat(metadata.seq_lens, f)).all():
            raise ValueError("FrameBlockAttention needs every query to see its whole sequence")
        frames = metadata.seq_lens // f
        tables = metadata.block_tables
        self._num_rows = len(frames)
        new = [tables[i][n - 1] for i, n in enumerate(frames.tolist())]
        self._new_blocks = torch.tensor(new, dtype=torch.long, device=self.device)
        self._groups = []
        for length in np.unique(frames).tolist():
            rows = np.flatnonzero(frames == length)
            gather = np.array([tables[i][:length] for i in rows], dtype=np.int64).reshape(-1)
            index = None if len(rows) == len(frames) else torch.from_numpy(rows).to(self.device)
            self._groups.append((index, torch.from_numpy(gather).to(self.device), int(length)))

    def _gather(self, cache: torch.Tensor, blocks: torch.Tensor, slot: int) -> torch.Tensor:
        """Copy ``blocks`` of ``cache`` into a reused buffer (fresh memory costs more than the copy)."""
        numel = blocks.numel() * cache[0].numel()
        key = (cache.dtype, slot)
        buf = self._scratch.get(key)
        if buf is None or buf.numel() < numel or buf.device != cache.device:
            size = numel if buf is None else max(numel, 2 * buf.numel())
            buf = self._scratch[key] = torch.empty(size, dtype=cache.dtype, device=cache.device)
        out = buf[:numel].view(blocks.numel(), *cache.shape[1:])
        torch.index_select(cache, 0, blocks, out=out)
        return out

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        scale: float,
    ) -> torch.Tensor:
        """Write the step's K/V blocks, then attend each row over all its frames."""
        assert self._new_blocks is not None, "plan() must run before forward()"
        k_cache, v_cache = kv_cache
        rows, f = self._num_rows, k_cache.shape[1]
        heads, head_dim = q.shape[1], q.shape[2]
        k_cache.index_copy_(0, self._new_blocks, k.view(rows, f, *k.shape[1:]))
        v_cache.index_copy_(0, self._new_blocks, v.view(rows, f, *v.shape[1:]))
        queries = q.view(rows, f, heads, head_dim)
        out = torch.empty_like(queries)
        for index, blocks, length in self._groups:
            n = blocks.numel() // length
            keys = self._gather(k_cache, blocks, 0).view(n, length * f, *k_cache.shape[2:])
            values = self._gather(v_cache, blocks, 1).view(n, length * f, *v_cache.shape[2:])
            qs = queries if index is None else queries.index_select(0, index)
            o = F.scaled_dot_product_attention(
                qs.transpose(1, 2),
                keys.transpose(1, 2),
                values.transpose(1, 2),
                scale=scale,
                enable_gqa=heads != k_cache.shape[2],
            ).transpose(1, 2)
            if index is None:
                out = o
            else:
                out.index_copy_(0, index, o)
        return out.reshape(rows * f, heads, head_dim)


def make_attention_backend(name: str, device: torch.device) -> AttentionBackend:
    """Return the backend named ``name``: "frame", "paged" (the engines' torch reference),
    "flashinfer" (CUDA), or "auto" (FlashInfer on CUDA when installed, else "frame").

    Raises:
        ValueError: Unknown name, or FlashInfer asked for where it cannot run.
    """
    if name == "frame" or (name == "auto" and device.type != "cuda"):
        return FrameBlockAttention(device)
    if name == "paged":
        from mstar.engines.attention.torch_paged import TorchPagedAttention

        return TorchPagedAttention(device, decode_staging=False)
    if name not in ("auto", "flashinfer"):
        raise ValueError(f"attention_backend must be auto, frame, paged or flashinfer, got {name!r}")
    if device.type != "cuda":
        raise ValueError("the flashinfer attention backend needs a CUDA device")
    try:
        from mstar.engines.attention.flashinfer_backend import FlashInferAttention
    except ImportError as exc:
        if name == "flashinfer":
            raise ValueError(f"the flashinfer backend is not available: {exc}") from exc
        return FrameBlockAttention(device)
    return FlashInferAttention(device)
