"""FlashInfer paged attention for CUDA (import this module only where FlashInfer exists).

Each step is planned once, at its first layer (head counts are known then). Its sequences
split in two kinds, each planned on its own wrappers:

* written sequences read all their keys from the cache (this step's were just written):
  decode tokens alone use `BatchDecodeWithPagedKVCacheWrapper`, anything else
  `BatchPrefillWithPagedKVCacheWrapper`, causal, unmasked or with a custom mask;
* read-only sequences read their context from the cache and their own keys from the
  step's `k`, `v` rows; the two partial attentions are merged by their log-sum-exps
  (`flashinfer.merge_state`), which equals attention over the concatenated keys:

```
 read-only chunk, q_len 3, seq_len 8      keys | cache 0..4 | own 5..7 |
   paged prefill over the cache part  ->  o_cache, lse_cache   (queries see all of it)
   ragged prefill over the own rows   ->  o_own, lse_own       (mask restricted to them)
   merge_state(o_cache, lse_cache, o_own, lse_own)  =  attention over keys 0..7
```

A kernel gets no mask when every query sees all its keys (`causal=False`) or exactly its
causal prefix; otherwise a custom mask built from the per-query key limits. Masked plans
run on their own wrappers pinned to FA2: a wrapper fixes its backend at its first plan,
and the one "auto" picks on Hopper (FA3) has no custom masks. The cache
layout is FlashInfer's "NHD" `(k_cache, v_cache)` pair, so no copy is needed. The page
table handed to FlashInfer is the usual CSR triple (`flashinfer_plan.page_table`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import flashinfer
import numpy as np
import torch

from mstar.engines.attention.base import AttentionMetadata, write_kv
from mstar.engines.attention.flashinfer_plan import (
    decode_uses_tensor_cores,
    mask_plan,
    offsets,
    page_table,
    row_limits,
)

__all__ = ["FlashInferAttention"]

_WORKSPACE_BYTES = 256 * 1024 * 1024


class _Rows:
    """Some rows of a tensor, ascending: one contiguous run (taken as a view) or an index."""

    __slots__ = ("index", "start", "stop")

    def __init__(self, rows: np.ndarray, device: torch.device) -> None:
        self.start, self.stop = int(rows[0]), int(rows[-1]) + 1
        is_run = self.stop - self.start == len(rows)
        self.index = None if is_run else torch.from_numpy(rows.astype(np.int64)).to(device)

    def covers(self, num_rows: int) -> bool:
        """Whether these are all `num_rows` rows, in order."""
        return self.index is None and self.start == 0 and self.stop == num_rows

    def take(self, x: torch.Tensor) -> torch.Tensor:
        """Return these rows of `x` (contiguous when `x` is)."""
        return x[self.start : self.stop] if self.index is None else x.index_select(0, self.index)

    def put(self, out: torch.Tensor, x: torch.Tensor) -> None:
        """Write `x` into these rows of `out`."""
        if self.index is None:
            out[self.start : self.stop] = x
        else:
            out.index_copy_(0, self.index, x)


@dataclass(slots=True)
class _WrittenPlan:
    """The written sequences of a step: one planned paged kernel over their batch rows."""

    wrapper: Any
    rows: _Rows


@dataclass(slots=True)
class _ReadOnlyPlan:
    """The read-only sequences of a step (row sets below are local to their rows).

    Attributes:
        rows: their rows in the batch; the ragged kernel `own` runs over all of them.
        own: the ragged wrapper planned over their own keys.
        context: the paged wrapper planned over their cached keys, or None.
        cached: those of sequences with cached keys (`context`'s rows), or None.
        merged: `(local, within cached)` rows that see cached and own keys, or None.
        cache_only: `(local, within cached)` rows that see none of their own keys, or None.
    """

    rows: _Rows
    own: Any
    context: Any = None
    cached: _Rows | None = None
    merged: tuple[_Rows, _Rows] | None = None
    cache_only: tuple[_Rows, _Rows] | None = None


class FlashInferAttention:
    """`AttentionBackend` on FlashInfer's paged prefill and decode kernels."""

    def __init__(self, device: torch.device | str = "cuda") -> None:
        """Create the wrappers with one shared workspace on `device`."""
        self.device = torch.device(device)
        # Each wrapper holds one plan; their runs are sequential on one stream, so they
        # can share the float workspace (only a run's split-KV partials live there). Zeroed:
        # FlashInfer documents that some backends need it zero on first use.
        self.workspace = torch.zeros(_WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
        self._decodes: dict[bool, Any] = {}  # by use_tensor_cores, made on first use
        self._prefills: dict[tuple[str, bool], Any] = {}  # made on first use, see _prefill
        self._metadata: AttentionMetadata | None = None
        self._slot_mapping: torch.Tensor | None = None
        self._is_planned = False
        self._written: _WrittenPlan | None = None
        self._read_only: _ReadOnlyPlan | None = None

    def native_decode(self, k_cache: torch.Tensor) -> None:
        """Return None: FlashInfer's kernels serve every decode step here."""
        return None

    def plan(self, metadata: AttentionMetadata) -> None:
        """Remember the step; the kernels are planned at the first layer (head counts known)."""
        self._metadata = metadata
        self._slot_mapping = metadata.slot_mapping
        self._is_planned = False

    def _index(self, a: np.ndarray, masked: bool = False) -> torch.Tensor:
        """A plan's index array. On the host: `plan()` copies it to the device itself, and
        given device arrays it would copy them back, a blocking round trip each. A masked
        plan's stay on the device: FlashInfer packs the custom mask there, indexed by them."""
        tensor = torch.from_numpy(a)
        return tensor.to(self.device, non_blocking=True) if masked else tensor

    def _mask(self, mask: np.ndarray | None) -> torch.Tensor | None:
        return None if mask is None else torch.from_numpy(mask).to(self.device, non_blocking=True)

    def _decode(self, num_heads: int, num_kv_heads: int) -> Any:
        """Return the decode wrapper for this GQA group size (see `decode_uses_tensor_cores`)."""
        tensor_cores = decode_uses_tensor_cores(num_heads, num_kv_heads)
        wrapper = self._decodes.get(tensor_cores)
        if wrapper is None:
            wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                self.workspace, "NHD", use_tensor_cores=tensor_cores
            )
            self._decodes[tensor_cores] = wrapper
        return wrapper

    def _prefill(self, role: str, is_masked: bool) -> Any:
        """Return the prefill wrapper of `role` ("written", "context" or "own": ragged).

        Roles planned in one step need distinct wrappers (a wrapper holds one plan), and
        masked plans FA2 ones (see the module notes).
        """
        wrapper = self._prefills.get((role, is_masked))
        if wrapper is None:
            make = (
                flashinfer.BatchPrefillWithRaggedKVCacheWrapper
                if role == "own"
                else flashinfer.BatchPrefillWithPagedKVCacheWrapper
            )
            wrapper = make(self.workspace, "NHD", backend="fa2" if is_masked else "auto")
            self._prefills[role, is_masked] = wrapper
        return wrapper

    def _plan_kernels(self, q: torch.Tensor, k_cache: torch.Tensor, scale: float) -> None:
        metadata = self._metadata
        assert metadata is not None, "plan() must run before forward()"
        dims = (q.shape[1], k_cache.shape[2], q.shape[2])  # heads, kv heads, head dim
        common = {"q_data_type": q.dtype, "kv_data_type": k_cache.dtype, "sm_scale": scale}
        limits = row_limits(metadata)
        is_read_only = (
            np.zeros(metadata.num_seqs, dtype=bool)
            if metadata.read_only is None
            else metadata.read_only
        )
        row_is_read_only = np.repeat(is_read_only, metadata.query_lens)
        self._written = self._read_only = None
        if not is_read_only.all():
            rows = np.flatnonzero(~row_is_read_only)
            self._written = self._plan_written(
                metadata, np.flatnonzero(~is_read_only), rows, limits[rows], dims, common
            )
        if is_read_only.any():
            rows = np.flatnonzero(row_is_read_only)
            self._read_only = self._plan_read_only(
                metadata, np.flatnonzero(is_read_only), rows, limits[rows], dims, common
            )
        self._is_planned = True

    def _plan_written(
        self,
        metadata: AttentionMetadata,
        seq_ids: np.ndarray,
        rows: np.ndarray,
        visible: np.ndarray,
        dims: tuple[int, int, int],
        common: dict[str, Any],
    ) -> _WrittenPlan:
        q_lens, kv_lens = metadata.query_lens[seq_ids], metadata.seq_lens[seq_ids]
        tables = [metadata.block_tables[i] for i in seq_ids]
        pages = page_table(kv_lens, tables, metadata.block_size)
        if (q_lens == 1).all() and (visible == kv_lens).all():
            decode = self._decode(dims[0], dims[1])
            decode.plan(*map(self._index, pages), *dims, metadata.block_size, **common)
            return _WrittenPlan(decode, _Rows(rows, self.device))
        mask, causal = mask_plan(q_lens, kv_lens, visible)
        masked = mask is not None
        wrapper = self._prefill("written", masked)
        wrapper.plan(
            self._index(offsets(q_lens), masked),
            *(self._index(a, masked) for a in pages),
            *dims,
            metadata.block_size,
            custom_mask=self._mask(mask),
            causal=causal,
            **common,
        )
        return _WrittenPlan(wrapper, _Rows(rows, self.device))

    def _plan_read_only(
        self,
        metadata: AttentionMetadata,
        seq_ids: np.ndarray,
        rows: np.ndarray,
        visible: np.ndarray,
        dims: tuple[int, int, int],
        common: dict[str, Any],
    ) -> _ReadOnlyPlan:
        q_lens = metadata.query_lens[seq_ids]
        num_cached = metadata.seq_lens[seq_ids] - q_lens
        cached_of_row = np.repeat(num_cached, q_lens)
        # A query sees a prefix of its keys: the cache part first, then its own rows.
        own_visible = np.maximum(visible - cached_of_row, 0)
        mask, causal = mask_plan(q_lens, q_lens, own_visible)
        q_indptr = self._index(offsets(q_lens), mask is not None)
        own = self._prefill("own", mask is not None)
        own.plan(q_indptr, q_indptr, *dims, custom_mask=self._mask(mask), causal=causal, **common)
        has_cache = num_cached > 0
        plan = _ReadOnlyPlan(_Rows(rows, self.device), own)
        if not has_cache.any():
            return plan
        # The cache kernel skips sequences without cached keys (a page table needs >= 1).
        row_has_cache = np.repeat(has_cache, q_lens)
        cached_ids = seq_ids[has_cache]
        tables = [metadata.block_tables[i] for i in cached_ids]
        pages = page_table(num_cached[has_cache], tables, metadata.block_size)
        mask, causal = mask_plan(
            q_lens[has_cache],
            num_cached[has_cache],
            np.minimum(visible, cached_of_row)[row_has_cache],
        )
        masked = mask is not None
        plan.context = self._prefill("context", masked)
        plan.context.plan(
            self._index(offsets(q_lens[has_cache]), masked),
            *(self._index(a, masked) for a in pages),
            *dims,
            metadata.block_size,
            custom_mask=self._mask(mask),
            causal=causal,
            **common,
        )
        within_cached = np.cumsum(row_has_cache) - 1
        sees_own = own_visible > 0

        def pair(selected: np.ndarray) -> tuple[_Rows, _Rows] | None:
            if not selected.any():
                return None
            local = np.flatnonzero(selected)
            return _Rows(local, self.device), _Rows(within_cached[local], self.device)

        plan.cached = _Rows(np.flatnonzero(row_has_cache), self.device)
        plan.merged = pair(row_has_cache & sees_own)
        plan.cache_only = pair(row_has_cache & ~sees_own)
        return plan

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
        if not self._is_planned:
            self._plan_kernels(q, k_cache, scale)
        written, read_only = self._written, self._read_only
        if read_only is None:
            assert written is not None
            return written.wrapper.run(q, (k_cache, v_cache))
        o_read_only = self._attend_read_only(read_only, q, k, v, (k_cache, v_cache))
        if written is None:
            return o_read_only
        out = torch.empty_like(q)
        read_only.rows.put(out, o_read_only)
        written.rows.put(out, written.wrapper.run(written.rows.take(q), (k_cache, v_cache)))
        return out

    def _attend_read_only(
        self,
        plan: _ReadOnlyPlan,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
    ) -> torch.Tensor:
        """Attend the read-only rows over their cached and their own keys; merge the two."""
        q = plan.rows.take(q)
        out, lse = plan.own.run(
            q, plan.rows.take(k).contiguous(), plan.rows.take(v).contiguous(), return_lse=True
        )
        if plan.cached is None:
            return out
        o_cache, lse_cache = plan.context.run(plan.cached.take(q), kv_cache, return_lse=True)
        if plan.merged is not None:
            local, within = plan.merged
            merged, _ = flashinfer.merge_state(
                within.take(o_cache), within.take(lse_cache), local.take(out), local.take(lse)
            )
            if local.covers(len(out)):
                return merged
            local.put(out, merged)
        if plan.cache_only is not None:
            # These rows saw none of their own keys (their ragged result is undefined).
            local, within = plan.cache_only
            local.put(out, within.take(o_cache))
        return out
