"""CURVE on tcp links: peers with the deployment's keys talk; a client without them cannot."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import msgspec
import pytest
import zmq
import zmq.asyncio

from mstar.actors import ActorSystem
from mstar.errors import PeerLostError
from mstar.transport.curve import CurveKeys
from mstar.wire import Ping, Pong, Tell
from tests.actors.conftest import TEST_CONFIG
from tests.actors.peer_actors import setup

KEYS = CurveKeys.generate()
SECURE = replace(TEST_CONFIG, curve=KEYS)


async def test_peers_holding_the_keys_talk() -> None:
    async with ActorSystem(SECURE) as server, ActorSystem(SECURE) as client:
        address = await server.serve("tcp://127.0.0.1:0")
        await setup(server)
        await client.connect(address, timeout=5)
        assert await client.ref("echo", address).ask(Ping(3, b"x")) == Pong(3, b"x")


@pytest.mark.parametrize(
    "client_config",
    [
        TEST_CONFIG,  # no keys at all: plain tcp against a CURVE server
        replace(TEST_CONFIG, curve=CurveKeys.generate()),  # another deployment's keys
        # not our client
        replace(TEST_CONFIG, curve=replace(KEYS, client_public=CurveKeys.generate().client_public)),
    ],
    ids=["no-keys", "other-deployment", "unknown-client"],
)
async def test_a_client_without_the_keys_cannot_talk(client_config: object) -> None:
    async with ActorSystem(SECURE) as server, ActorSystem(client_config) as client:  # type: ignore[arg-type]
        address = await server.serve("tcp://127.0.0.1:0")
        await setup(server)
        with pytest.raises(PeerLostError):
            await client.connect(address, timeout=1.0)
        counter = client.ref("counter", address)
        counter.tell(Ping(1))
        await asyncio.sleep(0.2)  # time to arrive, were it let through
        assert await server.ref("counter").ask(Pong()) == Pong(0)  # it never reached an actor


async def test_a_raw_socket_without_the_keys_reaches_nothing() -> None:
    async with ActorSystem(SECURE) as server:
        address = await server.serve("tcp://127.0.0.1:0")
        await setup(server)
        ctx = zmq.asyncio.Context.instance()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(address)
        try:
            await sock.send(msgspec.msgpack.encode(Tell("counter", Ping(1))))
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(sock.recv(), 0.5)
        finally:
            sock.close()
        assert await server.ref("counter").ask(Pong()) == Pong(0)


def test_keys_do_not_print_their_secrets() -> None:
    assert KEYS.server_secret not in repr(KEYS) and KEYS.client_secret not in repr(KEYS)
