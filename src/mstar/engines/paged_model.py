"""What a model must offer to run inside a `KVCacheEngine`, and what it is handed per step.

A step is one flat batch of chunks, one per scheduled sequence. The model gets the batch's
token ids and positions as tensors, and in `PagedKVContext.step` what else each chunk is:

```
 rows      | c0: 5 text tokens | c1: 64 image latents (payload, expert 1) | c2: 1 token |
 input_ids | ids ...           | 0 0 0 ... (placeholders)                 | id          |
 chunks    | StepChunk(rows 0:5, payload None) | StepChunk(5:69, payload=..., expert 1) | ...
```

A model that accepts payloads embeds each payload chunk itself (`StepInputs.payload_chunks`)
and routes rows through its experts by `StepInputs.expert_ids`; attention is joint over
the whole batch, whichever weights produced a row's keys and values.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, Protocol, TypeGuard, cast, runtime_checkable

import torch

from mstar.engines.attention.base import AttentionBackend
from mstar.engines.kv_cache import KVCacheSpec

__all__ = [
    "PagedKVContext",
    "PagedModel",
    "StepChunk",
    "StepInputs",
    "SupportsGreedyTokens",
    "SupportsNarrowLogits",
    "SupportsStepChunks",
    "supports_greedy_tokens",
    "supports_narrow_logits",
    "supports_step_chunks",
]


@dataclass(frozen=True, slots=True)
class StepChunk:
    """One scheduled chunk of a step: rows `[row_start, row_end)` of the flat batch.

    Attributes:
        seq_key: The engine's id of the sequence (a request, or a fork or query of one).
        row_start: First row in the flat batch.
        row_end: Row after the last.
        position: Position of the chunk's first token in its sequence.
        payload: The model-specific input of these rows, or None for token ids.
        expert: Which weight set runs these rows (0: the default one).
        is_read_only: The chunk queries its sequence's cache and writes nothing.
    """

    seq_key: str
    row_start: int
    row_end: int
    position: int
    payload: Any = None
    expert: int = 0
    is_read_only: bool = False

    @property
    def num_rows(self) -> int:
        """Count the chunk's rows."""
        return self.row_end - self.row_start


@dataclass(slots=True)
class StepInputs:
    """Per-chunk inputs of one step (see the module docstring).

    Attributes:
        chunks: Every chunk of the step, in batch order.
        expert_ids: `[num_tokens]` int64 expert of each row (device), or None when every
            row runs expert 0.
    """

    chunks: list[StepChunk] = field(default_factory=list)
    expert_ids: torch.Tensor | None = None

    @property
    def payload_chunks(self) -> list[StepChunk]:
        """Return the chunks whose rows come from a payload."""
        return [c for c in self.chunks if c.payload is not None]


@dataclass(slots=True)
class PagedKVContext:
    """Handed to the model each step: the planned backend, every layer's cache, the step's inputs."""

    backend: AttentionBackend
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
    step: StepInputs = field(default_factory=StepInputs)

    @torch.compiler.disable
    def attend(
        self,
        layer_index: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        """Write this step's K/V of layer `layer_index` and attend (see `AttentionBackend`).

        Never traced by `torch.compile`: backends keep per-step Python state (plans,
        staging) that compiled graphs must not freeze.
        """
        return self.backend.forward(q, k, v, self.kv_caches[layer_index], scale)

    def native_decode(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """Return `(slots, block tables, lengths)` for native decoder layers, or None (see
        `TorchPagedAttention.native_decode`): only a CPU backend with the native kernels offers them."""
        offer = getattr(self.backend, "native_decode", None)
        if offer is None or not self.kv_caches or torch.compiler.is_compiling():
            return None
        return cast("tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None", offer(self.kv_caches[0][0]))


class PagedModel(Protocol):
    """A decoder over a flat token batch whose attention layers call `ctx.attend`."""

    @property
    def kv_cache_spec(self) -> KVCacheSpec:
        """Return the per-token cache geometry (layers, KV heads, head size, dtype)."""
        ...

    @property
    def max_position(self) -> int:
        """Return the longest sequence the model supports."""
        ...

    def __call__(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: PagedKVContext
    ) -> torch.Tensor:
        """Return hidden states `[num_tokens, hidden]` for the flat batch."""
        ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Return `[rows, vocab]` logits for selected hidden states (sampling walks only).

        A model may also offer narrowed logits (`SupportsNarrowLogits`).
        """
        ...


@runtime_checkable
class SupportsNarrowLogits(Protocol):
    """A `PagedModel` that computes logits inside id ranges only.

    The runner uses it when every sampled row's logits processor names its ranges
    (constrained decoding over a large vocabulary: Orpheus' audio codes).
    """

    supports_narrow_logits: ClassVar[Literal[True]]

    def compute_logits_in(self, hidden: torch.Tensor, ranges: list[list[tuple[int, int]]]) -> torch.Tensor:
        """Return `[rows, vocab]` logits computed inside each row's `[(start, end), ...]`, `-inf` elsewhere."""
        ...


def supports_narrow_logits(model: object) -> TypeGuard[SupportsNarrowLogits]:
    """Whether `model` declares `SupportsNarrowLogits`."""
    return getattr(model, "supports_narrow_logits", False) is True  # compiled wrappers forward it


@runtime_checkable
class SupportsGreedyTokens(Protocol):
    """A `PagedModel` that finds greedy tokens without computing every logit.

    The runner asks it when every sampled row is plain greedy (temperature 0, no penalties,
    processors or log-probabilities) and the step returns no logits.
    """

    supports_greedy_tokens: ClassVar[Literal[True]]

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Return `[rows]` int64 argmax ids of `compute_logits(hidden)` (the first on ties), or None.

        None: not decided this way (the runner computes the logits and samples as usual).
        """
        ...


def supports_greedy_tokens(model: object) -> TypeGuard[SupportsGreedyTokens]:
    """Whether `model` declares `SupportsGreedyTokens`."""
    return getattr(model, "supports_greedy_tokens", False) is True  # compiled wrappers forward it


@runtime_checkable
class SupportsStepChunks(Protocol):
    """A `PagedModel` that reads `StepInputs.chunks` on every step, plain decode steps included.

    Plain one-token decode steps otherwise take a fast path that hands the model no chunks.
    A model whose positions are its own (BAGEL: an image of n cache positions takes one RoPE
    position, so a sampled token's RoPE position depends on its sequence) needs each row's
    sequence there too.
    """

    supports_step_chunks: ClassVar[Literal[True]]


def supports_step_chunks(model: object) -> bool:
    """Whether `model` declares `SupportsStepChunks`."""
    return getattr(model, "supports_step_chunks", False) is True  # compiled wrappers forward it
