"""A tcp link whose peer process dies is lost at once (its connection closed), not at the heartbeat
timeout."""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace

import pytest

from mstar.actors import ActorSystem
from mstar.actors.process import SystemProcess
from mstar.errors import PeerLostError
from mstar.wire import Ping, Pong
from tests.actors.conftest import TEST_CONFIG

# Heartbeats alone would take 30 s to give the peer up.
PATIENT = replace(TEST_CONFIG, heartbeat_interval_s=0.5, heartbeat_timeout_s=30.0)


@pytest.mark.slow
async def test_a_killed_peer_fails_pending_asks_and_tells_the_listeners() -> None:
    peer = SystemProcess(
        "tests.actors.peer_actors:setup", serve=["tcp://127.0.0.1:0"], config=PATIENT
    )
    address = (await asyncio.to_thread(peer.start))[0]
    lost: list[tuple[list[str], Exception]] = []
    try:
        async with ActorSystem(PATIENT) as client:
            client.on_link_lost(lambda addresses, error: lost.append((addresses, error)))
            await client.connect(address, timeout=10)
            assert await client.ref("echo", address).ask(Pong()) == Pong(peer.pid)
            pending = asyncio.ensure_future(client.ref("stall", address).ask(Ping(), timeout=None))
            await asyncio.sleep(0.1)  # the ask is on its way
            killed = time.monotonic()
            await asyncio.to_thread(peer.kill)
            with pytest.raises(PeerLostError):
                await asyncio.wait_for(pending, 10)
            assert time.monotonic() - killed < 5.0  # far sooner than the 30 s heartbeat timeout
            assert lost and address in lost[0][0] and isinstance(lost[0][1], PeerLostError)
    finally:
        await asyncio.to_thread(peer.stop)
