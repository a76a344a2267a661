"""Factories and harnesses shared by the tests."""

from __future__ import annotations

import asyncio
from collections import defaultdict
from typing import Any

from mstar.engines import SamplingParams, Sequence
from mstar.graph import Emission
from mstar.runtime import Placement
from mstar.runtime.conductor_core import (
    Command,
    ConductorCore,
    Deliver,
    Fail,
    Finish,
    Release,
    StartWalk,
)
from mstar.runtime.model import Model, Output, Request
from mstar.runtime.walk_runner import ValueKey
from mstar.runtime.worker_core import WorkerConfig, WorkerCore

Slot = tuple[str, str]


def make_sequence(
    tokens: list[int],
    params: SamplingParams | None = None,
    *,
    arrival: int = 0,
    walk_start: int | None = None,
    **kwargs: Any,
) -> Sequence:
    """Return an engine `Sequence` ``s{arrival}`` of ``tokens`` (default sampling params);
    ``walk_start``: where its current walk's tokens begin (what penalties count)."""
    seq = Sequence(
        f"s{arrival}",
        tokens,
        params if params is not None else SamplingParams(),
        arrival=arrival,
        **kwargs,
    )
    if walk_start is not None:
        seq.walk_start = walk_start
    return seq


class Direct:
    """Conductor and workers in one event loop; messages are call_soon hops (FIFO per loop)."""

    def __init__(self, model: Model, placement: dict[str, list[int]]) -> None:
        graph = model.graph()
        groups = "\n".join(f"  - {{node_names: [{n}], ranks: {r}}}" for n, r in placement.items())
        resolved = Placement.from_yaml(f"node_groups:\n{groups}\n").resolve(graph)
        self.core = ConductorCore(model, graph, resolved)
        ranks = sorted({r for rs in placement.values() for r in rs})
        self.workers = {
            r: WorkerCore(
                r, model, graph, resolved, self._outbox(r), WorkerConfig(offload_steps=False)
            )
            for r in ranks
        }
        self.outputs: dict[str, list[Output]] = defaultdict(list)
        self.results: dict[str, asyncio.Future[None]] = {}

    def _later(self, fn: Any, *args: Any) -> None:
        asyncio.get_running_loop().call_soon(fn, *args)

    def _outbox(self, rank: int) -> Any:
        d = self

        class Outbox:
            def walk_done(self, rid: str, seq: int, r: int, persisted: dict[Slot, Any]) -> None:
                d._later(lambda: d.execute(d.core.walk_done(rid, seq, r, persisted)))

            def walk_failed(self, rid: str, seq: int, r: int, error: Exception) -> None:
                d._later(lambda: d.execute(d.core.walk_failed(rid, seq, error)))

            def emitted(self, rid: str, emission: Emission) -> None:
                d._later(lambda: d.execute(d.core.emitted(rid, emission)))

            def stream_item(self, rid: str, slot: Slot, value: Any) -> None:
                d._later(lambda: d.execute(d.core.stream_item(rid, slot, value)))

            def node_values(
                self, to: int, rid: str, seq: int, items: list[tuple[ValueKey, Any]]
            ) -> None:
                d._later(d.workers[to].deliver, rid, seq, items)

        return Outbox()

    def execute(self, commands: list[Command]) -> None:
        for c in commands:
            if isinstance(c, StartWalk):
                self._later(self.workers[c.rank].start_walk, c)
            elif isinstance(c, Deliver):
                self.outputs[c.output.request_id].append(c.output)
            elif isinstance(c, Release):
                for r in c.ranks:
                    self._later(self.workers[r].release, c.request_id, c.up_to_seq)
            elif isinstance(c, Finish):
                self.results[c.request_id].set_result(None)
            elif isinstance(c, Fail):
                self.results[c.request_id].set_exception(c.error)

    async def run(self, request: Request) -> list[Output]:
        self.results[request.request_id] = asyncio.get_running_loop().create_future()
        self.execute(self.core.submit(request))
        await self.results[request.request_id]
        return self.outputs[request.request_id]

    async def __aenter__(self) -> Direct:
        for w in self.workers.values():
            await w.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        for w in self.workers.values():
            await w.aclose()

    def assert_empty(self) -> None:
        assert self.core.requests == {}
        for w in self.workers.values():
            assert (w.runners, w.tasks, w.early) == ({}, {}, {})
            assert all(e.num_pending == 0 for e in w.engines.values())


async def wait_until_idle(engine: Any, attempts: int = 200) -> None:
    """Wait (bounded) until an AsyncEngine holds no request state; fail with what is left."""
    held: dict[str, dict[str, int]] = {}
    for _ in range(attempts):
        held = await engine.held_state()
        if all(v == 0 for counts in held.values() for v in counts.values()):
            return
        await asyncio.sleep(0.01)  # releases travel as messages and engine ops: let them land
    raise AssertionError(f"request state left behind: {held}")
