"""Streaming between partitions: a `StreamBuffer` per streaming edge and its chunk policy."""

from __future__ import annotations

from mstar.streaming.buffer import Chunk, StreamBuffer
from mstar.streaming.policies import (
    ChunkPolicy,
    FixedChunkPolicy,
    LeftContextChunkPolicy,
    SlidingWindowChunkPolicy,
)

__all__ = [
    "Chunk",
    "ChunkPolicy",
    "FixedChunkPolicy",
    "LeftContextChunkPolicy",
    "SlidingWindowChunkPolicy",
    "StreamBuffer",
]
