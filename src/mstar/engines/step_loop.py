"""`StepLoop`: the lifecycle every node engine shares (a step task on the event loop)."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

from mstar.errors import EngineClosedError

__all__ = ["StepExecutor", "StepLoop"]

_T = TypeVar("_T")


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


class StepExecutor(ThreadPoolExecutor):
    """A rank's step thread: one worker thread, which can tell whether work waits for it.

    An engine that could step again at once yields the thread instead when another engine's
    work is queued (`has_waiting_work`), so engines sharing a rank take turns.
    """

    def __init__(
        self, thread_name_prefix: str = "", initializer: Callable[[], object] | None = None
    ) -> None:
        super().__init__(1, thread_name_prefix=thread_name_prefix, initializer=initializer)
        self._lock = threading.Lock()
        self._num_waiting = 0

    def submit(self, fn: Callable[..., _T], /, *args: Any, **kwargs: Any) -> Future[_T]:
        """Queue ``fn(*args, **kwargs)`` for the step thread."""
        with self._lock:
            self._num_waiting += 1

        def run() -> _T:
            with self._lock:
                self._num_waiting -= 1
            return fn(*args, **kwargs)

        try:
            return super().submit(run)
        except BaseException:
            with self._lock:
                self._num_waiting -= 1
            raise

    def has_waiting_work(self) -> bool:
        """Whether work was queued that the thread has not started."""
        return self._num_waiting > 0
