"""What a node's engine accepts, published once when it starts (`NodeLimits`)."""

from __future__ import annotations

import msgspec

__all__ = ["NodeLimits"]


class NodeLimits(msgspec.Struct, frozen=True, array_like=True):
    """A KV-cache node's limits, as its engine sized them at start.

    Attributes:
        max_seq_len: The longest sequence (prompt and generated tokens) one request may hold:
            the model's length, lowered by the cache's capacity.
        num_blocks: KV-cache blocks of the node.
        block_size: Token slots per block.
    """

    max_seq_len: int
    num_blocks: int
    block_size: int
