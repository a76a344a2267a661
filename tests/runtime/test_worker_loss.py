"""A worker process that dies fails the requests using it, with a typed error, and comes back."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from mstar.errors import WorkerLostError
from mstar.runtime import AsyncEngine, EngineConfig, ModelSpec, Placement, Request

TWO_RANKS = "node_groups:\n  - {node_names: [a, done], ranks: [0]}\n  - {node_names: [b], ranks: [1]}\n"


@pytest.mark.timeout(180)
async def test_killed_worker_fails_its_requests_and_is_restarted() -> None:
    spec = ModelSpec("mstar.zoo.noop:NoopLoopModel", {"steps": 10_000_000})
    config = EngineConfig(worker_processes=True, offload_steps=False)
    async with await AsyncEngine.start(spec, Placement.from_yaml(TWO_RANKS), config) as engine:
        running = asyncio.ensure_future(engine.run(Request("loop", {})))
        victim = engine.processes[1]
        assert victim.pid is not None
        while (await engine.held_state())["rank1"]["runners"] == 0:  # the loop is running on rank 1
            await asyncio.sleep(0.01)
        os.kill(victim.pid, signal.SIGKILL)
        with pytest.raises(WorkerLostError, match="rank 1 died"):
            await asyncio.wait_for(running, 30)
        # the worker comes back and runs walks again (the loop is endless here: cancel it)
        while engine.num_restarts == 0:
            await asyncio.sleep(0.05)
        fresh = asyncio.ensure_future(engine.run(Request("loop", {})))
        while (await engine.held_state())["rank1"]["runners"] == 0:
            await asyncio.sleep(0.01)
        fresh.cancel()
        with pytest.raises(asyncio.CancelledError):
            await fresh
        assert engine.processes[1].pid != victim.pid


@pytest.mark.timeout(240)
async def test_requests_sent_while_a_worker_restarts_wait_for_it_and_never_hang() -> None:
    spec = ModelSpec("mstar.zoo.noop:NoopLoopModel", {"steps": 20})
    config = EngineConfig(worker_processes=True, offload_steps=False)
    async with await AsyncEngine.start(spec, Placement.from_yaml(TWO_RANKS), config) as engine:
        assert [o.data for o in await engine.run(Request("loop", {}))] == [20]
        victim = engine.processes[1]
        assert victim.pid is not None
        os.kill(victim.pid, signal.SIGKILL)

        async def later(delay: float) -> str:
            await asyncio.sleep(delay)
            try:
                outputs = await engine.run(Request("loop", {}))
            except WorkerLostError:
                return "lost"
            assert [o.data for o in outputs] == [20]
            return "ok"

        before = asyncio.ensure_future(later(0.0))  # may reach the dead worker: fails, typed
        while engine.ranks_up()[1]:
            await asyncio.sleep(0.01)
        after = [asyncio.ensure_future(later(d)) for d in (0.0, 0.3, 1.0)]
        # While the worker is away, stats answer at once without it.
        stats = await asyncio.wait_for(engine.engine_stats(), 5)
        assert stats.missing_ranks == [1] and 0 in stats.nodes
        assert await asyncio.wait_for(before, 120) in ("ok", "lost")
        # Sent once the loss was seen: they wait for the restart, then run (none hangs).
        assert await asyncio.wait_for(asyncio.gather(*after), 120) == ["ok"] * 3
        assert engine.num_restarts == 1 and engine.ranks_up() == {0: True, 1: True}
        assert [o.data for o in await engine.run(Request("loop", {}))] == [20]


@pytest.mark.timeout(240)
async def test_requests_for_a_lost_replica_run_on_the_live_one_without_waiting() -> None:
    spec = ModelSpec("mstar.zoo.noop:NoopLoopModel", {"steps": 20})
    replicated = "node_groups:\n  - {node_names: [a, b, done], ranks: [0, 1]}\n"
    config = EngineConfig(worker_processes=True, offload_steps=False)
    async with await AsyncEngine.start(spec, Placement.from_yaml(replicated), config) as engine:
        let_back = asyncio.Event()
        restart = engine._restart

        async def held_back(rank: int) -> None:  # the lost rank stays away until the test is done
            await let_back.wait()
            await restart(rank)

        engine._restart = held_back  # type: ignore[method-assign]
        runs = [engine.run(Request("loop", {})) for _ in range(4)]
        assert [[o.data for o in out] for out in await asyncio.wait_for(asyncio.gather(*runs), 60)] == [[20]] * 4
        assert {rank: stats["a"]["steps"] > 0 for rank, stats in (await engine.stats()).items()} == {0: True, 1: True}
        victim = engine.processes[1]
        assert victim.pid is not None
        os.kill(victim.pid, signal.SIGKILL)
        while engine.ranks_up()[1]:
            await asyncio.sleep(0.01)
        # Half of these would pick rank 1: they run on rank 0 instead, at once.
        runs = [engine.run(Request("loop", {})) for _ in range(4)]
        assert [[o.data for o in out] for out in await asyncio.wait_for(asyncio.gather(*runs), 30)] == [[20]] * 4
        assert engine.ranks_up() == {0: True, 1: False}
        assert (await engine.held_state())["conductor"] == {"requests": 0, "client_queues": 0, "parked_walks": 0}
        let_back.set()
        while not engine.ranks_up()[1]:
            await asyncio.sleep(0.01)
        # Back: the restarted replica takes its share again.
        runs = [engine.run(Request("loop", {})) for _ in range(4)]
        assert [[o.data for o in out] for out in await asyncio.wait_for(asyncio.gather(*runs), 60)] == [[20]] * 4
        assert (await engine.stats())[1]["a"]["steps"] > 0
