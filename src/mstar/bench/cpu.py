"""Where the CPU goes while a target serves: thread CPU time per component, per audio second.

Wall time says how long a request took; CPU time says what it cost. `CpuAccount` reads every
thread's CPU clock when a target's first request starts and again when its last one ends,
and charges the difference to the component that owns the thread, named by the thread's name
prefix (a step thread per rank, a stage's executor, ...). Divided by the audio the target
made, it is the CPU a system spends per second of speech; divided by the wall time, the cores
it kept busy.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence

from mstar.bench.records import BenchRequest, OutputEvent

__all__ = ["Components", "CpuAccount", "thread_cpu_seconds"]

Components = Mapping[str, Sequence[tuple[str, str]]]
"""Per target, its threads' name prefixes and the component each is charged to, e.g.
``{"mstar": (("mstar-rank0", "thinker"), ...)}``."""

_Fn = Callable[[BenchRequest], AsyncIterator[OutputEvent]]


def thread_cpu_seconds() -> dict[int, tuple[str, float]]:
    """Return every live thread's name and CPU seconds so far, by thread id."""
    out: dict[int, tuple[str, float]] = {}
    for thread in threading.enumerate():
        if thread.ident is None:
            continue
        try:
            clock = time.pthread_getcpuclockid(thread.ident)
            out[thread.ident] = (thread.name, time.clock_gettime(clock))
        except (OSError, ProcessLookupError):  # the thread just ended
            continue
    return out


class CpuAccount:
    """CPU seconds per component while a target has requests in flight, and the audio it made.

    The load generator runs one target at a time, so a target's windows (first request in
    flight to last one out, warm-up included) hold only its own work; the threads of the
    targets not running stay idle and are not counted, nor is a thread that ends inside a
    window. The main thread (the event loop) is charged as ``loop``; a thread no target names
    as ``other``.
    """

    def __init__(self, components: Components, sample_rate: int) -> None:
        self.components = components
        self.sample_rate = sample_rate
        self.active: dict[str, int] = {}
        self.since: dict[str, tuple[float, dict[int, tuple[str, float]]]] = {}
        self.cpu: dict[str, dict[str, float]] = {}
        self.wall: dict[str, float] = {}
        self.samples: dict[str, int] = {}

    def wrap(self, target: str, fn: _Fn) -> _Fn:
        """Return ``fn`` accounted as ``target``: its windows' CPU and its audio samples."""

        async def stream(request: BenchRequest) -> AsyncIterator[OutputEvent]:
            self._enter(target)
            try:
                async for event in fn(request):
                    if event.num_samples:
                        self.samples[target] = self.samples.get(target, 0) + event.num_samples
                    yield event
            finally:
                self._exit(target)

        return stream

    def _enter(self, target: str) -> None:
        if not self.active.get(target):
            self.since[target] = (time.perf_counter(), thread_cpu_seconds())
        self.active[target] = self.active.get(target, 0) + 1

    def _exit(self, target: str) -> None:
        self.active[target] -= 1
        if self.active[target]:
            return
        started, before = self.since.pop(target)
        self.wall[target] = self.wall.get(target, 0.0) + time.perf_counter() - started
        cpu = self.cpu.setdefault(target, {})
        for ident, (name, now) in thread_cpu_seconds().items():
            component = self._component(target, name)
            if component:  # another target's threads: idle now, not this target's
                cpu[component] = cpu.get(component, 0.0) + now - before.get(ident, (name, 0.0))[1]

    def _component(self, target: str, thread_name: str) -> str:
        """Return the component a thread is charged to, or "" for another target's thread."""
        if thread_name == "MainThread":
            return "loop"
        for prefix, component in self.components.get(target, ()):
            if thread_name.startswith(prefix):
                return component
        named = (p for prefixes in self.components.values() for p, _ in prefixes)
        return "" if any(thread_name.startswith(p) for p in named) else "other"

    def take(self) -> dict[str, dict[str, float]]:
        """Return per target: ms of CPU per audio second per component, the total and the cores
        busy; start over."""
        out: dict[str, dict[str, float]] = {}
        for target, cpu in self.cpu.items():
            audio_s = self.samples.get(target, 0) / self.sample_rate
            row = {k: 1e3 * v / audio_s if audio_s else math.nan for k, v in sorted(cpu.items())}
            row["total"] = 1e3 * sum(cpu.values()) / audio_s if audio_s else math.nan
            wall = self.wall.get(target, 0.0)
            row["cores_busy"] = sum(cpu.values()) / wall if wall else math.nan
            out[target] = row
        self.cpu, self.wall, self.samples = {}, {}, {}
        return out
