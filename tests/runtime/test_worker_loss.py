"""A worker process that dies fails the requests using it, with a typed error, and comes back;
while it is down, requests that need it fail fast (503 with Retry-After over HTTP)."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from mstar.client import Client
from mstar.errors import WorkerUnavailableError
from mstar.runtime import AsyncEngine, EngineConfig, ModelSpec, Placement, Request
from tests.server.conftest import RunningServer, running_server

TWO_RANKS = (
    "node_groups:\n  - {node_names: [a, done], ranks: [0]}\n  - {node_names: [b], ranks: [1]}\n"
)


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
        killed = time.monotonic()
        with pytest.raises(WorkerUnavailableError, match="rank 1 died") as lost:
            await asyncio.wait_for(running, 30)
        print(
            f"the stream using the killed worker ended {time.monotonic() - killed:.3f} s "
            "after the kill"
        )
        assert lost.value.rank == 1 and lost.value.retry_after_s >= 1
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


def hold_restarts(engine: AsyncEngine) -> threading.Event:
    """Keep a lost rank down until the returned event is set (from any thread)."""
    let_back = threading.Event()
    restart = engine.ranks._restart

    async def held_back(rank: int) -> None:
        # short waits: a shutdown can cancel it
        while not await asyncio.to_thread(let_back.wait, 0.5):
            pass
        await restart(rank)

    engine.ranks._restart = held_back  # type: ignore[method-assign]
    return let_back


@pytest.mark.timeout(240)
async def test_requests_sent_while_a_worker_is_down_fail_fast_and_run_once_it_is_back() -> None:
    spec = ModelSpec("mstar.zoo.noop:NoopLoopModel", {"steps": 20})
    config = EngineConfig(worker_processes=True, offload_steps=False)
    async with await AsyncEngine.start(spec, Placement.from_yaml(TWO_RANKS), config) as engine:
        assert [o.data for o in await engine.run(Request("loop", {}))] == [20]
        let_back = hold_restarts(engine)
        victim = engine.processes[1]
        assert victim.pid is not None
        os.kill(victim.pid, signal.SIGKILL)
        while engine.ranks_up()[1]:
            await asyncio.sleep(0.01)
        # Not held for restart_wait_s (60 s): refused now, naming the rank and when to retry.
        for _ in range(3):
            with pytest.raises(WorkerUnavailableError, match="rank 1 is down") as refused:
                await asyncio.wait_for(engine.run(Request("loop", {})), 30)
            assert refused.value.rank == 1 and refused.value.retry_after_s >= 1
        print(f"retry after {refused.value.retry_after_s} s")
        # While the worker is away, stats answer at once without it.
        stats = await asyncio.wait_for(engine.engine_stats(), 5)
        assert stats.missing_ranks == [1] and 0 in stats.nodes
        assert (await engine.held_state())["conductor"] == {
            "requests": 0,
            "client_queues": 0,
            "parked_walks": 0,
        }
        let_back.set()
        while not engine.ranks_up()[1]:
            await asyncio.sleep(0.01)
        # The first request once it is back runs (no stale failure).
        assert [o.data for o in await asyncio.wait_for(engine.run(Request("loop", {})), 60)] == [20]
        assert engine.num_restarts == 1


@pytest.mark.timeout(240)
async def test_requests_for_a_lost_replica_run_on_the_live_one_without_waiting() -> None:
    spec = ModelSpec("mstar.zoo.noop:NoopLoopModel", {"steps": 20})
    replicated = "node_groups:\n  - {node_names: [a, b, done], ranks: [0, 1]}\n"
    config = EngineConfig(worker_processes=True, offload_steps=False)
    async with await AsyncEngine.start(spec, Placement.from_yaml(replicated), config) as engine:
        let_back = asyncio.Event()
        restart = engine.ranks._restart

        async def held_back(rank: int) -> None:  # the lost rank stays away until the test is done
            await let_back.wait()
            await restart(rank)

        engine.ranks._restart = held_back  # type: ignore[method-assign]
        runs = [engine.run(Request("loop", {})) for _ in range(4)]
        assert [
            [o.data for o in out] for out in await asyncio.wait_for(asyncio.gather(*runs), 60)
        ] == [[20]] * 4
        assert {
            rank: stats["a"]["steps"] > 0 for rank, stats in (await engine.stats()).items()
        } == {0: True, 1: True}
        victim = engine.processes[1]
        assert victim.pid is not None
        os.kill(victim.pid, signal.SIGKILL)
        while engine.ranks_up()[1]:
            await asyncio.sleep(0.01)
        # Half of these would pick rank 1: they run on rank 0 instead, at once.
        runs = [engine.run(Request("loop", {})) for _ in range(4)]
        assert [
            [o.data for o in out] for out in await asyncio.wait_for(asyncio.gather(*runs), 30)
        ] == [[20]] * 4
        assert engine.ranks_up() == {0: True, 1: False}
        assert (await engine.held_state())["conductor"] == {
            "requests": 0,
            "client_queues": 0,
            "parked_walks": 0,
        }
        let_back.set()
        while not engine.ranks_up()[1]:
            await asyncio.sleep(0.01)
        # Back: the restarted replica takes its share again.
        runs = [engine.run(Request("loop", {})) for _ in range(4)]
        assert [
            [o.data for o in out] for out in await asyncio.wait_for(asyncio.gather(*runs), 60)
        ] == [[20]] * 4
        assert (await engine.stats())[1]["a"]["steps"] > 0


@pytest.fixture
def two_rank_server() -> Iterator[RunningServer]:
    # Each request takes 200 steps of at least 20 ms on rank 1: long enough to be caught running.
    spec = ModelSpec("mstar.zoo.noop:NoopLoopModel", {"steps": 200, "delay_s": 0.02})
    engine = EngineConfig(worker_processes=True, offload_steps=False)
    with running_server(
        spec, placement=Placement.from_yaml(TWO_RANKS), engine_config=engine, names=("noop",)
    ) as server:
        yield server


def assert_retryable(answer: httpx.Response) -> None:
    assert answer.status_code == 503, answer.text
    retry_after = answer.headers["retry-after"]
    error = answer.json()["error"]
    assert (error["mstar_error"], error["rank"], error["retry_after_s"]) == (
        "WorkerUnavailableError",
        1,
        int(retry_after),
    )
    assert int(retry_after) >= 1 and "rank 1" in error["message"]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_over_http_a_lost_worker_is_a_503_with_retry_after_naming_the_rank(
    two_rank_server: RunningServer,
) -> None:
    server = two_rank_server
    engine = server.state.engine
    let_back = hold_restarts(engine)
    with (
        httpx.Client(base_url=server.url, timeout=60) as http,
        Client(server.url, timeout=60) as client,
    ):
        # In flight when its worker dies (no output yet): 503, not 500.
        in_flight: list[httpx.Response] = []
        sender = threading.Thread(target=lambda: in_flight.append(http.post("/generate", json={})))
        sender.start()
        while server.held_state()["rank1"]["runners"] == 0:
            time.sleep(0.01)
        victim = engine.processes[1].pid
        assert victim is not None
        os.kill(victim, signal.SIGKILL)
        sender.join(60)
        assert_retryable(in_flight[0])
        assert "died" in in_flight[0].json()["error"]["message"]
        # Sent while it is down: refused at once, the same way; mstar.client raises the type.
        assert_retryable(http.post("/generate", json={}))
        with pytest.raises(WorkerUnavailableError) as refused:
            client.run()
        assert refused.value.rank == 1 and refused.value.retry_after_s >= 1
        let_back.set()
        deadline = time.monotonic() + 120
        while http.get("/health").status_code != 200:
            assert time.monotonic() < deadline, "the worker did not come back"
            time.sleep(0.05)
        # Back: the next request runs (no stale failure).
        assert [out.value for out in client.run()] == [200]
