"""Attention masks a KV-cache sequence can use, as "each query sees a prefix of the keys".

Every supported mask gives query position ``t`` the keys ``[0, limit(t))``:

```
causal          limit(t) = t + 1
full            limit(t) = end of the segment   (bidirectional within it, e.g. a prefix)
block_causal(F) limit(t) = end of t's F-token block in the segment (per-frame blocks)

 keys ->        causal        full          block_causal(2)
 q0             x . . .       x x x x       x x . .
 q1             x x . .       x x x x       x x . .
 q2             x x x .       x x x x       x x x x
 q3             x x x x       x x x x       x x x x
```

Because every row is a prefix, backends need one integer per query token (its limit),
and a chunked prefill may only cut a segment where no query would see past the cut.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from mstar.errors import InvalidSamplingParamsError

__all__ = ["AttentionMask", "MaskSegment", "MaskKind"]

MaskKind = Literal["causal", "full", "block_causal"]


@dataclass(frozen=True, slots=True)
class AttentionMask:
    """How the tokens of one input segment attend to each other and to earlier tokens."""

    kind: MaskKind = "causal"
    block_size: int = 0

    def __post_init__(self) -> None:
        if self.kind not in ("causal", "full", "block_causal"):
            raise InvalidSamplingParamsError(f"unknown attention mask kind {self.kind!r}")
        if self.kind == "block_causal" and self.block_size < 1:
            raise InvalidSamplingParamsError(
                f"block_causal masks need block_size >= 1, got {self.block_size}"
            )

    @classmethod
    def causal(cls) -> AttentionMask:
        """Make the usual autoregressive mask."""
        return cls("causal")

    @classmethod
    def full(cls) -> AttentionMask:
        """Make a bidirectional mask over the segment (plus everything before it)."""
        return cls("full")

    @classmethod
    def block_causal(cls, block_size: int) -> AttentionMask:
        """Make a mask that is full within `block_size`-token blocks and causal across them."""
        return cls("block_causal", block_size)

    @property
    def is_causal(self) -> bool:
        """Whether this is the plain causal mask."""
        return self.kind == "causal"


@dataclass(frozen=True, slots=True)
class MaskSegment:
    """A non-causal mask over token positions `[start, end)` of one sequence."""

    start: int
    end: int
    mask: AttentionMask

    def limit(self, position: int) -> int:
        """Return the exclusive end of the keys visible from `position` (inside the segment)."""
        if self.mask.kind == "full":
            return self.end
        size = self.mask.block_size
        return min(self.start + ((position - self.start) // size + 1) * size, self.end)

    def clip_chunk_end(self, chunk_start: int, chunk_end: int) -> int:
        """Return the largest allowed chunk end <= `chunk_end`, or the smallest one above.

        A chunk `[chunk_start, chunk_end)` is allowed when no query in it sees past
        `chunk_end`. The result is above `chunk_end` only when no allowed end lies in
        `(chunk_start, chunk_end]`; the caller then decides whether to exceed its budget.
        """
        if chunk_end <= self.start or chunk_end >= self.end:
            return chunk_end
        if self.mask.kind == "full":
            return self.start if self.start > chunk_start else self.end
        size = self.mask.block_size
        aligned = self.start + ((chunk_end - self.start) // size) * size
        if aligned > chunk_start:
            return aligned
        return self.limit(chunk_start)
