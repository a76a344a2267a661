"""Actor tests run on both event loops; the `transport` fixture runs them over every scheme."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass

import pytest
import uvloop

from mstar.actors import ActorSystem, SystemConfig
from tests.actors.peer_actors import setup

# Short heartbeats keep failure tests quick; a small arena keeps start-up cheap.
TEST_CONFIG = SystemConfig(
    heartbeat_interval_s=0.05,
    heartbeat_timeout_s=3.0,
    shm_arena_bytes=8 << 20,
    shm_min_tensor_bytes=4096,
    stop_timeout_s=2.0,
)


def pytest_asyncio_loop_factories(
    config: pytest.Config, item: pytest.Item
) -> Mapping[str, Callable[[], asyncio.AbstractEventLoop]]:
    return {"asyncio": asyncio.new_event_loop, "uvloop": uvloop.new_event_loop}


def bind_address(scheme: str) -> str:
    """An address to serve on: a fresh inproc name, a private ipc path, a free loopback port."""
    return {
        "inproc": f"inproc://test-{uuid.uuid4().hex[:8]}",
        "ipc": "ipc://",
        "tcp": "tcp://127.0.0.1:0",
    }[scheme]


@pytest.fixture(params=["inproc", "ipc", "tcp"])
def transport(request: pytest.FixtureRequest) -> str:
    """The scheme a test's two actor systems talk over."""
    return str(request.param)


@dataclass
class Linked:
    """A server system running the peer actors, and a client system linked to it."""

    server: ActorSystem
    client: ActorSystem
    address: str


@pytest.fixture
async def linked(transport: str) -> AsyncIterator[Linked]:
    async with ActorSystem(TEST_CONFIG) as server, ActorSystem(TEST_CONFIG) as client:
        address = await server.serve(bind_address(transport))
        await setup(server)
        await client.connect(address, timeout=5)
        yield Linked(server, client, address)
