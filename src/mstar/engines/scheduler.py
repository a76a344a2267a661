"""Continuous batching: pick each step's tokens from running and waiting sequences.

Pure and synchronous (no tensors, no IO): `schedule()` returns a `SchedulerOutput`, the
model runner executes it, and `update_from_output()` applies the sampled tokens.

Each step first serves running sequences in arrival order (one token for a decode, a
chunk for an unfinished prefill), then admits waiting ones, all under a token budget.
When the cache cannot take a running sequence's next tokens, the most recently arrived
running sequence is preempted by recompute: its blocks are freed and it waits again with
its tokens (prompt and outputs so far), to be prefilled from scratch later; since sampling
only ever happens at the end of a sequence, the outputs are the same as without preemption.
Pinned sequences (payload inputs, or read by queries) cannot be recomputed and are never
preempted or evicted; a pinned sequence that finds no room waits for the next step, and one
that declares `reserve_tokens` is admitted only once all its blocks can be held back.
Read-only queries are scheduled whole, take no blocks and end after their one step.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from mstar.engines.block_manager import BlockManager
from mstar.engines.sequence import FinishReason, Sequence, SequenceStatus

if TYPE_CHECKING:
    import torch

__all__ = ["BatchScheduler", "RequestOutput", "ScheduledSequence", "SchedulerOutput"]


@dataclass(slots=True)
class ScheduledSequence:
    """One sequence's share of a step: tokens `[start, start + num_tokens)`."""

    seq: Sequence
    start: int
    num_tokens: int

    @property
    def completes(self) -> bool:
        """Whether this chunk reaches the end of the sequence (its walk's inputs are done)."""
        return self.start + self.num_tokens == self.seq.num_tokens

    @property
    def samples(self) -> bool:
        """Whether a token is sampled after this chunk."""
        return self.completes and self.seq.output_mode == "sample"

    @property
    def returns_hidden(self) -> bool:
        """Whether this chunk's rows are returned: a walk in "hidden" mode, or a sampling walk
        that wants its inputs' rows (`Sequence.rows_wanted`); either is never split."""
        return self.completes and (self.seq.output_mode == "hidden" or self.seq.rows_wanted)


@dataclass(slots=True)
class SchedulerOutput:
    """What one step computes."""

    scheduled: list[ScheduledSequence] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    preempted_ids: list[str] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        """Count the tokens computed in this step."""
        return sum(s.num_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        """Whether nothing is scheduled."""
        return not self.scheduled


@dataclass(frozen=True, slots=True)
class RequestOutput:
    """Tokens a step produced for one request, and whether its walk ended."""

    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: FinishReason | None = None
    logits: torch.Tensor | None = None  # raw logits of the sampled step, when asked for
    hidden: torch.Tensor | None = None  # the walk's rows `[new tokens, ...]` ("hidden" mode)
    error: BaseException | None = None  # the sequence failed alone in this step (and was dropped)


class BatchScheduler:
    """Decide every step's batch; own sequence states (waiting, running, paused)."""

    def __init__(
        self, block_manager: BlockManager, *, max_num_seqs: int, max_num_batched_tokens: int
    ) -> None:
        """Create a scheduler over `block_manager` with per-step limits."""
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.paused: dict[str, Sequence] = {}
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        """Queue a sequence (new, resumed or forked) to run."""
        if seq.num_computed_tokens > 0 or seq.block_table:
            # Resumed/forked sequences keep their blocks: run them with the others.
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            self.running.sort(key=lambda s: s.arrival)
        else:
            seq.status = SequenceStatus.WAITING
            self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        """Whether any sequence is waiting or running (paused ones are not counted)."""
        return bool(self.waiting or self.running)

    def remove(self, seq: Sequence) -> None:
        """Take `seq` out of the scheduler and free its blocks (abort or release)."""
        if seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        elif seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.PAUSED:
            del self.paused[seq.request_id]
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED

    def schedule(self) -> SchedulerOutput:
        """Pick this step's chunks, allocating blocks and preempting when they run out."""
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        bm = self.block_manager
        scheduled_ids: set[int] = set()
        for seq in list(self.running):
            if budget <= 0:
                break
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted earlier in this loop
            # May exceed the budget for a segment that cannot be cut (full/block masks).
            num_tokens = seq.max_chunk(budget)
            if seq.is_read_only:
                out.scheduled.append(ScheduledSequence(seq, seq.num_computed_tokens, num_tokens))
                budget -= num_tokens
                continue
            if not self._make_room(seq, num_tokens, scheduled_ids, out):
                continue  # `seq` itself was preempted, or is pinned and waits
            out.block_copies.extend(bm.append(seq, num_tokens))
            out.scheduled.append(ScheduledSequence(seq, seq.num_computed_tokens, num_tokens))
            scheduled_ids.add(id(seq))
            budget -= num_tokens
        # Admit waiting sequences (new or preempted) while there is room.
        prompt_work = any(s.num_tokens > 1 for s in out.scheduled)
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            bm.allocate_cached_prefix(seq)
            num_tokens = seq.max_chunk(budget)
            if prompt_work and num_tokens < seq.max_chunk(self.max_num_batched_tokens):
                # A step's time grows with its tokens: a cut first chunk beside other prompt
                # work would only delay their first tokens; next step takes it whole.
                bm.free(seq)
                break
            while not self._fits(seq, num_tokens) and not self.running and self._has_evictable():
                # Nothing runs, so only idle paused sequences can give blocks back.
                self._evict_paused(out)
            if not self._fits(seq, num_tokens):
                bm.free(seq)
                break
            self.waiting.popleft()
            if seq.reserve_tokens:
                bm.reserve(seq, seq.reserve_tokens)
            out.block_copies.extend(bm.append(seq, num_tokens))
            out.scheduled.append(ScheduledSequence(seq, seq.num_computed_tokens, num_tokens))
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            budget -= num_tokens
            prompt_work = prompt_work or num_tokens > 1
        return out

    def _make_room(
        self, seq: Sequence, num_tokens: int, scheduled_ids: set[int], out: SchedulerOutput
    ) -> bool:
        """Free blocks until `seq` can take `num_tokens`; False if `seq` was preempted.

        Idle paused sequences go first (oldest first), then running ones that are not in
        this step's batch (latest arrival first), and finally `seq` itself.
        """
        bm = self.block_manager
        while not bm.can_append(seq, num_tokens):
            if self._has_evictable():
                self._evict_paused(out)
                continue
            victim = next(
                (
                    s
                    for s in reversed(self.running)
                    if id(s) not in scheduled_ids and not s.is_pinned and not s.is_read_only
                ),
                None,
            )
            if victim is None:
                return False  # only pinned sequences hold blocks: `seq` (pinned) waits a step
            self._preempt(victim, out)
            if victim is seq:
                return False
        return True

    def _fits(self, seq: Sequence, num_tokens: int) -> bool:
        """Whether a waiting sequence can be admitted now (with its reservation, if any)."""
        bm = self.block_manager
        if seq.reserve_tokens:
            return bm.can_reserve(
                seq, max(seq.reserve_tokens, seq.num_computed_tokens + num_tokens)
            )
        return bm.can_append(seq, num_tokens)

    def _has_evictable(self) -> bool:
        return any(p.block_table and not p.is_pinned for p in self.paused.values())

    def _evict_paused(self, out: SchedulerOutput) -> None:
        victim = next(p for p in self.paused.values() if p.block_table and not p.is_pinned)
        self.block_manager.free(victim)
        out.preempted_ids.append(victim.request_id)
        self.num_preemptions += 1

    def update_from_output(
        self,
        out: SchedulerOutput,
        sampled_token_ids: list[int],
        hidden: list[torch.Tensor] | None = None,
    ) -> list[RequestOutput]:
        """Advance the scheduled sequences; append sampled tokens and apply stop rules.

        `sampled_token_ids` holds one token per scheduled chunk that `samples`, in order;
        `hidden` the rows of each chunk that `returns_hidden`, in order. A walk that samples
        nothing ends once its inputs are computed (`FinishReason.COMPUTED`).
        """
        outputs: list[RequestOutput] = []
        samples = iter(sampled_token_ids)
        rows = iter(hidden or ())
        for item in out.scheduled:
            seq = item.seq
            if seq.is_read_only:
                self.running.remove(seq)
                self.block_manager.free(seq)  # its hold on the parent's blocks
                seq.status = SequenceStatus.FINISHED
                outputs.append(
                    RequestOutput(
                        seq.request_id, [], True, FinishReason.COMPUTED, hidden=next(rows)
                    )
                )
                continue
            seq.num_computed_tokens = item.start + item.num_tokens
            if not item.completes:
                continue
            if seq.output_mode == "sample":
                row = next(rows) if item.returns_hidden else None  # before the token lengthens it
                seq.rows_wanted = False
                token = next(samples)
                seq.token_ids.append(token)
                reason = self._finish_reason(seq, token)
                if reason is None:
                    outputs.append(RequestOutput(seq.request_id, [token], False, hidden=row))
                    continue
                outputs.append(RequestOutput(seq.request_id, [token], True, reason, hidden=row))
            else:
                row = next(rows) if seq.output_mode == "hidden" else None
                outputs.append(
                    RequestOutput(seq.request_id, [], True, FinishReason.COMPUTED, hidden=row)
                )
            self.running.remove(seq)
            if seq.keep_alive:
                seq.status = SequenceStatus.PAUSED
                self.paused[seq.request_id] = seq
            else:
                self.block_manager.free(seq)
                seq.status = SequenceStatus.FINISHED
        return outputs

    @staticmethod
    def _finish_reason(seq: Sequence, token: int) -> FinishReason | None:
        if token in seq.params.stop_token_ids:
            return FinishReason.STOP
        if seq.stop_check is not None and seq.stop_check(seq):
            return FinishReason.STOP_CHECK
        if seq.num_output_tokens >= seq.params.max_tokens:
            return FinishReason.LENGTH
        return None

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        out.preempted_ids.append(seq.request_id)
        self.num_preemptions += 1
