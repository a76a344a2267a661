"""`OverlappedSteps`: run engine steps back to back on the step thread, handing results over early.

A KV-cache node's steps run on a thread of their own; their results (a token per request)
are routed by the event loop. Two costs are avoided:

- a round trip through the event loop between steps (about a millisecond per step while
  the loop streams the last step's tokens): the next step starts as soon as one ends;
- contention for the GIL between the loop's Python and the step's own Python: a step's
  results go to the loop while the *next* step projects its logits, which on a CPU is the
  step's longest kernel and holds no GIL.

```
 step thread   | step n: schedule, forward | logits n ─ sample | step n+1: ... | logits n+1 ...
 event loop                                            deliver n ──────────▶ (while logits n+1 run)
```

Results that start or end a walk (first tokens, last tokens, errors) go at once, and so
does everything when no further step follows. Overlap pays only with a core to spare for
the loop: when the step's kernels use every core, results go at once too.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Callable
from typing import Any

import torch

from mstar.engines.model_runner import ModelRunner

__all__ = ["OverlappedSteps", "StepBatchResult", "overlap_pays", "usable_cores"]

StepBatchResult = tuple[list[tuple[str, BaseException]], list[Any], bool]
"""What one step returns: failed engine calls, per-sequence results, and whether anything in
them starts or ends a walk (handed over at once)."""


def usable_cores() -> int:
    """Return how many cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def overlap_pays(device: torch.device) -> bool:
    """Whether handing results over during the next step's logits leaves the step undisturbed.

    A multi-threaded kernel sharing its cores with the loop's Python waits for its slowest
    thread; a device step leaves the CPU free.
    """
    return device.type != "cpu" or torch.get_num_threads() < usable_cores()


class OverlappedSteps:
    """Drive one engine's steps on the step thread (see the module docstring).

    Args:
        runner: The engine's model runner (its `before_logits` hook hands results over).
        step: Runs one step on the step thread; returns a `StepBatchResult`.
        deliver: Called on the event loop with ``(seconds, failed, results)`` of a step.
        fail: Called on the event loop with a step's exception.
        keep_going: Whether to run another step at once (work is queued for this engine,
            nothing else wants the thread, the engine is open).
    """

    def __init__(
        self,
        runner: ModelRunner,
        step: Callable[[], StepBatchResult],
        deliver: Callable[[float, list[tuple[str, BaseException]], list[Any]], None],
        fail: Callable[[Exception], None],
        keep_going: Callable[[], bool],
    ) -> None:
        self.runner, self.step, self.deliver, self.fail, self.keep_going = (
            runner,
            step,
            deliver,
            fail,
            keep_going,
        )

    def run(self, loop: asyncio.AbstractEventLoop, *, overlap: bool) -> None:
        """Run steps until `keep_going` says stop, a step fails or the loop closes (step thread)."""
        pending: list[tuple[float, list[tuple[str, BaseException]], list[Any]]] = []
        loop_closed = False

        def hand_over() -> None:
            nonlocal loop_closed
            if pending:
                try:
                    loop.call_soon_threadsafe(self.deliver, *pending.pop())
                except RuntimeError:  # the loop closed meanwhile: nobody waits for these
                    loop_closed = True

        self.runner.before_logits = hand_over if overlap else None
        try:
            while not loop_closed:
                start = time.perf_counter()
                try:
                    failed, results, urgent = self.step()
                except Exception as step_error:
                    hand_over()
                    with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                        loop.call_soon_threadsafe(self.fail, step_error)
                    return
                hand_over()  # a step that computed no logits did not take the last results
                pending.append((time.perf_counter() - start, failed, results))
                if urgent or not overlap:  # first tokens and walk ends are not held back
                    hand_over()
                if not self.keep_going():
                    hand_over()
                    return
        finally:
            self.runner.before_logits = None
