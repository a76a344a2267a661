"""One request's token sequence inside a KV-cache engine: pure bookkeeping, no tensors."""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import TYPE_CHECKING

from mstar.engines.masks import AttentionMask, MaskSegment
from mstar.engines.sampling_params import SamplingParams

if TYPE_CHECKING:
    import torch

__all__ = [
    "FinishReason",
    "LogitsProcessor",
    "Sequence",
    "SequenceStatus",
    "StopCheck",
    "vocab_ranges",
]

LogitsProcessor = Callable[[list[int], "torch.Tensor"], "torch.Tensor"]
"""Called per step as `processor(token_ids, logits) -> logits` with the row of one request.

`token_ids` are all of the sequence's tokens so far (prompt and generated); `logits` is a
1-D tensor over the vocabulary. Return it modified (in place or new), e.g. with `-inf` at
the tokens forbidden at this position (constrained decoding)."""


def vocab_ranges(processor: LogitsProcessor | None, token_ids: list[int]) -> list[tuple[int, int]] | None:
    """Return the id ranges outside which `processor` sets every logit to `-inf`, if it says.

    A processor may define `vocab_ranges(token_ids) -> [(start, end), ...]` (sorted,
    disjoint, half-open) naming, for the next position, the only ids it can leave finite
    (constrained decoding allows a few thousand of a large vocabulary). The model then
    computes logits for those ids only, and the sampler draws among them. None: no promise.
    """
    method = getattr(processor, "vocab_ranges", None)
    return None if method is None else list(method(token_ids))


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


class Sequence:
    """Tokens, progress and block table of one request (or one fork of it).

    `token_ids[:num_computed_tokens]` have their K/V in the cache; the rest are inputs
    of the next steps. After a token is sampled it is appended and computed next step.
    """

    __slots__ = (
        "arrival",
        "block_table",
        "generator",
        "keep_alive",
        "logits_processor",
        "mask_segments",
        "num_computed_tokens",
        "params",
        "request_id",
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
        self.walk_start = len(self.token_ids)
        if mask is not None and not mask.is_causal:
            self.mask_segments.append(MaskSegment(0, len(self.token_ids), mask))

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

        Non-causal segments make a block's K/V depend on later tokens, so those
        sequences keep their blocks private (forks still share them).
        """
        return not self.mask_segments

    def extend(self, token_ids: list[int], mask: AttentionMask | None) -> None:
        """Append input tokens for a new walk (they start uncomputed)."""
        start = len(self.token_ids)
        self.token_ids.extend(token_ids)
        if mask is not None and not mask.is_causal and token_ids:
            self.mask_segments.append(MaskSegment(start, len(self.token_ids), mask))
        self.walk_start = len(self.token_ids)

    def max_chunk(self, budget: int) -> int:
        """Return how many uncomputed tokens one step may take under `budget`.

        Honours mask segments (see `MaskSegment.clip_chunk_end`); the result exceeds
        `budget` only when a segment cannot be cut smaller.
        """
        start = self.num_computed_tokens
        end = min(len(self.token_ids), start + budget)
        for segment in self.mask_segments:
            if segment.start < end and segment.end > start:
                end = segment.clip_chunk_end(start, end)
        return end - start

    def kv_limit(self, position: int) -> int:
        """Return the exclusive end of the keys visible from `position`."""
        for segment in self.mask_segments:
            if segment.start <= position < segment.end:
                return segment.limit(position)
        return position + 1

    def __repr__(self) -> str:
        return (
            f"Sequence({self.request_id!r}, {self.status.name}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, blocks={self.block_table})"
        )
