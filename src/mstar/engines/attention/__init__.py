"""Paged attention backends behind one interface (torch reference, FlashInfer on CUDA)."""

from __future__ import annotations

from mstar.engines.attention.base import AttentionBackend, AttentionMetadata, write_kv
from mstar.engines.attention.torch_paged import TorchPagedAttention

__all__ = ["AttentionBackend", "AttentionMetadata", "TorchPagedAttention", "write_kv"]
