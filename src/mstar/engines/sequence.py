"""One request's token sequence inside a KV-cache engine: pure bookkeeping, no tensors."""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Literal, Protocol, TypeGuard

import numpy as np

from mstar.engines.masks import AttentionMask, MaskSegment
from mstar.engines.sampling_params import SamplingParams

if TYPE_CHECKING:
    import torch

    from mstar.engines.sampler import TokenLogprobs

__all__ = [
    "FinishReason",
    "InputSegment",
    "LogitsProcessor",
    "OutputMode",
    "Sequence",
    "SequenceStatus",
    "StopCheck",
    "vocab_ranges",
]

OutputMode = Literal["sample", "hidden", "none"]
"""What a walk of a sequence returns: a sampled token per step ("sample"), the model's rows
for the walk's new tokens once they are computed ("hidden", never split over steps), or
nothing (a prefill whose only product is the cache, "none")."""

PLACEHOLDER_TOKEN = 0
"""The id that stands in `token_ids` for a position whose input is a payload, not a token."""


@dataclass(frozen=True, slots=True)
class InputSegment:
    """Positions `[start, end)` of a sequence whose input is not a plain token of expert 0.

    Attributes:
        start: First position.
        end: Position after the last.
        payload: What the model embeds for these positions instead of token ids (image
            patches, latents, action tokens...), opaque to the engine; None: token ids.
        expert: Which of the model's weight sets runs these positions (0: the default).
    """

    start: int
    end: int
    payload: Any = None
    expert: int = 0


LogitsProcessor = Callable[[list[int], "torch.Tensor"], "torch.Tensor"]
"""Called per step as `processor(token_ids, logits) -> logits` with the row of one request.

`token_ids` are all of the sequence's tokens so far (prompt and generated); `logits` is a
1-D tensor over the vocabulary. Return it modified (in place or new), e.g. with `-inf` at
the tokens forbidden at this position (constrained decoding)."""


class NarrowingLogitsProcessor(Protocol):
    """A logits processor that names, per position, the only ids it can leave finite.

    Declares ``narrows_vocab = True``; `vocab_ranges` returns ``[(start, end), ...]`` (sorted,
    disjoint, half-open) for the next position (constrained decoding allows a few thousand of
    a large vocabulary). The model then computes logits for those ids only, and the sampler
    draws among them.
    """

    narrows_vocab: ClassVar[Literal[True]]

    def __call__(self, token_ids: list[int], logits: Any) -> Any: ...

    def vocab_ranges(self, token_ids: list[int]) -> list[tuple[int, int]]: ...


def supports_vocab_ranges(processor: object) -> TypeGuard[NarrowingLogitsProcessor]:
    """Whether a logits processor declares `NarrowingLogitsProcessor`."""
    return getattr(processor, "narrows_vocab", False) is True


def vocab_ranges(
    processor: LogitsProcessor | None, token_ids: list[int]
) -> list[tuple[int, int]] | None:
    """Return the id ranges outside which `processor` sets every logit to `-inf`, where it
    declares them (`NarrowingLogitsProcessor`); None: no promise."""
    return list(processor.vocab_ranges(token_ids)) if supports_vocab_ranges(processor) else None


StopCheck = Callable[["Sequence"], bool]
"""Called after each sampled token as `stop_check(sequence) -> bool`; True ends the walk
(a `DynamicLoop`'s per-request stop condition)."""


class SequenceStatus(enum.Enum):
    """Where a sequence is in its life."""

    WAITING = "waiting"  # queued, owns no blocks (new, or preempted and to be recomputed)
    RUNNING = "running"  # scheduled every step, owns blocks
    PAUSED = "paused"  # its walk finished; keeps its blocks for the request's next walk
    FINISHED = "finished"  # released; owns no blocks


class FinishReason(enum.StrEnum):
    """Why a walk ended."""

    STOP = "stop"  # a stop token was sampled
    LENGTH = "length"  # max_tokens were generated
    STOP_CHECK = "stop_check"  # the request's stop check returned True
    ABORT = "abort"  # the request was aborted
    COMPUTED = "computed"  # the walk's inputs are in the cache (a walk that samples nothing)


class Sequence:
    """Tokens, progress and block table of one request (or one fork or query of it).

    `token_ids[:num_computed_tokens]` have their K/V in the cache; the rest are inputs
    of the next steps. After a token is sampled it is appended and computed next step.
    Positions whose input is a payload (embeddings the model makes from data) or runs
    through another expert are described by `input_segments` (their ids are placeholders);
    positions with a non-causal mask by `mask_segments`.

    A *read-only* sequence is a query: it sees its parent's cached tokens and its own new
    ones, and writes nothing to the cache; it lives for one step.
    """

    __slots__ = (
        "arrival",
        "block_table",
        "generator",
        "input_segments",
        "inputs_start",
        "is_pinned",
        "is_read_only",
        "keep_alive",
        "logits_processor",
        "logprobs",
        "mask_segments",
        "num_computed_tokens",
        "output_mode",
        "params",
        "request_id",
        "reserve_tokens",
        "reserved_blocks",
        "rows_wanted",
        "segments_end",
        "status",
        "stop_check",
        "token_ids",
        "walk_start",
    )

    def __init__(
        self,
        request_id: str,
        token_ids: list[int],
        params: SamplingParams,
        *,
        arrival: int,
        mask: AttentionMask | None = None,
        keep_alive: bool = False,
        logits_processor: LogitsProcessor | None = None,
        stop_check: StopCheck | None = None,
        generator: torch.Generator | None = None,
    ) -> None:
        self.request_id = request_id
        self.token_ids = list(token_ids)
        self.params = params
        self.arrival = arrival
        self.keep_alive = keep_alive
        self.logits_processor = logits_processor
        self.stop_check = stop_check
        self.generator = generator
        self.num_computed_tokens = 0
        self.block_table: list[int] = []
        self.status = SequenceStatus.WAITING
        self.mask_segments: list[MaskSegment] = []
        self.input_segments: list[InputSegment] = []
        self.segments_end = 0  # no segment reaches past this position
        self.walk_start = len(self.token_ids)
        self.inputs_start = 0  # first position of the current walk's new inputs
        self.output_mode: OutputMode = "sample"
        # A sampling walk that also returns its inputs' rows, with its first token (computed
        # in one chunk, as a "hidden" walk's): the current walk has not returned them yet.
        self.rows_wanted = False
        # Pinned: its cache cannot be rebuilt from token ids (payload inputs) or is read by
        # queries, so it is never preempted or evicted.
        self.is_pinned = False
        self.is_read_only = False
        self.reserve_tokens = 0  # admit only once blocks for this many tokens can be held back
        self.reserved_blocks = 0  # blocks held back for this sequence (`BlockManager.reserve`)
        # Log-probabilities of sampled tokens not yet handed out (when the params ask for them).
        self.logprobs: list[TokenLogprobs] = []
        if mask is not None and not mask.is_causal:
            self._add_mask(MaskSegment(0, len(self.token_ids), mask))

    @property
    def num_tokens(self) -> int:
        """Count the tokens in the sequence (computed or not)."""
        return len(self.token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        """Count the tokens whose K/V are not in the cache yet."""
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def output_token_ids(self) -> list[int]:
        """Return the tokens generated in the current walk."""
        return self.token_ids[self.walk_start :]

    @property
    def num_output_tokens(self) -> int:
        """Count the tokens generated in the current walk."""
        return len(self.token_ids) - self.walk_start

    @property
    def is_prefix_cacheable(self) -> bool:
        """Whether full blocks of this sequence may be shared by token hash.

        Non-causal segments make a block's K/V depend on later tokens, and payloads or
        other experts make it depend on more than the token ids, so those sequences keep
        their blocks private (forks still share them).
        """
        return not (self.mask_segments or self.input_segments)

    def extend(
        self,
        token_ids: list[int],
        mask: AttentionMask | None,
        *,
        payload: Any = None,
        expert: int = 0,
    ) -> None:
        """Append inputs for a new walk (they start uncomputed).

        With a `payload`, `token_ids` are placeholders for its positions (one each).
        """
        start = len(self.token_ids)
        self.token_ids.extend(token_ids)
        end = len(self.token_ids)
        self.inputs_start = start
        if token_ids:
            if mask is not None and not mask.is_causal:
                self._add_mask(MaskSegment(start, end, mask))
            if payload is not None or expert != 0:
                self.input_segments.append(InputSegment(start, end, payload, expert))
                self.segments_end = max(self.segments_end, end)
        self.walk_start = end

    def inherit_segments(self, parent: Sequence) -> None:
        """Take `parent`'s mask and input segments (a fork or a query of it)."""
        self.mask_segments = list(parent.mask_segments)
        self.input_segments = list(parent.input_segments)
        self.segments_end = parent.segments_end

    def _add_mask(self, segment: MaskSegment) -> None:
        self.mask_segments.append(segment)
        self.segments_end = max(self.segments_end, segment.end)

    def truncate(self, num_tokens: int) -> None:
        """Drop the tokens from position `num_tokens` on (the cache side is the block manager's)."""
        del self.token_ids[num_tokens:]
        self.num_computed_tokens = min(self.num_computed_tokens, num_tokens)
        self.walk_start = min(self.walk_start, num_tokens)
        self.inputs_start = min(self.inputs_start, num_tokens)
        self.mask_segments = [
            MaskSegment(m.start, min(m.end, num_tokens), m.mask)
            for m in self.mask_segments
            if m.start < num_tokens
        ]
        # A cut segment stays, trimmed: its positions keep their expert (a recompute runs
        # them right) and their K/V stay out of the prefix cache (they are not the ids').
        # A cut payload is never embedded again: payload sequences are never recomputed.
        self.input_segments = [
            InputSegment(s.start, min(s.end, num_tokens), s.payload, s.expert)
            for s in self.input_segments
            if s.start < num_tokens
        ]
        ends = [m.end for m in self.mask_segments] + [s.end for s in self.input_segments]
        self.segments_end = max(ends, default=0)

    def input_segment_at(self, position: int) -> InputSegment | None:
        """Return the input segment holding `position`, if any."""
        if position >= self.segments_end:
            return None
        for segment in self.input_segments:
            if segment.start <= position < segment.end:
                return segment
        return None

    def max_chunk(self, budget: int) -> int:
        """Return how many uncomputed tokens one step may take under `budget`.

        Honours mask segments (see `MaskSegment.clip_chunk_end`) and input segments (a chunk
        holds one whole segment or none of it); a walk that returns its rows is never
        split (tokens before its inputs, such as the last sampled token or a recomputed
        prefix, run first in chunks of their own, so its chunk is exactly its inputs). The
        result exceeds `budget` only when the inputs cannot be cut smaller.
        """
        start = self.num_computed_tokens
        whole = self.output_mode == "hidden" or self.rows_wanted
        if whole and start >= self.inputs_start:
            return len(self.token_ids) - start
        end = min(len(self.token_ids), start + budget)
        if whole:
            end = min(end, self.inputs_start)
        if start < self.segments_end:
            for segment in self.mask_segments:
                if segment.start < end and segment.end > start:
                    end = segment.clip_chunk_end(start, end)
            for inp in self.input_segments:
                if inp.start <= start < inp.end:
                    end = inp.end  # the whole segment, in one chunk
                elif start < inp.start < end:
                    end = inp.start  # tokens up to the segment, then the segment alone
        return end - start

    def kv_limits(self, start: int, end: int) -> np.ndarray:
        """Return the exclusive ends of the keys visible from positions `[start, end)` (int64).

        Vectorised per mask segment: a step appending a frame block to a row that holds
        thirty earlier ones looks at the newest segments only.
        """
        limits = np.arange(start + 1, end + 1, dtype=np.int64)  # causal, where no segment says
        for segment in reversed(self.mask_segments):
            if segment.end <= start:
                break  # segments are appended in order: the rest lie before the chunk
            lo, hi = max(segment.start, start), min(segment.end, end)
            if lo >= hi:
                continue
            if segment.mask.kind == "full":
                limits[lo - start : hi - start] = segment.end
            else:
                size = segment.mask.block_size
                pos = np.arange(lo, hi, dtype=np.int64)
                limits[lo - start : hi - start] = np.minimum(
                    segment.start + ((pos - segment.start) // size + 1) * size, segment.end
                )
        return limits

    def kv_limit(self, position: int) -> int:
        """Return the exclusive end of the keys visible from `position` (see `kv_limits`)."""
        return int(self.kv_limits(position, position + 1)[0])

    def __repr__(self) -> str:
        return (
            f"Sequence({self.request_id!r}, {self.status.name}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, blocks={self.block_table})"
        )
