"""Peers in processes started with `spawn`: calls, tensors, graceful stop, kill, clean-up."""

from __future__ import annotations

import asyncio
import gc
import os
import signal
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from mstar.actors import ActorSystem
from mstar.actors.process import SystemProcess
from mstar.errors import ActorDeadError, ActorHandlerError, PeerLostError
from mstar.transport.base import parse_address
from mstar.transport.janitor import SHM_DIR
from mstar.wire import Ping, Pong, TensorBundle
from tests.actors.conftest import TEST_CONFIG

SETUP = "tests.actors.peer_actors:setup"
SERVE = ["ipc://", "tcp://127.0.0.1:0"]
# A loaded machine may starve a process for a while: the shared peer's links are patient.
PATIENT = replace(TEST_CONFIG, heartbeat_interval_s=0.2, heartbeat_timeout_s=20.0)
# The side that must notice a killed peer wants a quick verdict.
QUICK = replace(TEST_CONFIG, heartbeat_interval_s=0.05, heartbeat_timeout_s=1.5)
# A peer that stops quickly, and never gives up on its client first.
STOPS_FAST = replace(PATIENT, stop_timeout_s=0.2)


@pytest.fixture(scope="module")
def peer() -> Iterator[SystemProcess]:
    """One peer process for the module, on uvloop (the test side runs both loops)."""
    process = SystemProcess(SETUP, serve=SERVE, config=PATIENT, loop="uvloop")
    process.start()
    yield process
    process.stop()


@pytest.mark.parametrize("scheme", ["ipc", "tcp"])
async def test_calls_reach_another_process(peer: SystemProcess, scheme: str) -> None:
    address = peer.addresses[SERVE.index(next(a for a in SERVE if a.startswith(scheme)))]
    async with ActorSystem(PATIENT) as client:
        await client.connect(address)
        echo = client.ref("echo", address)
        assert await echo.ask(Pong()) == Pong(peer.pid)
        assert peer.pid != os.getpid()
        counter = client.ref("counter", address)
        before = (await counter.ask(Pong())).seq
        for i in range(100):
            counter.tell(Ping(i))
        assert (await counter.ask(Pong())).seq == before + 100
        with pytest.raises(ActorHandlerError, match="ValueError"):
            await client.ref("failing", address).ask(Ping())


@pytest.mark.parametrize("scheme", ["ipc", "tcp"])
async def test_tensors_cross_processes_through_shared_memory(
    peer: SystemProcess, scheme: str
) -> None:
    address = next(a for a in peer.addresses if a.startswith(scheme))
    async with ActorSystem(PATIENT) as client:
        await client.connect(address)
        link = client._routes[address]
        assert link.codec is not None and link.codec.peer_arena is not None
        x = torch.randn(512, 256)  # 512 KiB
        reply = await client.ref("echo", address).ask(TensorBundle({"x": x, "i": torch.arange(5)}))
        assert torch.equal(reply.tensors["x"], x * 2)
        assert torch.equal(reply.tensors["i"], torch.arange(5) * 2)
        # The answer came back through the peer's arena: a zero-copy view of its slot.
        assert link.codec.peer_arena is not None
        del reply
        gc.collect()
        await client.ref("echo", address).ask(Ping())
        assert client._arena is not None and client._arena.allocator.num_allocated == 0


# Each of these starts its own process (seconds each): one event loop apiece is enough.
@pytest.mark.asyncio(loop_factories=["asyncio"])
async def test_a_peer_stopped_gracefully_fails_pending_asks_at_once() -> None:
    process = SystemProcess(SETUP, serve=["ipc://"], config=STOPS_FAST)
    (address,) = await asyncio.to_thread(process.start)
    try:
        async with ActorSystem(PATIENT) as client:
            await client.connect(address)
            pending = asyncio.ensure_future(client.ref("stall", address).ask(Ping()))
            await client.ref("echo", address).ask(Ping())  # the stalled ask has arrived
            started = time.monotonic()
            await asyncio.to_thread(process.stop)
            with pytest.raises(ActorDeadError):
                await asyncio.wait_for(pending, 10)
            # Well under the client's 20 s heartbeat timeout: the peer said goodbye.
            assert time.monotonic() - started < 10
    finally:
        process.kill()


@pytest.mark.asyncio(loop_factories=["uvloop"])
async def test_a_killed_peer_fails_pending_asks_and_its_files_are_removed() -> None:
    process = SystemProcess(SETUP, serve=SERVE, config=STOPS_FAST)
    ipc, tcp = await asyncio.to_thread(process.start)
    try:
        async with ActorSystem(QUICK) as client:
            await client.connect(ipc)
            await client.connect(tcp)
            peer_hello = client._routes[ipc].peer
            assert peer_hello is not None and peer_hello.arena is not None
            segment = SHM_DIR / peer_hello.arena.name
            socket_file = Path(parse_address(ipc).rest)
            assert segment.exists() and socket_file.exists()
            pending = [
                asyncio.ensure_future(client.ref("stall", address).ask(Ping(), timeout=None))
                for address in (ipc, tcp)
            ]
            await client.ref("echo", ipc).ask(Ping())
            await client.ref("echo", tcp).ask(Ping())
            started = time.monotonic()
            process.kill()
            for future in pending:
                with pytest.raises(PeerLostError):
                    await asyncio.wait_for(future, 10)
            elapsed = time.monotonic() - started
            # bounded, with room for a loaded machine
            assert elapsed < QUICK.heartbeat_timeout_s + 5.0
            # The surviving side removed what the dead process left behind.
            assert not segment.exists() and not socket_file.exists()
    finally:
        process.kill()


def test_a_child_that_fails_to_set_up_reports_it() -> None:
    process = SystemProcess(
        "tests.actors.peer_actors:no_such_setup", serve=["ipc://"], config=PATIENT
    )
    with pytest.raises(PeerLostError, match="no_such_setup"):
        process.start()
    assert not process.is_alive


# Heartbeats that would give a silent peer up after 1 s, and one that would take 10 minutes.
STRICT = replace(TEST_CONFIG, heartbeat_interval_s=0.05, heartbeat_timeout_s=1.0)
LAX = replace(TEST_CONFIG, heartbeat_interval_s=0.05, heartbeat_timeout_s=600.0)


@pytest.mark.slow
async def test_a_peer_whose_loop_is_blocked_past_the_heartbeat_timeout_is_not_lost() -> None:
    process = SystemProcess(SETUP, serve=["ipc://"], config=STRICT)
    (ipc,) = await asyncio.to_thread(process.start)
    try:
        async with ActorSystem(STRICT) as client:
            await client.connect(ipc)
            link = client._routes[ipc]
            # The peer's loop is held for 3 heartbeat timeouts (no heartbeat leaves it): its
            # process is alive, so it is busy, not lost.
            assert await client.ref("hog", ipc).ask(Ping(3000), timeout=None) == Pong(3000)
            assert not link.is_closed and client._routes[ipc] is link
            assert await client.ref("echo", ipc).ask(Ping(1)) == Pong(1)
    finally:
        process.kill()


async def test_a_killed_peer_on_this_host_is_lost_without_waiting_for_the_heartbeat_timeout() -> (
    None
):
    process = SystemProcess(SETUP, serve=["ipc://"], config=LAX)
    (ipc,) = await asyncio.to_thread(process.start)
    try:
        async with ActorSystem(LAX) as client:
            await client.connect(ipc)
            pending = asyncio.ensure_future(client.ref("stall", ipc).ask(Ping(), timeout=None))
            await client.ref("echo", ipc).ask(Ping())
            assert process.pid is not None
            killed = time.monotonic()
            os.kill(process.pid, signal.SIGKILL)  # not reaped: a zombie counts as dead
            # Heartbeats alone would wait 600 s (ipc has no connection to see closing).
            with pytest.raises(PeerLostError, match="exited"):
                await asyncio.wait_for(pending, 60)
            print(f"killed peer lost after {time.monotonic() - killed:.3f} s")
    finally:
        process.kill()
