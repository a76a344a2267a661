"""All device work of a KV-cache engine: inputs, forward, block copies, sampling."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import cast

import numpy as np
import torch

from mstar.engines.attention.base import AttentionBackend, AttentionMetadata
from mstar.engines.cuda_graphs import CudaGraphDecodeRunner
from mstar.engines.interfaces import (
    PagedKVContext,
    PagedModel,
    StepChunk,
    StepInputs,
    SupportsGreedyTokens,
    SupportsNarrowLogits,
    supports_greedy_tokens,
    supports_narrow_logits,
    supports_step_chunks,
)
from mstar.engines.parallel import TensorParallelLeader
from mstar.engines.sampler import Sampler
from mstar.engines.scheduler import SchedulerOutput
from mstar.engines.sequence import Sequence, vocab_ranges
from mstar.engines.step_times import PhaseTimes

__all__ = ["ModelRunner", "PreparedBatch", "StepResult"]

_NO_STEP_INPUTS = StepInputs()


class StepResult:
    """What a step computed: sampled tokens, raw logits (when asked), returned rows."""

    __slots__ = ("hidden", "logits", "tokens")

    def __init__(
        self, tokens: list[int], logits: torch.Tensor | None, hidden: list[torch.Tensor]
    ) -> None:
        self.tokens = tokens  # one per chunk that samples, in order
        self.logits = logits  # `[sampled rows, vocab]` before any processing, or None
        self.hidden = hidden  # one `[rows, ...]` per chunk that returns its rows, in order


class PreparedBatch:
    """Host and device inputs of one step."""

    __slots__ = (
        "hidden_rows",
        "input_ids",
        "logits_indices",
        "metadata",
        "positions",
        "sample_seqs",
        "step",
    )

    def __init__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        metadata: AttentionMetadata,
        logits_indices: torch.Tensor,
        sample_seqs: list[Sequence],
        step: StepInputs | None = None,
        hidden_rows: list[tuple[int, int]] | None = None,
    ) -> None:
        self.input_ids = input_ids
        self.positions = positions
        self.metadata = metadata
        self.logits_indices = logits_indices
        self.sample_seqs = sample_seqs
        self.step = step  # None: plain token chunks of expert 0 (the decode fast path)
        self.hidden_rows = hidden_rows or []  # row ranges returned to "hidden" walks


class ModelRunner:
    """Run scheduled steps of a `PagedModel` over a paged cache on one device."""

    def __init__(
        self,
        model: PagedModel,
        kv_cache: torch.Tensor,
        backend: AttentionBackend,
        *,
        block_size: int,
        device: torch.device,
        sampler: Sampler | None = None,
        tensor_parallel: TensorParallelLeader | None = None,
    ) -> None:
        """Create a runner; `kv_cache` comes from `allocate_kv_cache`.

        With ``tensor_parallel``, `model` is the leader's shard of a tensor-parallel group: each
        step's block copies, forward pass and head calls go to the followers before they run
        here (see `mstar.engines.parallel`).
        """
        self.model = model
        # no decode fast path (see `SupportsStepChunks`)
        self._needs_chunks = supports_step_chunks(model)
        self._greedy_tokens = supports_greedy_tokens(model)
        self.kv_cache = kv_cache
        self.backend = backend
        self.block_size = block_size
        self.device = device
        self.sampler = sampler or Sampler()
        self.tensor_parallel = tensor_parallel
        self.sink_slot = (kv_cache.shape[2] - 1) * block_size
        self.ctx = PagedKVContext(backend, [(layer[0], layer[1]) for layer in kv_cache])
        self.cuda_graphs: CudaGraphDecodeRunner | None = None
        self.phases = PhaseTimes()
        # Called once per sampling step just before the logits projection: on a CPU the
        # step's longest kernel, which runs without the GIL (see `KVNodeEngine._steps`).
        self.before_logits: Callable[[], None] | None = None

    def enable_cuda_graphs(self, *, max_batch_size: int, max_len: int) -> None:
        """Capture decode CUDA graphs (CUDA only); decode steps then replay them."""
        if self.device.type != "cuda" or self.tensor_parallel is not None:
            return  # eager execution everywhere else (and for a tensor-parallel group's steps)
        graphs = CudaGraphDecodeRunner(
            self.model,
            self.ctx.kv_caches,
            max_batch_size=max_batch_size,
            max_len=max_len,
            block_size=self.block_size,
            sink_slot=self.sink_slot,
            device=self.device,
            flashinfer_workspace=self.backend.workspace,
        )
        graphs.capture()
        self.cuda_graphs = graphs

    def forward(self, batch: PreparedBatch) -> torch.Tensor:
        """Run a prepared step's forward pass; return the hidden states of its rows."""
        if self.tensor_parallel is not None:
            self.tensor_parallel.forward(
                batch.input_ids, batch.positions, batch.metadata, batch.step
            )
        graphs = self.cuda_graphs
        if graphs is not None and batch.step is None and graphs.can_run(batch.metadata):
            return graphs.run(batch.input_ids, batch.positions, batch.metadata)
        self.backend.plan(batch.metadata)
        self.ctx.step = batch.step if batch.step is not None else _NO_STEP_INPUTS
        return self.model(batch.input_ids, batch.positions, self.ctx)

    def prepare(self, out: SchedulerOutput) -> PreparedBatch:
        """Flatten the scheduled chunks into model inputs and attention metadata."""
        scheduled = out.scheduled
        # The decode fast path returns no rows: a walk that returns its rows (even one
        # token's) takes the general path, which also keeps it off the CUDA graphs (their
        # outputs are static buffers, overwritten by the next replay).
        if (
            scheduled
            and not self._needs_chunks
            and all(
                item.num_tokens == 1
                and item.start >= item.seq.segments_end
                and not item.seq.is_read_only
                and not item.returns_hidden
                for item in scheduled
            )
        ):
            return self._prepare_decode(out)
        size = self.block_size
        num_seqs = len(scheduled)
        query_start_loc = np.zeros(num_seqs + 1, dtype=np.int64)
        seq_lens = np.empty(num_seqs, dtype=np.int64)
        ids: list[int] = []
        positions_parts: list[np.ndarray] = []
        slot_parts: list[np.ndarray] = []
        block_tables: list[list[int]] = []
        logits_rows: list[int] = []
        hidden_rows: list[tuple[int, int]] = []
        sample_seqs: list[Sequence] = []
        chunks: list[StepChunk] = []
        has_masks = any(
            item.start < item.seq.segments_end or item.seq.is_read_only for item in scheduled
        )
        read_only = np.zeros(num_seqs, dtype=bool)
        limit_parts: list[np.ndarray] = []
        expert_parts: list[tuple[int, int, int]] = []
        total = 0
        for i, item in enumerate(scheduled):
            seq, start, n = item.seq, item.start, item.num_tokens
            end = start + n
            ids.extend(seq.token_ids[start:end])
            pos = np.arange(start, end, dtype=np.int64)
            positions_parts.append(pos)
            if seq.is_read_only:
                read_only[i] = True
                slot_parts.append(np.full(n, self.sink_slot, dtype=np.int64))
            else:
                table = np.asarray(seq.block_table, dtype=np.int64)
                slot_parts.append(table[pos // size] * size + pos % size)
            block_tables.append(seq.block_table)
            if has_masks:
                if start < seq.segments_end:
                    limit_parts.append(seq.kv_limits(start, end))
                else:
                    limit_parts.append(pos + 1)
            segment = seq.input_segment_at(start)
            payload, expert = (None, 0) if segment is None else (segment.payload, segment.expert)
            chunks.append(
                StepChunk(
                    seq.request_id, total, total + n, start, payload, expert, seq.is_read_only
                )
            )
            if expert:
                expert_parts.append((total, total + n, expert))
            total += n
            query_start_loc[i + 1] = total
            seq_lens[i] = end
            if item.samples:
                logits_rows.append(total - 1)
                sample_seqs.append(seq)
            if item.returns_hidden:
                hidden_rows.append((total - n, total))
        positions = np.concatenate(positions_parts)
        metadata = AttentionMetadata(
            num_tokens=total,
            slot_mapping=torch.from_numpy(np.concatenate(slot_parts)).to(self.device),
            query_start_loc=query_start_loc,
            seq_lens=seq_lens,
            block_tables=block_tables,
            kv_limits=np.concatenate(limit_parts) if has_masks else None,
            block_size=size,
            seq_keys=np.fromiter((item.seq.arrival for item in scheduled), np.int64, num_seqs),
            read_only=read_only if read_only.any() else None,
        )
        expert_ids = None
        if expert_parts:
            experts = np.zeros(total, dtype=np.int64)
            for lo, hi, expert in expert_parts:
                experts[lo:hi] = expert
            expert_ids = torch.from_numpy(experts).to(self.device)
        return PreparedBatch(
            input_ids=torch.tensor(ids, dtype=torch.long, device=self.device),
            positions=torch.from_numpy(positions).to(self.device),
            metadata=metadata,
            logits_indices=torch.tensor(logits_rows, dtype=torch.long, device=self.device),
            sample_seqs=sample_seqs,
            step=StepInputs(chunks, expert_ids),
            hidden_rows=hidden_rows,
        )

    def _prepare_decode(self, out: SchedulerOutput) -> PreparedBatch:
        """`prepare` for a step of one causal token per sequence (plain decode), in bulk."""
        size = self.block_size
        scheduled = out.scheduled
        seqs = [item.seq for item in scheduled]
        positions = [item.start for item in scheduled]
        ids = [seq.token_ids[p] for seq, p in zip(seqs, positions, strict=True)]
        slots = [
            seq.block_table[p // size] * size + p % size
            for seq, p in zip(seqs, positions, strict=True)
        ]
        num_seqs = len(seqs)
        metadata = AttentionMetadata(
            num_tokens=num_seqs,
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=self.device),
            query_start_loc=np.arange(num_seqs + 1, dtype=np.int64),
            seq_lens=np.array(positions, dtype=np.int64) + 1,
            block_tables=[seq.block_table for seq in seqs],
            kv_limits=None,
            block_size=size,
            seq_keys=np.fromiter((seq.arrival for seq in seqs), np.int64, num_seqs),
        )
        rows = [i for i, item in enumerate(scheduled) if item.samples]
        return PreparedBatch(
            input_ids=torch.tensor(ids, dtype=torch.long, device=self.device),
            positions=torch.tensor(positions, dtype=torch.long, device=self.device),
            metadata=metadata,
            logits_indices=torch.tensor(rows, dtype=torch.long, device=self.device),
            sample_seqs=[seqs[i] for i in rows],
        )

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy whole blocks (all layers, K and V) for copy-on-write."""
        if not copies:
            return
        if self.tensor_parallel is not None:
            self.tensor_parallel.copy_blocks(copies)
        src = torch.tensor([c[0] for c in copies], dtype=torch.long, device=self.device)
        dst = torch.tensor([c[1] for c in copies], dtype=torch.long, device=self.device)
        self.kv_cache[:, :, dst] = self.kv_cache[:, :, src]

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, *, return_logits: bool = False) -> StepResult:
        """Run one step: copy blocks, prepare, forward, then sample or slice the returned rows.

        A tensor-parallel leader whose step raises closes its group: the ranks may be out of
        step (a collective one ran and the other did not), and no step of the group is safe
        after that (its ranks restart as a unit). A native call's error where the group's sums
        inside it found a rank's process gone (a decode step in one call) is raised as that
        rank's loss, as the group's own collectives raise it.
        """
        if self.tensor_parallel is None:
            return self._execute(out, return_logits)
        try:
            return self._execute(out, return_logits)
        except BaseException as exc:
            group = self.tensor_parallel.group
            lost = group.rank_lost(exc) if isinstance(exc, RuntimeError) else None
            self.tensor_parallel.abort()
            if lost is not None:
                raise lost from exc
            raise

    def _execute(self, out: SchedulerOutput, return_logits: bool) -> StepResult:
        phases = self.phases
        t0 = time.perf_counter()
        self.copy_blocks(out.block_copies)
        batch = self.prepare(out)
        t1 = time.perf_counter()
        phases.add("prepare", t1 - t0)
        hidden = self.forward(batch)
        t2 = time.perf_counter()
        phases.add("forward", t2 - t1)
        returned = [hidden[lo:hi] for lo, hi in batch.hidden_rows]
        if not batch.sample_seqs:
            return StepResult([], None, returned)
        result = self._sample(batch, hidden, return_logits)
        t3 = time.perf_counter()
        phases.add("logits", t3 - t2)
        if all(s.num_tokens == 1 and s.start > 0 for s in out.scheduled):
            keys = sum(s.start + 1 for s in out.scheduled)
            phases.add_decode(len(out.scheduled), keys, t3 - t0)
        result.hidden = returned
        return result

    def _sample(
        self, batch: PreparedBatch, hidden: torch.Tensor, return_logits: bool
    ) -> StepResult:
        seqs = batch.sample_seqs
        rows = hidden.index_select(0, batch.logits_indices)
        if self.before_logits is not None:
            self.before_logits()
        plain = (
            [i for i, s in enumerate(seqs) if _is_plain_greedy(s)]
            if self._greedy_tokens and not return_logits
            else []
        )
        # Plain greedy rows take the model's greedy head when the whole step is greedy; in a
        # deterministic engine always (it decides each row as alone), whatever the others do.
        if plain and (len(plain) == len(seqs) or self.sampler.deterministic):
            picked = self._greedy_rows(rows, seqs, plain)
            if picked is not None:
                return StepResult(picked, None, [])
        if return_logits:
            logits = self._logits(rows)
            raw = logits.clone()
            tokens = self.sampler(logits, seqs)
            return StepResult([int(t) for t in tokens.tolist()], raw, [])
        return StepResult(self._sample_rows(rows, seqs), None, [])

    def _greedy_rows(
        self, rows: torch.Tensor, seqs: list[Sequence], plain: list[int]
    ) -> list[int] | None:
        """The step's tokens with rows `plain` from the model's greedy head (the rest sampled),
        or None where the head does not decide them."""
        if len(plain) == len(seqs):
            greedy = self._greedy(rows)
            return None if greedy is None else [int(t) for t in greedy.tolist()]
        greedy = self._greedy(rows[plain])
        if greedy is None:
            return None
        rest = sorted(set(range(len(seqs))) - set(plain))
        tokens = [0] * len(seqs)
        for i, token in zip(plain, greedy.tolist(), strict=True):
            tokens[i] = int(token)
        for i, token in zip(
            rest, self._sample_rows(rows[rest], [seqs[i] for i in rest]), strict=True
        ):
            tokens[i] = token
        return tokens

    def _sample_rows(self, rows: torch.Tensor, seqs: list[Sequence]) -> list[int]:
        """Project `rows` to logits (only onto the ids they may take, where every row's
        processor names them) and sample each one's token."""
        ranges = [vocab_ranges(s.logits_processor, s.token_ids) for s in seqs]
        if supports_narrow_logits(self.model) and all(r is not None for r in ranges):
            # Constrained rows: project onto the ids they may take only (the rest is -inf).
            logits = self._logits(rows, cast(list[list[tuple[int, int]]], ranges))
        else:
            logits = self._logits(rows)
        return [int(t) for t in self.sampler(logits, seqs, ranges).tolist()]

    # The model's head calls, told to a tensor-parallel group's followers first.

    def _greedy(self, rows: torch.Tensor) -> torch.Tensor | None:
        if self.tensor_parallel is not None:
            self.tensor_parallel.head("greedy", rows)
        return cast(SupportsGreedyTokens, self.model).greedy_tokens(rows)

    def _logits(
        self, rows: torch.Tensor, ranges: list[list[tuple[int, int]]] | None = None
    ) -> torch.Tensor:
        if self.tensor_parallel is not None:
            self.tensor_parallel.head("logits" if ranges is None else "logits_in", rows, ranges)
        if ranges is None:
            return self.model.compute_logits(rows)
        return cast(SupportsNarrowLogits, self.model).compute_logits_in(rows, ranges)


def _is_plain_greedy(seq: Sequence) -> bool:
    """Whether a row's token is the argmax of its raw logits (nothing else touches them)."""
    params = seq.params
    return (
        params.is_greedy
        and seq.logits_processor is None
        and params.repetition_penalty == 1.0
        and not params.has_penalties
        and params.logprobs is None
    )
