"""Actors in two systems linked over every transport (inproc, ipc, tcp) and both loops."""

from __future__ import annotations

import asyncio
import gc
import logging
from dataclasses import replace
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch
import zmq
import zmq.asyncio

from mstar.actors import Actor, ActorSystem
from mstar.errors import (
    ActorDeadError,
    ActorHandlerError,
    ActorNotFoundError,
    AskTimeoutError,
    MailboxFullError,
    MessageTooLargeError,
    PeerLostError,
    ProtocolError,
    TransportClosedError,
)
from mstar.transport.base import parse_address
from mstar.wire import Ack, ArenaRelease, Ping, Pong, Reply, TensorBundle
from tests.actors.conftest import TEST_CONFIG, Linked, bind_address
from tests.actors.peer_actors import setup


class Gate(Actor):
    """Answer each message only once the test opens the gate."""

    def __init__(self) -> None:
        self.entered = asyncio.Event()
        self.gate = asyncio.Event()

    async def handle(self, message: Any) -> Any:
        self.entered.set()
        await self.gate.wait()
        return Ack()


async def test_ask_and_ordered_tells(linked: Linked) -> None:
    echo = linked.client.ref("echo", linked.address)
    assert await echo.ask(Ping(5, b"hello")) == Pong(5, b"hello")
    counter = linked.client.ref("counter", linked.address)
    for i in range(200):
        counter.tell(Ping(i))
    assert await counter.ask(Pong()) == Pong(200)
    answers = await asyncio.gather(*(echo.ask(Ping(i)) for i in range(100)))
    assert [a.seq for a in answers] == list(range(100))


async def test_tensors_round_trip_and_arena_slots_come_back(linked: Linked, transport: str) -> None:
    echo = linked.client.ref("echo", linked.address)
    tensors = {
        "big": torch.randn(256, 64),  # 64 KiB: through the shared arena on ipc/tcp
        "small": torch.arange(10, dtype=torch.int32),
        "bf16": torch.randn(3000, dtype=torch.bfloat16),
        "strided": torch.randn(64, 128).t(),
    }
    reply = await echo.ask(TensorBundle(tensors, key="r1"))
    assert isinstance(reply, TensorBundle) and reply.key == "r1"
    for name, tensor in tensors.items():
        assert torch.equal(reply.tensors[name], tensor * 2), name
    del reply
    gc.collect()
    # Arena releases travel ahead of the next message on the same link. The reply's views
    # may outlive `del` until the loop turns (uvloop holds the finished future a moment), so
    # the second round trip is the one they surely precede.
    await echo.ask(Ping())
    await echo.ask(Ping())
    for system in (linked.client, linked.server):
        arena = system._arena
        if transport == "inproc":
            assert arena is None
        else:
            assert arena is not None and arena.allocator.num_allocated == 0


async def test_each_system_counts_the_tensor_bytes_its_links_moved(
    linked: Linked, transport: str
) -> None:
    echo = linked.client.ref("echo", linked.address)
    await echo.ask(Ping())  # both arenas are attached once a round trip went through
    # 64 KiB: arena; 40 B: frame
    big, small = torch.randn(256, 64), torch.arange(10, dtype=torch.int32)
    reply = await echo.ask(TensorBundle({"big": big, "small": small}))
    assert isinstance(reply, TensorBundle)
    client, server = linked.client.transport_tally, linked.server.transport_tally
    if transport == "inproc":  # by reference: nothing moved, nothing counted
        assert not any(client.sent.values()) and not any(server.received.values())
        return
    moved = {"ipc": 0, "tcp": 0, "shm": 256 * 64 * 4, "cuda_ipc": 0} | {transport: 10 * 4}
    # the request one way, the doubled tensors (same sizes) back
    assert client.sent == server.received == server.sent == client.received == moved


async def test_a_failing_remote_handler_fails_that_ask(linked: Linked) -> None:
    failing = linked.client.ref("failing", linked.address)
    with pytest.raises(ActorHandlerError, match="cannot handle Ping") as info:
        await failing.ask(Ping())
    assert info.value.error_type == "ValueError"
    assert await linked.client.ref("echo", linked.address).ask(Ping(1)) == Pong(1)


async def test_unknown_remote_actors(linked: Linked) -> None:
    nobody = linked.client.ref("nobody", linked.address)
    with pytest.raises(ActorDeadError, match="nobody"):
        await nobody.ask(Ping())
    nobody.tell(Ping())  # dropped at the peer, which keeps serving
    assert await linked.client.lookup("echo", address=linked.address) == linked.client.ref(
        "echo", linked.address
    )
    with pytest.raises(ActorNotFoundError):
        await linked.client.lookup("nobody", address=linked.address)


async def test_only_wire_messages_cross_systems(linked: Linked) -> None:
    echo = linked.client.ref("echo", linked.address)
    with pytest.raises(ProtocolError, match="not a wire message"):
        echo.tell({"a": 1})
    with pytest.raises(ProtocolError, match="not a wire message"):
        await echo.ask("text")
    with pytest.raises(ProtocolError, match="reply of type dict"):
        await linked.client.ref("bad-reply", linked.address).ask(Ping())


async def test_remote_mailbox_full_and_stop_fail_queued_asks(linked: Linked) -> None:
    gate = Gate()
    await linked.server.spawn(lambda: gate, name="gate", mailbox_size=1)
    ref = linked.client.ref("gate", linked.address)
    first = asyncio.ensure_future(ref.ask(Ping(1)))
    await gate.entered.wait()
    queued = asyncio.ensure_future(ref.ask(Ping(2)))
    # The third finds the mailbox full (the second is queued once the Pong below returns).
    await linked.client.ref("echo", linked.address).ask(Ping())
    with pytest.raises(MailboxFullError):
        await ref.ask(Ping(3))
    stopping = asyncio.ensure_future(linked.server.stop("gate"))
    with pytest.raises(ActorDeadError):
        await queued
    gate.gate.set()
    assert await first == Ack()
    await stopping


async def test_remote_ask_timeout_leaves_the_link_usable(linked: Linked) -> None:
    gate = Gate()
    await linked.server.spawn(lambda: gate, name="gate")
    with pytest.raises(AskTimeoutError):
        await linked.client.ref("gate", linked.address).ask(Ping(), timeout=0.05)
    gate.gate.set()
    assert await linked.client.ref("echo", linked.address).ask(Ping(2)) == Pong(2)


async def test_refs_travel_as_ids(linked: Linked) -> None:
    echo = linked.client.ref("echo", linked.address)
    assert linked.client.ref(echo.id) == echo
    # The server's own refs use the address the client dialled.
    assert linked.server.ref("echo") == echo


async def test_server_shutdown_fails_pending_asks_and_later_connects(transport: str) -> None:
    async with ActorSystem(TEST_CONFIG) as client:
        lost = asyncio.Event()
        client.on_link_lost(lambda addresses, error: lost.set())
        async with ActorSystem(replace(TEST_CONFIG, stop_timeout_s=0.05)) as server:
            address = await server.serve(bind_address(transport))
            gate = Gate()
            await server.spawn(lambda: gate, name="gate")
            await client.connect(address)
            pending = asyncio.ensure_future(client.ref("gate", address).ask(Ping()))
            await gate.entered.wait()
        # The server cancelled the stuck handler and said so before it said goodbye.
        with pytest.raises(ActorDeadError):
            await asyncio.wait_for(pending, 5)
        # Once the goodbye is in (a busy machine may take its time), a connect opens a new
        # link, which nothing answers.
        await asyncio.wait_for(lost.wait(), 60)
        with pytest.raises(PeerLostError):
            await client.connect(address, timeout=0.2)


async def test_a_closed_system_refuses_to_send(linked: Linked) -> None:
    ref = linked.client.ref("echo", linked.address)
    await linked.client.__aexit__(None, None, None)
    with pytest.raises(TransportClosedError):
        ref.tell(Ping())
    with pytest.raises(TransportClosedError):
        await ref.ask(Ping())


async def test_oversize_messages_fail_at_the_sender(transport: str) -> None:
    if transport == "inproc":
        pytest.skip("in-process links pass objects by reference: there is nothing to measure")
    small = replace(TEST_CONFIG, max_message_bytes=64 << 10)
    async with ActorSystem(small) as server, ActorSystem(TEST_CONFIG) as client:
        address = await server.serve(bind_address(transport))
        await server.spawn(lambda: Gate(), name="gate")
        await client.connect(address)
        echo = client.ref("gate", address)
        # The client learned the server's limit at the handshake.
        with pytest.raises(MessageTooLargeError):
            await echo.ask(Ping(payload=b"x" * (100 << 10)))
        with pytest.raises(MessageTooLargeError):
            echo.tell(Ping(payload=b"x" * (100 << 10)))


async def test_idle_links_stay_up_on_heartbeats(transport: str) -> None:
    quick = replace(TEST_CONFIG, heartbeat_interval_s=0.02, heartbeat_timeout_s=0.2)
    async with ActorSystem(quick) as server, ActorSystem(quick) as client:
        address = await server.serve(bind_address(transport))
        await server.spawn(lambda: Gate(), name="gate")
        await client.connect(address)
        link = client._routes[address]
        await asyncio.sleep(0.5)  # idle for more than two heartbeat timeouts
        assert not link.is_closed and client._routes[address] is link


async def test_connecting_to_nobody_fails_fast(transport: str) -> None:
    async with ActorSystem(replace(TEST_CONFIG, heartbeat_timeout_s=0.3)) as client:
        address = {
            "inproc": "inproc://nobody",
            "ipc": "ipc:///tmp/mstar-test-nobody.sock",
            "tcp": "tcp://127.0.0.1:9",
        }[transport]
        with pytest.raises(PeerLostError):
            await client.connect(address, timeout=0.2)
        if transport != "inproc":
            # Asks queue until the heartbeat timeout declares the peer lost.
            with pytest.raises(PeerLostError):
                await client.ref("echo", address).ask(Ping(), timeout=5)


async def until(condition: Any, timeout: float = 5.0) -> None:
    """Wait for `condition()` to hold, checking every few milliseconds."""
    async with asyncio.timeout(timeout):
        while not condition():
            await asyncio.sleep(0.005)


async def test_a_peer_declared_lost_is_told_and_reconnects(transport: str) -> None:
    impatient = replace(TEST_CONFIG, heartbeat_interval_s=0.02, heartbeat_timeout_s=0.2)
    quiet = replace(TEST_CONFIG, heartbeat_interval_s=5.0, heartbeat_timeout_s=10.0)
    async with ActorSystem(impatient) as server, ActorSystem(quiet) as client:
        address = await server.serve(bind_address(transport))
        await server.spawn(lambda: Gate(), name="gate")
        await client.connect(address)
        link = client._routes[address]
        # The client says nothing for longer than the server waits: the server drops the
        # link and says so, and the client's next message opens a new one.
        await until(lambda: link.is_closed)
        assert address not in client._routes
        assert await client.lookup("gate", address=address) == client.ref("gate", address)
        assert client._routes[address] is not link


async def test_garbage_from_one_peer_does_not_harm_another(transport: str) -> None:
    if transport == "inproc":
        pytest.skip("in-process links carry objects, not frames")
    async with ActorSystem(TEST_CONFIG) as server, ActorSystem(TEST_CONFIG) as client:
        address = await server.serve(bind_address(transport))
        await server.spawn(lambda: Gate(), name="gate")
        await setup(server)
        await client.connect(address)
        echo = client.ref("echo", address)
        raw = zmq.asyncio.Context.instance().socket(zmq.DEALER)
        raw.setsockopt(zmq.LINGER, 0)
        raw.connect(address)
        try:
            for frames in (
                [b"\xc1"],
                [b""],
                [msgspec.msgpack.encode(["Ask", "echo", 1, ["Nope"]])],
                [b"x" * 100_000],
            ):
                await raw.send_multipart(frames)
                assert await echo.ask(Ping(1)) == Pong(1)
            # The malformed ask was failed by call id.
            reply = msgspec.msgpack.decode(await asyncio.wait_for(raw.recv(), 5))
            assert reply[:3] == ["ErrorReply", 1, "ProtocolError"]
            # A valid message from a peer that skipped the handshake closes its link, with a reason.
            await raw.send_multipart([msgspec.msgpack.encode(["Tell", "echo", ["Ping", 0, b""]])])
            goodbye = msgspec.msgpack.decode(await asyncio.wait_for(raw.recv(), 5))
            assert goodbye[0] == "Goodbye" and "handshake" in goodbye[1]
        finally:
            raw.close(linger=0)
        assert await echo.ask(Ping(2)) == Pong(2)


async def test_shutdown_removes_socket_files_and_segments() -> None:
    async with ActorSystem(TEST_CONFIG) as system:
        address = await system.serve("ipc://")
        assert system._arena is not None
        files = [Path(parse_address(address).rest), system._arena.path]
        assert all(f.exists() for f in files)
    assert not any(f.exists() for f in files)


async def test_envelopes_arriving_after_a_link_was_given_up_are_ignored(
    linked: Linked, caplog: pytest.LogCaptureFixture
) -> None:
    link = linked.client._routes[linked.address]
    link.lose(PeerLostError("given up"))
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        # On a live link this release would be a protocol violation.
        link.on_envelope(ArenaRelease([0]))
        link.on_envelope(Reply(1, Pong()))
    assert not caplog.records
    assert await linked.client.ref("echo", linked.address).ask(Ping(3)) == Pong(3)
