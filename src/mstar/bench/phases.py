"""Where a target's time goes during a benchmark point: engine steps against a baseline's timers.

A speech system spends its time in two activities, generating tokens and decoding them to
audio; these pieces account both, per system, over exactly one point's measured requests
(warm-up excluded), so a benchmark can set them beside the point's wall time:

- `Figures`: seconds and counts per named activity (``llm_step``, ``llm_forward``,
  ``llm_generate``, ``codec``);
- `Meter`: figures a baseline accounts itself, from the threads that do the work;
- `engine_figures`: the same figures for mstar, read from the engines' own step timers;
- `PhaseTracker`: wraps a harness target to read the figures around each point;
- `PointBreakdown` and `breakdown_table`: one row per target and point, and their table.

Any other model's benchmark reads mstar's side in full, flat, per node and per walk:

- `engine_counters`: the named nodes' cumulative step counters and phase timers, and the
  steps each walk was served by, summed over ranks;
- `CounterWindow`: those counters over one point's measured requests, started after the
  point's warm-up.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from rich.table import Table

from mstar.bench.records import BenchRequest, OutputEvent
from mstar.bench.runner import is_warmup

if TYPE_CHECKING:
    from mstar.runtime import AsyncEngine

__all__ = [
    "Counters",
    "CounterWindow",
    "Figures",
    "Meter",
    "PhaseTracker",
    "PointBreakdown",
    "breakdown_table",
    "engine_counters",
    "engine_figures",
    "figures_delta",
]

Figures = dict[str, tuple[float, int]]
"""Seconds and counts per named activity: ``llm_step`` (seconds, steps), ``llm_forward``
(seconds), ``llm_generate`` (seconds, tokens), ``codec`` (seconds, windows)."""

Counters = dict[str, float]
"""Cumulative engine counters by flat name (`engine_counters`), e.g. ``llm_step_seconds``."""

_Fn = Callable[[BenchRequest], AsyncIterator[OutputEvent]]


def figures_delta(
    before: Mapping[str, tuple[float, int]], after: Mapping[str, tuple[float, int]]
) -> Figures:
    """Return what was accounted between two readings of the same counters."""
    return {
        k: (s - before.get(k, (0.0, 0))[0], n - before.get(k, (0.0, 0))[1])
        for k, (s, n) in after.items()
    }


class Meter:
    """Seconds and counts per named activity, for a baseline (``llm_generate``, ``codec``).

    Written by one thread at a time, read by the event loop between requests.
    """

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.counts: dict[str, int] = {}

    def add(self, name: str, seconds: float, count: int = 1) -> None:
        """Account ``seconds`` and ``count`` units to ``name``."""
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds
        self.counts[name] = self.counts.get(name, 0) + count

    def snapshot(self) -> Figures:
        """Return the totals so far."""
        return {k: (v, self.counts[k]) for k, v in list(self.seconds.items())}

    async def read(self) -> Figures:
        """Return the totals so far (the `PhaseTracker` interface; it does not suspend)."""
        return self.snapshot()

    @staticmethod
    def delta(
        before: Mapping[str, tuple[float, int]], after: Mapping[str, tuple[float, int]]
    ) -> Figures:
        """Return what was accounted between two snapshots (`figures_delta`)."""
        return figures_delta(before, after)


async def engine_figures(engine: AsyncEngine, *, llm_node: str, codec_node: str) -> Figures:
    """Return mstar's figures so far, from the engines' own counters (summed over ranks).

    The LLM node's steps are whole `KVCacheEngine` steps (schedule, forward, sampling,
    update); its forward is the model's forward pass plus the LM head and sampling. The codec
    is the codec node's steps, counted in inputs (one per window).
    """
    figures: Figures = {}

    def add(name: str, seconds: float, count: int) -> None:
        total, num = figures.get(name, (0.0, 0))
        figures[name] = (total + seconds, num + count)

    for nodes in (await engine.stats()).values():
        llm, codec = nodes.get(llm_node), nodes.get(codec_node)
        if llm is not None:
            forward = llm.get("phase_forward_seconds", 0.0) + llm.get("phase_logits_seconds", 0.0)
            add("llm_step", llm["step_seconds"], int(llm["steps"]))
            add("llm_forward", forward, 0)
        if codec is not None:
            add("codec", codec["step_seconds"], int(codec["batched"]))
    return figures


async def engine_counters(engine: AsyncEngine, *, nodes: Sequence[str], walk_node: str) -> Counters:
    """Return the engines' cumulative counters (summed over ranks), flat.

    For each node of ``nodes``: ``<node>_steps``, ``<node>_batched`` (inputs),
    ``<node>_step_seconds`` and ``<node>_phase_*_seconds`` (a KV step's schedule / prepare /
    forward / logits / update). For each walk served by ``walk_node``:
    ``walk_<walk>_steps``, ``walk_<walk>_inputs`` and ``walk_<walk>_seconds`` (a step whose
    batch mixes walks counts in full under each of them).
    """
    stats = await engine.engine_stats()
    counters: Counters = {}

    def add(key: str, value: float) -> None:
        counters[key] = counters.get(key, 0.0) + float(value)

    for by_node in stats.nodes.values():
        for node in nodes:
            for key, value in by_node.get(node, {}).items():
                if key in ("steps", "batched", "step_seconds") or key.startswith("phase_"):
                    add(f"{node}_{key}", value)
    for walks in stats.walks.values():
        for walk, times in walks.get(walk_node, {}).items():
            add(f"walk_{walk}_steps", times.steps)
            add(f"walk_{walk}_inputs", times.inputs)
            add(f"walk_{walk}_seconds", times.seconds)
    return counters


class CounterWindow:
    """Counters over each point's measured requests, for a target that runs alone.

    Call `after_warmup` as each warm-up request ends (after its last output, so the read is
    not measured); counters only grow, so the element-wise maximum of those reads is the state
    when the measured requests start. Call `spent` once the point ended with the engine idle.
    """

    def __init__(self, read: Callable[[], Awaitable[Counters]]) -> None:
        self.read = read
        self.start: Counters = {}

    async def after_warmup(self) -> None:
        """Fold the counters now into the start of the window."""
        for key, value in (await self.read()).items():
            self.start[key] = max(self.start.get(key, 0.0), value)

    async def spent(self) -> Counters:
        """Return what was counted since the window started; start the next window empty."""
        now = await self.read()
        out = {key: value - self.start.get(key, 0.0) for key, value in now.items()}
        self.start = {}
        return out


class PhaseTracker:
    """Read a target's figures around each point's measured requests (warm-up excluded).

    The harness names measured requests ``{kind}-{point}-{i}`` and warm-up ones
    ``warmup-...``; in a closed loop every warm-up request ends before the first measured one.
    The first measured request of a point reads the figures before any of the point's
    requests is sent; each one that ends reads them again, and the read begun last (after
    the point's last request ended) is the point's end.
    """

    def __init__(self, read: Callable[[], Awaitable[Figures]]) -> None:
        self.read = read
        self.begin: dict[str, asyncio.Task[Figures]] = {}
        self.end: dict[str, tuple[int, Figures]] = {}
        self.num_reads = 0

    def wrap(self, fn: _Fn) -> _Fn:
        """Return ``fn`` with reads at the first start and the last end of each point."""

        async def run(request: BenchRequest) -> AsyncIterator[OutputEvent]:
            phase = None if is_warmup(request.request_id) else request.request_id.rsplit("-", 1)[0]
            if phase is not None:
                if phase not in self.begin:
                    self.begin[phase] = asyncio.ensure_future(self.read())
                await self.begin[phase]  # the point's other first requests wait for it too
            try:
                async for event in fn(request):
                    yield event
            finally:
                if phase is not None:
                    self.num_reads += 1
                    order, figures = self.num_reads, await self.read()
                    if order > self.end.get(phase, (0, {}))[0]:
                        self.end[phase] = (order, figures)

        return run

    def spent(self, phase: str) -> Figures:
        """Return what the target accounted during a point's measured requests."""
        begin = self.begin[phase].result() if phase in self.begin else {}
        return figures_delta(begin, self.end.get(phase, (0, {}))[1])


@dataclass
class PointBreakdown:
    """Where one target's time went at one point."""

    target: str
    concurrency: int
    wall_s: float
    audio_s: float
    llm_s: float
    llm_forward_s: float | None
    num_steps: int
    codec_s: float
    num_windows: int

    @property
    def other_s(self) -> float:
        """Return wall time not spent in LLM steps or codec calls (may be < 0 when they overlap)."""
        return self.wall_s - self.llm_s - self.codec_s

    @classmethod
    def from_spent(
        cls,
        target: str,
        concurrency: int,
        wall_s: float,
        audio_s: float,
        spent: Mapping[str, tuple[float, int]],
    ) -> PointBreakdown:
        """Return the row of a `PhaseTracker.spent` reading: LLM steps, else ``generate``."""
        llm_key = "llm_step" if "llm_step" in spent else "llm_generate"
        forward = spent.get("llm_forward")
        return cls(
            target,
            concurrency,
            wall_s,
            audio_s,
            spent.get(llm_key, (0.0, 0))[0],
            None if forward is None else forward[0],
            spent.get(llm_key, (0.0, 0))[1],
            spent.get("codec", (0.0, 0))[0],
            spent.get("codec", (0.0, 0))[1],
        )


def breakdown_table(rows: Sequence[PointBreakdown], caption: str) -> Table:
    """Return the table of where the time goes: one row per target and point."""
    table = Table(title="where the time goes (seconds during each point's measured phase)")
    headers = (
        "c|target|wall s|audio s|LLM s|(forward s)|steps|ms/step|codec s|windows|ms/window|other s"
    )
    for header in headers.split("|"):
        table.add_column(header, justify="left" if header == "target" else "right")
    for b in rows:
        table.add_row(
            str(b.concurrency),
            b.target,
            f"{b.wall_s:.1f}",
            f"{b.audio_s:.1f}",
            f"{b.llm_s:.1f}",
            "-" if b.llm_forward_s is None else f"{b.llm_forward_s:.1f}",
            str(b.num_steps),
            f"{1e3 * b.llm_s / b.num_steps:.1f}" if b.num_steps else "-",
            f"{b.codec_s:.1f}",
            str(b.num_windows),
            f"{1e3 * b.codec_s / b.num_windows:.0f}" if b.num_windows else "-",
            f"{b.other_s:.1f}",
        )
    table.caption = caption
    return table
