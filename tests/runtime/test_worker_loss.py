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
