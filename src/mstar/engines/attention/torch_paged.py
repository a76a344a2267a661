"""Pure-torch paged attention: the reference backend, and the one used on CPU.

Decode tokens of a step are batched into one masked attention over keys gathered from
their block tables (padded to the longest sequence); prefill chunks run one sequence
at a time. Grouped-query attention never materialises repeated K/V heads.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from mstar.engines.attention.base import AttentionMetadata

__all__ = ["TorchPagedAttention"]


def _slots_of(block_table: list[int] | np.ndarray, length: int, block_size: int) -> np.ndarray:
    """Return the cache slots of positions `[0, length)` for one block table."""
    positions = np.arange(length)
    table = np.asarray(block_table, dtype=np.int64)
    return table[positions // block_size] * block_size + positions % block_size


class TorchPagedAttention:
    """Reference paged attention (`AttentionBackend`) written with torch ops only."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        """Create the backend for tensors on `device`."""
        self.device = torch.device(device)
        self._decode_rows: torch.Tensor | None = None
        self._decode_slots: torch.Tensor | None = None
        self._decode_mask: torch.Tensor | None = None
        self._decode_shape = (0, 0)
        self._all_decode = False
        # Prefill chunks: (query start, query end, key slots, mask or None for pure causal).
        self._prefills: list[tuple[int, int, torch.Tensor, torch.Tensor | None]] = []
        self._slot_mapping: torch.Tensor | None = None

    def plan(self, metadata: AttentionMetadata) -> None:
        """Build gather indices and masks for the step."""
        self._slot_mapping = metadata.slot_mapping
        starts = metadata.query_start_loc
        query_lens = np.diff(starts)
        seq_lens = metadata.seq_lens
        size = metadata.block_size
        limits = metadata.kv_limits
        decode_ids = [
            i
            for i in range(metadata.num_seqs)
            if query_lens[i] == 1 and (limits is None or limits[starts[i]] == seq_lens[i])
        ]
        self._all_decode = len(decode_ids) == metadata.num_tokens
        self._prefills = []
        if decode_ids:
            lens = seq_lens[decode_ids]
            max_len = int(lens.max())
            num_blocks = -(-max_len // size)
            tables = np.zeros((len(decode_ids), num_blocks), dtype=np.int64)
            for row, i in enumerate(decode_ids):
                table = metadata.block_tables[i][:num_blocks]
                tables[row, : len(table)] = table
            positions = np.arange(max_len)
            decode_slots = tables[:, positions // size] * size + positions % size
            self._decode_slots = torch.from_numpy(decode_slots.reshape(-1)).to(self.device)
            decode_mask = positions[None, :] < lens[:, None]
            self._decode_mask = torch.from_numpy(decode_mask[:, None, None, :]).to(self.device)
            self._decode_rows = torch.from_numpy(starts[decode_ids].astype(np.int64)).to(
                self.device
            )
            self._decode_shape = (len(decode_ids), max_len)
        else:
            self._decode_rows = None
        decode_set = set(decode_ids)
        for i in range(metadata.num_seqs):
            if i in decode_set:
                continue
            start, end = int(starts[i]), int(starts[i + 1])
            length = int(seq_lens[i])
            key_slots = torch.from_numpy(_slots_of(metadata.block_tables[i], length, size))
            mask: torch.Tensor | None = None
            if limits is not None or end - start != length:
                if limits is not None:
                    row_limits = limits[start:end]
                else:
                    row_limits = np.arange(length - (end - start), length) + 1
                mask_np = np.arange(length)[None, :] < row_limits[:, None]
                mask = torch.from_numpy(mask_np).to(self.device)
            self._prefills.append((start, end, key_slots.to(self.device), mask))

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
        num_kv_heads, head_dim = k_cache.shape[-2], k_cache.shape[-1]
        k_flat = k_cache.view(-1, num_kv_heads, head_dim)
        v_flat = v_cache.view(-1, num_kv_heads, head_dim)
        k_flat.index_copy_(0, self._slot_mapping, k)
        v_flat.index_copy_(0, self._slot_mapping, v)
        gqa = q.shape[1] != num_kv_heads
        if self._all_decode:
            return self._decode(q, k_flat, v_flat, scale, gqa)
        out = torch.empty_like(q)
        if self._decode_rows is not None:
            out[self._decode_rows] = self._decode(q[self._decode_rows], k_flat, v_flat, scale, gqa)
        for start, end, slots, mask in self._prefills:
            qs = q[start:end].transpose(0, 1).unsqueeze(0)
            ks = k_flat.index_select(0, slots).transpose(0, 1).unsqueeze(0)
            vs = v_flat.index_select(0, slots).transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(
                qs, ks, vs, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=gqa
            )
            out[start:end] = o[0].transpose(0, 1)
        return out

    def _decode(
        self, q: torch.Tensor, k_flat: torch.Tensor, v_flat: torch.Tensor, scale: float, gqa: bool
    ) -> torch.Tensor:
        assert self._decode_slots is not None and self._decode_mask is not None
        batch, max_len = self._decode_shape
        num_kv_heads, head_dim = k_flat.shape[1], k_flat.shape[2]
        ks = k_flat.index_select(0, self._decode_slots).view(batch, max_len, num_kv_heads, head_dim)
        vs = v_flat.index_select(0, self._decode_slots).view(batch, max_len, num_kv_heads, head_dim)
        o = F.scaled_dot_product_attention(
            q.unsqueeze(2),
            ks.transpose(1, 2),
            vs.transpose(1, 2),
            attn_mask=self._decode_mask,
            scale=scale,
            enable_gqa=gqa,
        )
        return o.squeeze(2)
