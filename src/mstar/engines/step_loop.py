"""`StepLoop`: the lifecycle every node engine shares (a step task on the event loop)."""

from __future__ import annotations

import asyncio
import contextlib

from mstar.errors import EngineClosedError

__all__ = ["StepLoop"]


class StepLoop:
    """Base of node engines: one step task, woken when work arrives, closed once.

    Subclasses set ``node``, implement `_run` (the step loop) and `_fail_pending` (fail what
    waits when the engine closes), and call ``self._wakeup.set()`` when work arrives.
    """

    node: str

    def __init__(self) -> None:
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._closed = False

    def start(self) -> None:
        """Start the step loop on the running event loop."""
        if self._task is None:
            name = f"{type(self).__name__}:{self.node}"
            self._task = asyncio.get_running_loop().create_task(self._run(), name=name)

    async def aclose(self) -> None:
        """Stop stepping; whatever waits fails with `EngineClosedError`."""
        self._closed = True
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        self._fail_pending(EngineClosedError(f"engine for node {self.node!r} closed"))

    async def _run(self) -> None:
        raise NotImplementedError

    def _fail_pending(self, error: EngineClosedError) -> None:
        raise NotImplementedError
