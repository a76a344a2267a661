"""What a model must offer to run inside a `KVCacheEngine`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from mstar.engines.attention.base import AttentionBackend
from mstar.engines.kv_cache import KVCacheSpec

__all__ = ["PagedKVContext", "PagedModel"]


@dataclass(slots=True)
class PagedKVContext:
    """Handed to the model each step: the planned backend and every layer's cache."""

    backend: AttentionBackend
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]

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
        """Return `[rows, vocab]` logits for selected hidden states.

        A model may also offer `compute_logits_in(hidden, ranges)`: the same logits, but
        computed only inside each row's id ranges (`[(start, end), ...]`) and `-inf`
        elsewhere. The runner uses it when every sampled row's logits processor names its
        ranges (constrained decoding over a large vocabulary).
        """
        ...
