"""Torch paged attention: the reference backend, and the one used on CPU.

Decode tokens of a step are batched into one masked attention over keys gathered from
their block tables (padded to the longest sequence); chunks whose queries all see all
their keys (bidirectional frames, read-only queries over a context) and share a shape are
batched into one unmasked attention; other prefill chunks run one sequence at a time.
Read-only chunks append their own step keys to the cached ones instead of reading them
back. Grouped-query attention never materialises repeated K/V heads.

Decode staging (on by default): gathering every sequence's whole history from its blocks
in every layer of every step copies the full cache per step, which dominates CPU decode
at long contexts. With staging, the backend keeps per layer a contiguous copy of the
decode batch's keys and values and appends one token per step; the copy is rebuilt from
the paged cache (the source of truth) whenever the decode batch changes (a sequence
joins, leaves or did anything but decode one token):

```
 paged cache (all layers)            staging, layer l   [batch row, kv head, position, dim]
 [blk 7][blk 2][blk 9] ... ──gather on change──▶  row 0: s0 keys 0..L0-1 | next token appended
                                                   row 1: s1 keys 0..L1-1 |
```

Deterministic (`deterministic=True`, CPU): every query row that writes its keys, decode or
prefill, attends through the native prefill kernel, whose sums for a row (its keys up to its
limit, in the cache's block order) do not depend on the rows beside it: a row's result does
not depend on the step's other rows, on where a prompt was split into chunks, or on the
number of threads. Read-only chunks keep the
torch paths above (each chunk attends over its own keys, however the step is made up).
Nothing is staged.

Native prefill (CPU): the writing chunks attend in one `prefill_attention` call over the paged
cache, tile by tile (see `csrc/prefill.h`): no mask is built and no key gathered. Every
writing chunk (whole causal prompts, a prompt's later chunks after chunked prefill,
block-causal frames, bidirectional chunks over a context) in float32 or bfloat16 (on a CPU
with AMX, `prefill_uses_amx`, bfloat16's products are tile products; elsewhere its keys and
values are widened to float32 once for many products).

Native decode (CPU, on by default): where mstar's native kernels are built
(`mstar.engines.native`), decode rows in float32 or bfloat16 with a head size of 16, 32, 64,
128 or 256 attend in one C++ call that reads each row's keys and values in place from the
paged cache through its block table, at the cache's own width. Nothing is staged or
gathered then; the torch paths above serve everything else (prefill chunks, other dtypes,
CUDA, a machine without a compiler).
"""

from __future__ import annotations

import itertools
from typing import cast

import numpy as np
import torch
import torch.nn.functional as F

from mstar.engines.attention.base import AttentionMetadata, write_kv
from mstar.engines.native import cpu_kernels

__all__ = ["TorchPagedAttention"]


def _slots_of(block_table: list[int] | np.ndarray, length: int, block_size: int) -> np.ndarray:
    """Return the cache slots of positions `[0, length)` for one block table."""
    positions = np.arange(length)
    table = np.asarray(block_table, dtype=np.int64)
    return table[positions // block_size] * block_size + positions % block_size


def _padding_mask(lens: np.ndarray, width: int, device: torch.device) -> torch.Tensor:
    """Return the additive mask `[rows, 1, 1, width]` hiding each row's keys past its length."""
    visible = np.arange(width)[None, :] < lens[:, None]
    additive = np.where(visible, 0.0, -np.inf).astype(np.float32)
    return torch.from_numpy(additive[:, None, None, :]).to(device)


class _Chunk:
    """A chunk attended alone: its query rows, the cached keys it reads, its mask (the slots
    and mask made at first use: a chunk the native kernel takes needs neither)."""

    __slots__ = (
        "_key_slots",
        "_mask",
        "_num_cached",
        "end",
        "is_plain_causal",
        "is_read_only",
        "row_limits",
        "start",
        "table",
    )

    def __init__(
        self,
        start: int,
        end: int,
        table: list[int],
        length: int,
        row_limits: np.ndarray,
        is_read_only: bool,
        plain_causal: bool,
    ) -> None:
        self.start, self.end = start, end
        self.table = table  # the sequence's blocks
        self.row_limits = row_limits  # [q_len]: the keys each query row sees
        self.is_read_only = is_read_only  # its own keys are the step's rows, appended last
        self.is_plain_causal = plain_causal  # a whole causal prompt: attention needs no mask
        self._key_slots: torch.Tensor | None = None
        self._mask: torch.Tensor | None = None  # [q_len, keys] bool
        self._num_cached = length - (end - start) if is_read_only else length

    def key_slots(self, block_size: int, device: torch.device) -> torch.Tensor:
        """Cache slots of the keys read from the cache."""
        if self._key_slots is None:
            slots = _slots_of(self.table, self._num_cached, block_size)
            self._key_slots = torch.from_numpy(slots).to(device)
        return self._key_slots

    def mask(self, length: int, device: torch.device) -> torch.Tensor | None:
        """The chunk's mask over its `length` keys, or None for plain causal."""
        if self.is_plain_causal:
            return None
        if self._mask is None:
            visible = np.arange(length)[None, :] < self.row_limits[:, None]
            self._mask = torch.from_numpy(visible).to(device)
        return self._mask


class _Group:
    """Chunks of one shape that see all their keys: one batched attention without a mask."""

    __slots__ = (
        "is_read_only",
        "key_slots",
        "length",
        "num_chunks",
        "q_len",
        "row_start",
        "rows",
        "stage",
    )

    def __init__(
        self,
        num_chunks: int,
        q_len: int,
        rows: torch.Tensor,
        key_slots: torch.Tensor,
        is_read_only: bool,
        row_start: int | None,
        stage: _GroupStage | None = None,
        length: int = 0,
    ) -> None:
        self.num_chunks, self.q_len = num_chunks, q_len
        self.rows = rows  # the chunks' query rows, chunk after chunk
        self.key_slots = key_slots  # each chunk's keys to read from the cache, chunk after chunk
        self.is_read_only = is_read_only
        self.row_start = row_start  # the rows are one contiguous run from here (or None)
        self.stage = stage  # contiguous copies of the chunks' keys kept across steps (or None)
        self.length = length  # keys each chunk attends to


class _GroupStage:
    """Contiguous keys and values of one group of sequences, kept from step to step.

    A group that runs again with the same sequences (rollout rows appending a frame block
    each step; queries over an unchanged context, step after step) would otherwise gather
    every key it attends to from the paged cache in every layer of every step. Staged, a
    written group appends only its new rows; a read-only group reads its context as it is
    and puts its own rows after it:

    ```
     staged, layer l, head h   row 0: | frames 0..n-1 (kept) | frame n (this step) |
                               row 1: | ...                  | ...                 |
    ```

    The paged cache stays the source of truth: a group seen for the first time, or whose
    last step did not run every layer, is gathered from it again.
    """

    __slots__ = (
        "buffers",
        "capacity",
        "is_active",
        "is_read_only",
        "num_steps",
        "rebuild",
        "staged_len",
        "written",
    )

    def __init__(self, is_read_only: bool) -> None:
        self.is_read_only = is_read_only
        # per layer (its cache's data_ptr)
        self.buffers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.written: set[int] = set()  # layers whose buffers got the last step's rows
        self.staged_len = 0  # keys per sequence kept, valid in every buffer
        self.capacity = 0
        self.is_active = False
        self.rebuild = True
        self.num_steps = 0  # steps this group ran

    def can_continue(self, prior: int, is_read_only: bool) -> bool:
        """Whether last step's copies hold exactly the `prior` keys each sequence had."""
        complete = bool(self.buffers) and self.written == set(self.buffers)
        return complete and is_read_only == self.is_read_only and self.staged_len == prior

    def plan(self, prior: int, length: int, fits: bool) -> None:
        """Decide this step: keep the copies (append) or rebuild them; stage at all (`fits`)?"""
        self.rebuild = not self.can_continue(prior, self.is_read_only)
        # A group seen for the first time may never run again (a one-frame rollout, a single
        # query): it gathers as usual, and is staged from its second step on.
        self.is_active = fits and self.num_steps > 0
        self.num_steps += 1
        if not self.is_active:
            self.buffers = {}
            return
        if length > self.capacity:
            self.capacity = max(2 * self.capacity, -(-(length + 64) // 128) * 128)
            self.rebuild, self.buffers = True, {}
        self.written = set()
        # Read-only rows are scratch: the next step finds only the context staged.
        self.staged_len = prior if self.is_read_only else length

    def keys_values(
        self,
        k_cache: torch.Tensor,
        k_flat: torch.Tensor,
        v_flat: torch.Tensor,
        group: _Group,
        k_own: torch.Tensor,
        v_own: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Return this layer's `[n, kv_heads, length, dim]` keys and values, staged."""
        n, q_len, length = group.num_chunks, group.q_len, group.length
        kv_heads, dim = k_cache.shape[-2], k_cache.shape[-1]
        key = k_cache.data_ptr()
        buffers = self.buffers.get(key)
        if buffers is None or buffers[0].shape[0] != n:
            # Head-major, [n, kv_heads, capacity, dim]: attention reads each head's keys as
            # one dense run (8 % faster than the token-major layout on a CPU).
            shape = (n, kv_heads, self.capacity, dim)
            buffers = self.buffers[key] = (
                torch.empty(shape, dtype=k_cache.dtype, device=k_cache.device),
                torch.empty(shape, dtype=k_cache.dtype, device=k_cache.device),
            )
        k_stage, v_stage = buffers
        prior = length - q_len
        if self.rebuild:
            # New copies: every key the group reads from the cache (a written group's own rows
            # are in it already; a read-only one's context).
            cached = prior if self.is_read_only else length
            if cached:
                ks = k_flat.index_select(0, group.key_slots).view(n, cached, kv_heads, dim)
                vs = v_flat.index_select(0, group.key_slots).view(n, cached, kv_heads, dim)
                k_stage[:n, :, :cached] = ks.transpose(1, 2)
                v_stage[:n, :, :cached] = vs.transpose(1, 2)
        if self.is_read_only or not self.rebuild:
            k_stage[:n, :, prior:length] = k_own.view(n, q_len, kv_heads, dim).transpose(1, 2)
            v_stage[:n, :, prior:length] = v_own.view(n, q_len, kv_heads, dim).transpose(1, 2)
        self.written.add(key)
        return k_stage[:n, :, :length], v_stage[:n, :, :length]


def _is_contiguous(starts: np.ndarray, members: list[int], q_len: int) -> bool:
    """Whether the chunks `members` lie back to back in the batch."""
    first = int(starts[members[0]])
    return all(int(starts[i]) == first + j * q_len for j, i in enumerate(members))


class _DecodeStaging:
    """Contiguous per-layer copies of the decode batch's keys and values."""

    def __init__(self) -> None:
        self.keys: tuple[int, ...] = ()
        self.lens = np.zeros(0, dtype=np.int64)
        self.capacity = 0
        self.rebuild = True
        self.buffers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.active = False
        self.position: int | None = None  # the one append column when every length is equal
        self.rows: torch.Tensor | None = None
        self.positions: torch.Tensor | None = None

    def deactivate(self) -> None:
        """Skip staging this step; the next decode step rebuilds."""
        self.active = False
        self.keys = ()

    def plan(
        self, keys: tuple[int, ...], lens: np.ndarray, max_len: int, device: torch.device
    ) -> None:
        """Decide whether this step can append to last step's copies or must rebuild."""
        self.rebuild = not (
            keys == self.keys
            and len(lens) == len(self.lens)
            and bool((lens == self.lens + 1).all())
            and max_len <= self.capacity
        )
        if self.rebuild and max_len > self.capacity:
            self.capacity = max(2 * self.capacity, -(-(max_len + 64) // 128) * 128)
            self.buffers = {}
        self.active = True
        self.keys = keys
        self.lens = lens.copy()
        # Sequences of one length (a wave of equal prompts) append into one column: a strided
        # copy instead of an indexed write per layer.
        self.position = int(lens[0]) - 1 if bool((lens == lens[0]).all()) else None
        if self.position is None:
            self.rows = torch.arange(len(lens), device=device)
            self.positions = torch.from_numpy(lens - 1).to(device)

    def layer_buffers(self, k_cache: torch.Tensor, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        key = k_cache.data_ptr()
        buffers = self.buffers.get(key)
        if buffers is None or buffers[0].shape[0] < batch:
            shape = (batch, k_cache.shape[-2], self.capacity, k_cache.shape[-1])
            dtype = _staged_dtype(k_cache)
            buffers = (
                torch.zeros(shape, dtype=dtype, device=k_cache.device),
                torch.zeros(shape, dtype=dtype, device=k_cache.device),
            )
            self.buffers[key] = buffers
        return buffers

    def append(self, stage: torch.Tensor, new: torch.Tensor, batch: int) -> None:
        """Write this step's `new` `[batch, kv_heads, dim]` at each row's last position."""
        if self.position is not None:
            stage[:batch, :, self.position].copy_(new)
        else:
            assert self.rows is not None and self.positions is not None
            stage[self.rows, :, self.positions] = new.to(stage.dtype)


_NATIVE_DTYPES = (torch.float32, torch.bfloat16)
_NATIVE_HEAD_DIMS = (16, 32, 64, 128, 256)


_NativeChunks = tuple[torch.Tensor | slice, torch.Tensor, torch.Tensor, torch.Tensor]
"""Prefill chunks as `prefill_attention` takes them: their rows in the step (a slice where they
are consecutive, as a step's prompts are), block tables, each row's table and each row's key
count."""


def _native_chunks(chunks: list[_Chunk], block_size: int, device: torch.device) -> _NativeChunks:
    """Return `chunks` as `prefill_attention` takes them (see `_NativeChunks`)."""
    width = max(-(-int(c.row_limits.max()) // block_size) for c in chunks)
    tables = np.zeros((len(chunks), width), dtype=np.int64)
    for n, chunk in enumerate(chunks):
        table = chunk.table[:width]
        tables[n, : len(table)] = table
    rows: torch.Tensor | slice = slice(chunks[0].start, chunks[-1].end)
    if any(a.end != b.start for a, b in itertools.pairwise(chunks)):
        rows = torch.from_numpy(np.concatenate([np.arange(c.start, c.end) for c in chunks]))
    seqs = np.concatenate([np.full(c.end - c.start, n) for n, c in enumerate(chunks)])
    lens = np.concatenate([c.row_limits for c in chunks])
    return (
        rows if isinstance(rows, slice) else rows.to(device),
        torch.from_numpy(tables),
        torch.from_numpy(seqs.astype(np.int64)),
        torch.from_numpy(lens),
    )


def _fits_native(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether the native decode kernel takes these queries over this cache (`cpu_kernels.cpp`)."""
    return (
        q.dtype == k_cache.dtype
        and q.dtype in _NATIVE_DTYPES
        and q.shape[-1] in _NATIVE_HEAD_DIMS
        and q.stride(-1) == 1
        and q.stride(1) == q.shape[-1]
        and k_cache.is_contiguous()
    )


def _staged_dtype(cache: torch.Tensor) -> torch.dtype:
    """Return the dtype decode staging keeps a cache's keys and values in.

    On a CPU, half-precision keys and values are staged as float32 (exact copies): the CPU's
    attention kernel ran 16 decode rows 2x faster over float32 than over bfloat16, more than
    paying for reading twice the bytes. The products still see the same inputs, each
    accumulated in float32.
    """
    if cache.device.type == "cpu" and cache.dtype in (torch.bfloat16, torch.float16):
        return torch.float32
    return cache.dtype


class TorchPagedAttention:
    """Reference paged attention (`AttentionBackend`) written with torch ops only."""

    def __init__(
        self,
        device: torch.device | str = "cpu",
        *,
        decode_staging: bool = True,
        chunk_staging: bool = True,
        stage_budget_bytes: int = 256 << 20,
        native: bool = True,
        deterministic: bool = False,
    ) -> None:
        """Create the backend for tensors on `device` (see the module notes on staging).

        `stage_budget_bytes` caps the keys one layer of one staged group may copy (K and V);
        larger groups gather from the cache every step. `native`: on a CPU, decode rows go
        through the native kernel where it is built and fits (see the module notes).
        `deterministic`: every writing row attends on its own (see the module notes).
        """
        self.device = torch.device(device)
        self.deterministic = deterministic
        if deterministic:
            decode_staging = chunk_staging = False
            native = True
        # Deterministic rows of the step: their indices, block tables and key counts.
        self._rows: torch.Tensor | None = None
        # The step's writing prefill chunks for the native kernel (rows, tables, each row's
        # sequence (its table) and key count).
        self._native_writing: _NativeChunks | None = None
        self.workspace: torch.Tensor | None = None  # no kernel scratch to share
        self._kernels = cpu_kernels() if native and self.device.type == "cpu" else None
        self._native_tables: torch.Tensor | None = None  # [decode rows, blocks] of the step
        self._native_lens: torch.Tensor | None = None
        self._row_seqs: torch.Tensor | None = None  # deterministic: each row's table
        self._native_used = False  # the last decode went through the kernel: nothing is staged
        self._staging = _DecodeStaging() if decode_staging else None
        self._chunk_staging = chunk_staging
        self._stage_budget_bytes = stage_budget_bytes
        # K and V bytes of one token in all layers, learnt from the first step (0: not yet,
        # so nothing is staged before it).
        self._staged_row_bytes = 1 << 62
        self._layers_seen: set[int] = set()
        self._stages: dict[tuple[int, ...], _GroupStage] = {}
        self.num_staged_groups = 0  # groups that continued their staged keys (not gathered)
        self._decode_rows: torch.Tensor | None = None
        self._decode_blocks: torch.Tensor | None = None
        self._decode_mask: torch.Tensor | None = None
        self._decode_shape = (0, 0)
        self._staged_len = 0
        self._staged_mask: torch.Tensor | None = None
        self._all_decode = False
        self._prefills: list[_Chunk] = []  # chunks attended one at a time
        self._groups: list[_Group] = []  # unmasked chunks of one shape, attended together
        self._slot_mapping: torch.Tensor | None = None
        # Reused gather buffers (keys, values): a fresh tensor per layer per step costs page
        # faults (about 1 us per 4 KiB page) that outweigh the copy itself.
        self._scratch: dict[tuple[torch.dtype, torch.device, int], torch.Tensor] = {}

    def _gather(self, flat: torch.Tensor, slots: torch.Tensor, which: int) -> torch.Tensor:
        """Return `flat[slots]` in a reused buffer (valid until the next gather of `which`)."""
        row = flat[0].numel()
        numel = slots.numel() * row
        key = (flat.dtype, flat.device, which)
        buf = self._scratch.get(key)
        if buf is None or buf.numel() < numel:
            size = numel if buf is None else max(numel, 2 * buf.numel())
            buf = self._scratch[key] = torch.empty(size, dtype=flat.dtype, device=flat.device)
        out = buf[:numel].view(slots.numel(), *flat.shape[1:])
        torch.index_select(flat, 0, slots, out=out)
        return out

    def plan(self, metadata: AttentionMetadata) -> None:
        """Build gather indices and masks for the step."""
        self._slot_mapping = metadata.slot_mapping
        if self.deterministic:
            self._plan_rows(metadata)
            return
        starts = metadata.query_start_loc
        seq_lens = metadata.seq_lens
        size = metadata.block_size
        limits = metadata.kv_limits
        read_only = metadata.read_only
        if metadata.is_decode_only:
            decode_ids = list(range(metadata.num_seqs))
        else:
            query_lens = np.diff(starts)
            decode_ids = [
                i
                for i in range(metadata.num_seqs)
                if query_lens[i] == 1
                and (limits is None or limits[starts[i]] == seq_lens[i])
                and (read_only is None or not read_only[i])
            ]
        self._all_decode = len(decode_ids) == metadata.num_tokens
        self._prefills = []
        self._decode_rows = None
        self._decode_blocks = None
        self._decode_mask = None
        staging = self._staging
        if decode_ids:
            lens = seq_lens[decode_ids]
            longest = int(lens.max())
            num_blocks = -(-longest // size)
            max_len = num_blocks * size
            self._decode_shape = (len(decode_ids), max_len)
            if not self._all_decode:
                self._decode_rows = torch.from_numpy(starts[decode_ids].astype(np.int64)).to(
                    self.device
                )
            if staging is not None and self._native_used:
                staging.deactivate()
            elif staging is not None and metadata.seq_keys is not None:
                keys = tuple(metadata.seq_keys[decode_ids].tolist())
                staging.plan(keys, lens, max_len, self.device)
                # Staged keys need no block rounding: equal lengths need no mask at all.
                self._staged_len = longest
                self._staged_mask = None
                if not (lens == longest).all():
                    self._staged_mask = _padding_mask(lens, longest, self.device)
            elif staging is not None:
                staging.deactivate()  # and break the append chain
            # Once decode rows go through the kernel, only its tables are needed.
            gathers = not self._native_used and (
                staging is None or not staging.active or staging.rebuild
            )
            if gathers or self._kernels is not None:
                tables = np.zeros((len(decode_ids), num_blocks), dtype=np.int64)
                for row, i in enumerate(decode_ids):
                    table = metadata.block_tables[i][:num_blocks]
                    tables[row, : len(table)] = table
                if self._kernels is not None:
                    self._native_tables = torch.from_numpy(tables)
                    self._native_lens = torch.from_numpy(lens.astype(np.int64))
            if gathers:
                # Whole blocks are gathered (large rows copy at memory speed); the tail of
                # each sequence's last block, and shorter sequences' padding, is masked.
                self._decode_blocks = torch.from_numpy(tables.reshape(-1)).to(self.device)
                if not (lens == max_len).all():
                    self._decode_mask = _padding_mask(lens, max_len, self.device)
        elif staging is not None:
            staging.deactivate()
        self._plan_chunks(metadata, set(decode_ids))

    def _plan_rows(self, metadata: AttentionMetadata) -> None:
        """Plan a deterministic step: each writing row on its own, read-only chunks as usual."""
        starts, seq_lens = metadata.query_start_loc, metadata.seq_lens
        limits, read_only = metadata.kv_limits, metadata.read_only
        size = metadata.block_size
        writing = [
            i for i in range(metadata.num_seqs) if read_only is None or not bool(read_only[i])
        ]
        rows: list[np.ndarray] = []
        lens: list[np.ndarray] = []
        row_seqs: list[np.ndarray] = []
        for n, i in enumerate(writing):
            start, end, length = int(starts[i]), int(starts[i + 1]), int(seq_lens[i])
            rows.append(np.arange(start, end))
            # Each row's keys end at its limit (causal: its own position, included).
            lens.append(
                limits[start:end].astype(np.int64)
                if limits is not None
                else np.arange(length - (end - start), length, dtype=np.int64) + 1
            )
            row_seqs.append(np.full(end - start, n, dtype=np.int64))
        self._rows = self._decode_rows = None
        self._all_decode = False
        self._native_tables = self._native_lens = self._row_seqs = None
        if writing:
            row_lens = np.concatenate(lens)
            width = -(-int(row_lens.max()) // size)
            tables = np.zeros((len(writing), width), dtype=np.int64)
            for n, i in enumerate(writing):
                table = metadata.block_tables[i][:width]
                tables[n, : len(table)] = table
            self._rows = torch.from_numpy(np.concatenate(rows)).to(self.device)
            self._native_tables = torch.from_numpy(tables)
            self._native_lens = torch.from_numpy(row_lens)
            self._row_seqs = torch.from_numpy(np.concatenate(row_seqs))
            # One writing row per sequence, each seeing all its keys: the native decode step
            # (`native_decode`) computes the same rows.
            self._all_decode = len(row_lens) == metadata.num_tokens == len(writing) and bool(
                (row_lens == seq_lens[writing]).all()
            )
        self._plan_chunks(metadata, set(writing))

    def _plan_native_prefill(self, block_size: int) -> None:
        """Gather the writing chunks' rows, tables and key counts for one `prefill_attention`
        call (their keys are in the cache once the step's are written).

        `forward` takes them in float32 (where the kernel ran 1.0-1.7x faster than torch's
        causal attention on one thread and 1.1-2.6x with a mask) and in bfloat16 (tile
        products on AMX, `prefill_uses_amx`; on AVX2 1.3-1.4x faster than torch's causal
        attention at 1,536 keys, as fast as float32).
        """
        self._native_writing = None
        writing = [c for c in self._prefills if not c.is_read_only]
        if self._kernels is not None and not self.deterministic and writing:
            self._native_writing = _native_chunks(writing, block_size, self.device)

    def _plan_chunks(self, metadata: AttentionMetadata, skip: set[int]) -> None:
        """Plan the prefill chunks of the sequences not in `skip`."""
        starts, seq_lens = metadata.query_start_loc, metadata.seq_lens
        limits, read_only = metadata.kv_limits, metadata.read_only
        size = metadata.block_size
        self._prefills = []
        groups: dict[tuple[int, int, bool], list[int]] = {}
        for i in range(metadata.num_seqs):
            if i in skip:
                continue
            start, end = int(starts[i]), int(starts[i + 1])
            length = int(seq_lens[i])
            is_read_only = read_only is not None and bool(read_only[i])
            # A read-only chunk's own keys are the step's rows, not the cache's.
            num_cached = length - (end - start) if is_read_only else length
            if limits is not None and bool((limits[start:end] == length).all()):
                # Every query sees every key (a bidirectional chunk over its context): no
                # mask at all, and chunks of one shape attend as one batch.
                groups.setdefault((end - start, length, is_read_only), []).append(i)
                continue
            if limits is not None:
                row_limits = limits[start:end].astype(np.int64)
            else:
                row_limits = np.arange(length - (end - start), length, dtype=np.int64) + 1
            plain_causal = limits is None and end - start == length
            self._prefills.append(
                _Chunk(
                    start,
                    end,
                    metadata.block_tables[i],
                    length,
                    row_limits,
                    is_read_only,
                    plain_causal,
                )
            )
        self._plan_native_prefill(size)
        self._groups = []
        stages: dict[tuple[int, ...], _GroupStage] = {}
        for (q_len, length, is_read_only), members in groups.items():
            num_cached = length - q_len if is_read_only else length
            # Keys already staged from the last step: a written group staged what it held
            # before this step's rows; a read-only one its (unchanged) context.
            prior = length - q_len
            stage = None
            if self._chunk_staging and metadata.seq_keys is not None:
                keys = tuple(metadata.seq_keys[members].tolist())
                stage = self._stages.get(keys)
                if stage is None or stage.is_read_only != is_read_only:
                    stage = _GroupStage(is_read_only)
                stage.plan(
                    prior,
                    length,
                    len(members) * length * self._staged_row_bytes <= self._stage_budget_bytes,
                )
                stages[keys] = stage
                if not stage.is_active:
                    stage = None
                elif not stage.rebuild:
                    self.num_staged_groups += 1
            # Continued copies read nothing from the cache; new ones (and gathers) read all its
            # keys.
            if stage is None or stage.rebuild:
                slots = np.concatenate(
                    [_slots_of(metadata.block_tables[i], num_cached, size) for i in members]
                )
            else:
                slots = np.zeros(0, dtype=np.int64)
            rows = np.concatenate([np.arange(starts[i], starts[i] + q_len) for i in members])
            self._groups.append(
                _Group(
                    len(members),
                    q_len,
                    torch.from_numpy(rows).to(self.device),
                    torch.from_numpy(slots).to(self.device),
                    is_read_only,
                    int(starts[members[0]]) if _is_contiguous(starts, members, q_len) else None,
                    stage,
                    length,
                )
            )
        self._stages = stages  # groups absent from this step lose their staging

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
        if self._kernels is not None and _fits_native(k, k_cache) and _fits_native(v, v_cache):
            # Row copies in one native pass (index_copy_ takes 2-5x as long for a prompt's rows)
            self._kernels.write_kv(k_cache, v_cache, self._slot_mapping, k, v)
            k_flat = k_cache.view(-1, *k_cache.shape[-2:])
            v_flat = v_cache.view(-1, *v_cache.shape[-2:])
        else:
            k_flat, v_flat = write_kv(kv_cache, self._slot_mapping, k, v)
        if k_cache.data_ptr() not in self._layers_seen:
            self._layers_seen.add(k_cache.data_ptr())
            self._staged_row_bytes = (
                2 * len(self._layers_seen) * k_cache[0, 0].numel() * k_cache.element_size()
            )
        gqa = q.shape[1] != k_cache.shape[-2]
        if self.deterministic:
            if self._all_decode:
                return self._attend_rows(q, k_cache, v_cache, scale)
            out = torch.empty_like(q)
            if self._rows is not None:
                out[self._rows] = self._attend_rows(q[self._rows], k_cache, v_cache, scale)
        elif self._all_decode:
            return self._decode(q, k, v, k_cache, v_cache, scale)
        else:
            out = torch.empty_like(q)
        rows = self._decode_rows
        if rows is not None:
            out[rows] = self._decode(q[rows], k[rows], v[rows], k_cache, v_cache, scale)
        # The writing chunks in one call, keys read in place (see the module notes).
        native = None
        if self._native_writing is not None and _fits_native(q, k_cache):
            native = self._native_writing
        if native is not None:
            assert self._kernels is not None
            span, tables, seqs, lens = native
            attended = self._kernels.prefill_attention(
                q[span] if isinstance(span, slice) else q.index_select(0, span),
                k_cache,
                v_cache,
                tables,
                seqs,
                lens,
                scale,
            )
            if isinstance(span, slice) and span.stop - span.start == q.shape[0]:
                return cast(torch.Tensor, attended)  # every row of the step: nothing else to do
            out[span] = attended
        size = k_cache.shape[1]
        for chunk in self._prefills:
            if native is not None and not chunk.is_read_only:
                continue
            start, end = chunk.start, chunk.end
            qs = q[start:end].transpose(0, 1).unsqueeze(0)
            slots = chunk.key_slots(size, self.device)
            ks = self._gather(k_flat, slots, 0)
            vs = self._gather(v_flat, slots, 1)
            if chunk.is_read_only:
                ks = torch.cat([ks, k[start:end]])
                vs = torch.cat([vs, v[start:end]])
            mask = chunk.mask(ks.shape[0], self.device)
            o = F.scaled_dot_product_attention(
                qs,
                ks.transpose(0, 1).unsqueeze(0),
                vs.transpose(0, 1).unsqueeze(0),
                attn_mask=mask,
                is_causal=mask is None,
                scale=scale,
                enable_gqa=gqa,
            )
            out[start:end] = o[0].transpose(0, 1)
        for group in self._groups:
            n, q_len = group.num_chunks, group.q_len
            heads, kv_heads, dim = q.shape[1], k.shape[1], q.shape[2]
            if group.row_start is not None:
                lo = group.row_start
                qs, k_own, v_own = (
                    q[lo : lo + n * q_len],
                    k[lo : lo + n * q_len],
                    v[lo : lo + n * q_len],
                )
            else:
                qs, k_own, v_own = q[group.rows], k[group.rows], v[group.rows]
            stage = group.stage
            if stage is not None:
                ks, vs = stage.keys_values(k_cache, k_flat, v_flat, group, k_own, v_own)
            else:
                ks = self._gather(k_flat, group.key_slots, 0).view(n, -1, kv_heads, dim)
                vs = self._gather(v_flat, group.key_slots, 1).view(n, -1, kv_heads, dim)
                if group.is_read_only:
                    ks = torch.cat([ks, k_own.view(n, q_len, kv_heads, dim)], dim=1)
                    vs = torch.cat([vs, v_own.view(n, q_len, kv_heads, dim)], dim=1)
                ks, vs = ks.transpose(1, 2), vs.transpose(1, 2)
            o = (
                F.scaled_dot_product_attention(
                    qs.view(n, q_len, heads, dim).transpose(1, 2),
                    ks,
                    vs,
                    scale=scale,
                    enable_gqa=gqa,
                )
                .transpose(1, 2)
                .reshape(n * q_len, heads, dim)
            )
            if group.row_start is not None:
                out[group.row_start : group.row_start + n * q_len] = o
            else:
                out[group.rows] = o
        return out

    def _attend_rows(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float
    ) -> torch.Tensor:
        """Attend each deterministic row on its own: through the prefill kernel where it fits
        (a row's sums do not depend on the rows sharing its tile), else one row at a time
        through torch."""
        tables, lens, seqs = self._native_tables, self._native_lens, self._row_seqs
        assert tables is not None and lens is not None and seqs is not None
        if self._kernels is not None and _fits_native(q, k_cache):
            attend = self._kernels.prefill_attention
            return cast(torch.Tensor, attend(q, k_cache, v_cache, tables, seqs, lens, scale))
        block_size, kv_heads = k_cache.shape[1], k_cache.shape[-2]
        out = torch.empty_like(q)
        for row in range(q.shape[0]):
            length = int(lens[row])
            blocks = tables[int(seqs[row]), : -(-length // block_size)].to(self.device)
            keys = k_cache.index_select(0, blocks).flatten(0, 1)[:length]
            values = v_cache.index_select(0, blocks).flatten(0, 1)[:length]
            group = q.shape[1] // kv_heads
            o = F.scaled_dot_product_attention(
                q[row].view(kv_heads, group, -1).unsqueeze(0),
                keys.transpose(0, 1).unsqueeze(0),
                values.transpose(0, 1).unsqueeze(0),
                scale=scale,
            )
            out[row] = o[0].reshape(q.shape[1], -1)
        return out

    def native_decode(
        self, k_cache: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """Return the step's `(slots, block tables, lengths)` where the native kernel takes all of
        it.

        For a model that runs whole decoder layers in native calls (`cpu_kernels.cpp`'s
        `decode_layer`, `DecodeStack`): it writes the keys and values and attends itself, as
        `forward` would
        through the kernel. None unless every row of the planned step decodes and the kernel
        takes caches like `k_cache`; then the model calls `forward` as usual.
        """
        if (
            not self._all_decode
            or self._kernels is None
            or self._native_tables is None
            or self._slot_mapping is None
            or k_cache.dtype not in _NATIVE_DTYPES
            or k_cache.shape[-1] not in _NATIVE_HEAD_DIMS
            or not k_cache.is_contiguous()
        ):
            return None
        self._use_native()
        assert self._native_lens is not None
        return self._slot_mapping.contiguous(), self._native_tables, self._native_lens

    def _use_native(self) -> None:
        """Mark decode rows as going through the kernel: nothing is staged from now on."""
        if self._staging is not None and not self._native_used:
            self._staging.deactivate()
        self._native_used = True

    def _decode(
        self,
        q: torch.Tensor,
        k_new: torch.Tensor,
        v_new: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        kernels = self._kernels
        if kernels is not None and _fits_native(q, k_cache):
            self._use_native()  # keys and values read in place through the block tables
            return kernels.decode_attention(
                q, k_cache, v_cache, self._native_tables, self._native_lens, scale
            )
        if self._native_used:  # a layer the kernel does not take, after ones it did (no staging)
            self._native_used = False
            assert self._native_tables is not None and self._native_lens is not None
            self._decode_blocks = self._native_tables.reshape(-1)
            width = self._native_tables.shape[1] * k_cache.shape[1]
            lens = self._native_lens.numpy()
            self._decode_mask = (
                None if (lens == width).all() else _padding_mask(lens, width, self.device)
            )
        batch, max_len = self._decode_shape
        num_kv_heads, head_dim = k_cache.shape[-2], k_cache.shape[-1]
        shape = (batch, max_len, num_kv_heads, head_dim)
        staging = self._staging
        if staging is not None and staging.active:
            k_stage, v_stage = staging.layer_buffers(k_cache, batch)
            if staging.rebuild:
                assert self._decode_blocks is not None
                ks = k_cache.index_select(0, self._decode_blocks).view(shape)
                vs = v_cache.index_select(0, self._decode_blocks).view(shape)
                k_stage[:batch, :, :max_len].copy_(ks.transpose(1, 2))
                v_stage[:batch, :, :max_len].copy_(vs.transpose(1, 2))
            else:
                # Append this step's token; the paged cache has it too.
                staging.append(k_stage, k_new, batch)
                staging.append(v_stage, v_new, batch)
            keys = k_stage[:batch, :, : self._staged_len]
            values = v_stage[:batch, :, : self._staged_len]
            mask = self._staged_mask
        else:
            assert self._decode_blocks is not None
            keys = k_cache.index_select(0, self._decode_blocks).view(shape).transpose(1, 2)
            values = v_cache.index_select(0, self._decode_blocks).view(shape).transpose(1, 2)
            mask = self._decode_mask
        if mask is not None and mask.dtype != keys.dtype:
            mask = mask.to(keys.dtype)
        # One query token per sequence: fold each KV head's group of query heads into the
        # query-length axis, so every K/V head is read once (no GQA expansion needed).
        num_heads = q.shape[1]
        group = num_heads // num_kv_heads
        o = F.scaled_dot_product_attention(
            q.reshape(batch, num_kv_heads, group, head_dim).to(keys.dtype),
            keys,
            values,
            attn_mask=mask,
            scale=scale,
        )
        return o.reshape(batch, num_heads, head_dim).to(q.dtype)
