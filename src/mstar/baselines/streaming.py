"""Token streaming out of transformers' ``generate``, the way a server without mstar does it.

``generate`` blocks, so a plain server runs it in a thread with a streamer that hands every
new token to the event loop; the baselines of the benchmarks stream this way.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import torch
from transformers.generation.streamers import BaseStreamer

__all__ = ["QueueStreamer"]


class QueueStreamer(BaseStreamer):
    """A transformers streamer handing each row's new token ids to that row's asyncio queue.

    ``generate`` calls it from its own thread: the first ``put`` is the prompt (skipped),
    each later one a step's tokens, one per row; ``end`` puts ``None`` on every queue.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, queues: Sequence[asyncio.Queue[Any]]):
        super().__init__()
        self.loop = loop
        self.queues = list(queues)
        self.is_prompt = True

    def put(self, value: torch.Tensor) -> None:
        """Forward a step's token ids, one per row (the prompt, put first, is skipped)."""
        if self.is_prompt:
            self.is_prompt = False
            return
        for queue, token in zip(self.queues, value.reshape(-1).tolist(), strict=True):
            self.loop.call_soon_threadsafe(queue.put_nowait, int(token))

    def end(self) -> None:
        """Mark the end of generation on every row."""
        for queue in self.queues:
            self.loop.call_soon_threadsafe(queue.put_nowait, None)

    def fail(self, error: BaseException) -> None:
        """Hand ``error`` to every row, for its consumer to raise."""
        for queue in self.queues:
            self.loop.call_soon_threadsafe(queue.put_nowait, error)
