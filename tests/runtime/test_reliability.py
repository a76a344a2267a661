"""No request left hanging: duplicate ids, early aborts, walks that wait for a lost worker."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

from mstar.actors.wire import ActorId
from mstar.errors import DuplicateRequestError, RequestAbortedError, WorkerLostError
from mstar.runtime import AsyncEngine, EngineConfig, ModelSpec, Placement, Request
from mstar.runtime.conductor import WorkerLost
from mstar.runtime.messages import UpdatePeer
from mstar.runtime.model import PreparedRequest
from mstar.transport.janitor import SHM_DIR, runtime_dir
from mstar.zoo.noop import NoopLoopModel
from tests.helpers import wait_until_idle

TWO_RANKS = "node_groups:\n  - {node_names: [a, done], ranks: [0]}\n  - {node_names: [b], ranks: [1]}\n"


async def start(steps: int, **config: float) -> AsyncEngine:
    spec = ModelSpec("mstar.zoo.noop:NoopLoopModel", {"steps": steps})
    return await AsyncEngine.start(spec, Placement.from_yaml(TWO_RANKS), EngineConfig(offload_steps=False, **config))  # type: ignore[arg-type]


@pytest_asyncio.fixture
async def endless() -> AsyncIterator[AsyncEngine]:
    async with await start(10_000_000) as engine:
        yield engine


async def until(predicate: object, timeout: float = 10.0) -> None:
    async with asyncio.timeout(timeout):
        while not await predicate():  # type: ignore[operator]
            await asyncio.sleep(0.005)


async def test_a_duplicate_id_is_refused_and_the_first_request_keeps_running(endless: AsyncEngine) -> None:
    first = asyncio.ensure_future(endless.run(Request("loop", {}, "dup")))

    async def running() -> bool:
        return (await endless.held_state())["conductor"]["requests"] == 1

    await until(running)
    with pytest.raises(DuplicateRequestError, match="'dup' is already running"):
        await endless.run(Request("loop", {}, "dup"))
    assert not first.done()
    # The first one still owns its stream: aborting it ends that stream (it did not lose it).
    await endless.abort("dup")
    with pytest.raises(RequestAbortedError):
        await asyncio.wait_for(first, 5)
    await wait_until_idle(endless)


async def test_a_duplicate_id_does_not_cut_the_first_requests_outputs() -> None:
    async with await start(3_000) as engine:
        first = asyncio.ensure_future(engine.run(Request("loop", {}, "same")))
        await asyncio.sleep(0)  # submitted
        with pytest.raises(DuplicateRequestError):
            await engine.run(Request("loop", {}, "same"))
        outputs = await asyncio.wait_for(first, 10)
        assert [o.data for o in outputs] == [3_000]


async def test_an_abort_before_the_first_iteration_is_not_lost(endless: AsyncEngine) -> None:
    outputs = endless.generate(Request("loop", {}, "early"))
    await endless.abort("early")
    with pytest.raises(RequestAbortedError, match="'early' was aborted"):
        await asyncio.wait_for(anext(outputs), 5)
    await wait_until_idle(endless)


async def test_walks_for_a_lost_rank_wait_for_its_restart() -> None:
    async with await start(50) as engine:
        assert engine.conductor is not None
        engine.conductor.tell(WorkerLost(1))
        waiting = asyncio.ensure_future(engine.run(Request("loop", {})))

        async def parked() -> bool:
            return (await engine.held_state())["conductor"]["parked_walks"] == 1

        await until(parked)
        worker = engine.workers[1]
        engine.conductor.tell(UpdatePeer(1, ActorId(worker.address, worker.name)))
        outputs = await asyncio.wait_for(waiting, 10)
        assert [o.data for o in outputs] == [50]
        await wait_until_idle(engine)


async def test_a_rank_that_does_not_come_back_fails_its_walks_then_fails_fast() -> None:
    async with await start(50, restart_wait_s=0.2) as engine:
        assert engine.conductor is not None
        engine.conductor.tell(WorkerLost(1))
        with pytest.raises(WorkerLostError, match=r"did not come back within 0\.2 s"):
            await asyncio.wait_for(engine.run(Request("loop", {})), 5)
        with pytest.raises(WorkerLostError, match="did not come back"):
            await asyncio.wait_for(engine.run(Request("loop", {})), 1)
        worker = engine.workers[1]
        engine.conductor.tell(UpdatePeer(1, ActorId(worker.address, worker.name)))
        outputs = await asyncio.wait_for(engine.run(Request("loop", {})), 10)
        assert [o.data for o in outputs] == [50]
        await wait_until_idle(engine)


class SlowPreprocess(NoopLoopModel):
    """Takes a while to prepare each request (as tokenizing a very long text does)."""

    def preprocess(self, request: Request) -> PreparedRequest:
        time.sleep(float(request.data.get("prep_s", 0.0)))
        return super().preprocess(request)


async def test_preprocessing_runs_off_the_event_loop() -> None:
    async with await AsyncEngine.start(SlowPreprocess(steps=5), config=EngineConfig(offload_steps=False)) as engine:
        gaps: list[float] = []

        async def tick() -> None:
            last = time.monotonic()
            while True:
                await asyncio.sleep(0.01)
                now = time.monotonic()
                gaps.append(now - last)
                last = now

        ticker = asyncio.ensure_future(tick())
        outputs = await asyncio.wait_for(engine.run(Request("loop", {"prep_s": 1.5})), 10)
        ticker.cancel()
        assert [o.data for o in outputs] == [5]
        assert max(gaps) < 0.75, f"the loop stalled for {max(gaps):.2f} s"  # rather than 1.5 s


async def test_an_engine_start_removes_what_killed_processes_left() -> None:
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True)
    pid = int(dead.stdout)
    stale = [SHM_DIR / f"mstar-{pid}-0123456789ab", runtime_dir() / f"mstar-{pid}-0123456789ab.sock"]
    for path in stale:
        path.write_bytes(b"")
    async with await start(3):
        assert not any(path.exists() for path in stale)


@pytest.mark.timeout(120)
def test_worker_processes_without_a_main_guard_say_how_to_fix_it(tmp_path: Path) -> None:
    script = tmp_path / "no_guard.py"
    script.write_text(
        "import asyncio\n"
        "from mstar import AsyncEngine, EngineConfig, ModelSpec\n"
        "spec = ModelSpec('mstar.zoo.noop:NoopLoopModel', {'steps': 3})\n"
        "asyncio.run(AsyncEngine.start(spec, config=EngineConfig(worker_processes=True)))\n"
    )
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=100, cwd=tmp_path)
    assert done.returncode != 0
    assert "MissingMainGuardError" in done.stderr
    assert 'if __name__ == "__main__":' in done.stderr
    assert "PeerLostError" not in done.stderr
