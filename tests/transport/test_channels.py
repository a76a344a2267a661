"""Channels and listeners on every scheme: ordering, close semantics, bad input, addresses."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
import pytest
import torch
import zmq
import zmq.asyncio

import mstar.transport  # noqa: F401  (registers the transports)
from mstar.errors import InvalidAddressError, PeerLostError, TransportClosedError
from mstar.transport.base import Channel, Listener, connect, listen, parse_address
from mstar.transport.codec import LinkCodec
from mstar.wire import Ask, ErrorReply, Hello, Ping, Reply, Tell, TensorBundle
from tests.test_messages import nested_ask


def make_codec() -> LinkCodec:
    return LinkCodec(max_message_bytes=1 << 20, shm_min_bytes=1 << 30)


def bind_address(scheme: str) -> str:
    return {
        "inproc": f"inproc://chan-{uuid.uuid4().hex[:8]}",
        "ipc": "ipc://",
        "tcp": "tcp://127.0.0.1:0",
    }[scheme]


@pytest.fixture(params=["inproc", "ipc", "tcp"])
async def linked(
    request: pytest.FixtureRequest,
) -> AsyncIterator[tuple[Listener, Channel, Channel]]:
    listener = listen(bind_address(request.param), make_codec)
    client = connect(listener.address, make_codec())
    client.send(Hello("c", [], 1, "h"))  # a ZeroMQ listener sees a peer on its first message
    server = await asyncio.wait_for(listener.accept(), 5)
    assert isinstance(await asyncio.wait_for(server.recv(), 5), Hello)
    yield listener, client, server
    await client.aclose()
    await listener.aclose()


async def test_messages_arrive_in_order_both_ways(
    linked: tuple[Listener, Channel, Channel],
) -> None:
    _, client, server = linked
    for i in range(50):
        client.send(Tell("a", Ping(i)))
    got = [await asyncio.wait_for(server.recv(), 5) for _ in range(50)]
    assert [m.body.seq for m in got] == list(range(50))  # type: ignore[union-attr]
    server.send(Reply(1, Ping(99)))
    reply = await asyncio.wait_for(client.recv(), 5)
    assert reply == Reply(1, Ping(99))


async def test_tensors_cross_every_channel(linked: tuple[Listener, Channel, Channel]) -> None:
    _, client, server = linked
    x = torch.randn(100, 10)
    client.send(Tell("a", TensorBundle({"x": x})))
    got = await asyncio.wait_for(server.recv(), 5)
    assert isinstance(got, Tell) and isinstance(got.body, TensorBundle)
    assert torch.equal(got.body.tensors["x"], x)


async def test_push_delivery_and_iteration(linked: tuple[Listener, Channel, Channel]) -> None:
    _, client, server = linked
    received: list[object] = []
    done = asyncio.Event()

    def sink(envelope: object) -> None:
        received.append(envelope)
        if len(received) == 3:
            done.set()

    client.send(Tell("a", Ping(0)))
    task = asyncio.create_task(server.deliver(sink))
    client.send(Tell("a", Ping(1)))
    client.send(Tell("a", Ping(2)))
    await asyncio.wait_for(done.wait(), 5)
    await server.aclose()
    await asyncio.wait_for(task, 5)  # deliver returns once the channel closes
    assert [m.body.seq for m in received] == [0, 1, 2]  # type: ignore[attr-defined]


async def test_a_closed_channel_says_so(linked: tuple[Listener, Channel, Channel]) -> None:
    _, client, _ = linked
    await client.aclose()
    await client.aclose()  # idempotent
    assert client.is_closed
    with pytest.raises(TransportClosedError):
        client.send(Tell("a", Ping()))
    with pytest.raises(TransportClosedError):
        await client.recv()
    assert [m async for m in client] == []


async def test_closing_the_listener_ends_accept_and_its_channels(
    linked: tuple[Listener, Channel, Channel],
) -> None:
    listener, _, server = linked
    await listener.aclose()
    assert server.is_closed
    with pytest.raises(TransportClosedError):
        await listener.accept()
    assert [c async for c in listener] == []


async def test_inproc_peers_see_the_other_end_close() -> None:
    listener = listen(bind_address("inproc"), make_codec)
    client = connect(listener.address, make_codec())
    server = await listener.accept()
    client.send(Tell("a", Ping(1)))
    await client.aclose()
    # What was sent before the close still arrives, then the stream ends.
    assert isinstance(await server.recv(), Tell)
    with pytest.raises(TransportClosedError):
        await server.recv()
    await listener.aclose()


async def test_inproc_connect_to_nothing_fails() -> None:
    with pytest.raises(PeerLostError):
        connect("inproc://nobody-here", make_codec())


@pytest.mark.parametrize("scheme", ["ipc", "tcp"])
async def test_malformed_and_oversize_frames_are_rejected_without_harm(scheme: str) -> None:
    listener = listen(bind_address(scheme), make_codec)
    raw = zmq.asyncio.Context.instance().socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(listener.address)
    encode = msgspec.msgpack.encode
    try:
        await raw.send_multipart([encode(["Tell", "a", ["Ping", 0, b""]])])
        server = await asyncio.wait_for(listener.accept(), 5)
        accept = asyncio.create_task(listener.accept())  # keeps reading for the channel
        assert isinstance(await asyncio.wait_for(server.recv(), 5), Tell)
        await raw.send_multipart([b"\xff garbage"])
        await raw.send_multipart([encode(["Ask", "a", 7, ["NotAMessage"]])])
        await raw.send_multipart([encode(["Ask", "a", 8, ["Ping", 0, b""]]), b"x" * (2 << 20)])
        await raw.send_multipart([encode(["Tell", "a", ["Ping", 1, b""]])])
        # The valid message after the bad ones still arrives.
        after = await asyncio.wait_for(server.recv(), 5)
        assert isinstance(after, Tell) and after.body == Ping(1)
        assert server.num_rejected == 3
        # Rejected asks are failed at the sender, by call id.
        replies = [msgspec.msgpack.decode(await asyncio.wait_for(raw.recv(), 5)) for _ in range(2)]
        assert [(r[0], r[1], r[2]) for r in replies] == [
            ("ErrorReply", 7, "ProtocolError"),
            ("ErrorReply", 8, "MessageTooLargeError"),
        ]
        accept.cancel()
        with contextlib.suppress(asyncio.CancelledError, TransportClosedError):
            await accept
    finally:
        raw.close(linger=0)
        await listener.aclose()


async def test_an_ask_nested_too_deep_gets_a_protocol_error_reply() -> None:
    listener = listen(bind_address("ipc"), make_codec)
    raw = zmq.asyncio.Context.instance().socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(listener.address)
    try:
        await raw.send_multipart([msgspec.msgpack.encode(["Tell", "a", ["Ping", 0, b""]])])
        server = await asyncio.wait_for(listener.accept(), 5)
        accept = asyncio.create_task(listener.accept())
        await raw.send_multipart([nested_ask(5_000, call_id=11)])
        reply = msgspec.msgpack.decode(await asyncio.wait_for(raw.recv(), 5))
        assert (reply[0], reply[1], reply[2]) == ("ErrorReply", 11, "ProtocolError")
        assert server.num_rejected == 1
        accept.cancel()
        with contextlib.suppress(asyncio.CancelledError, TransportClosedError):
            await accept
    finally:
        raw.close(linger=0)
        await listener.aclose()


async def test_an_ask_rejected_over_a_channel_reaches_the_client_as_error_reply() -> None:
    listener = listen(bind_address("ipc"), make_codec)
    client = connect(listener.address, LinkCodec(max_message_bytes=8 << 20, shm_min_bytes=1 << 30))
    try:
        client.send(Hello("c", [], 1, "h"))
        server = await asyncio.wait_for(listener.accept(), 5)
        accept = asyncio.create_task(listener.accept())
        client.send(Ask("a", 5, Ping(payload=b"x" * (2 << 20))))
        reply = await asyncio.wait_for(client.recv(), 5)
        assert isinstance(reply, ErrorReply) and reply.call_id == 5
        assert reply.kind == "MessageTooLargeError"
        assert server.num_rejected == 1
        accept.cancel()
        with contextlib.suppress(asyncio.CancelledError, TransportClosedError):
            await accept
    finally:
        await client.aclose()
        await listener.aclose()


async def test_ipc_socket_files_are_private_and_removed_on_close() -> None:
    listener = listen("ipc://", make_codec)
    path = Path(parse_address(listener.address).rest)
    assert path.exists() and path.name.startswith("mstar-")
    assert path.parent.stat().st_mode & 0o077 == 0
    await listener.aclose()
    assert not path.exists()


async def test_a_live_ipc_address_cannot_be_stolen_but_a_stale_one_is_reused(
    tmp_path: Path,
) -> None:
    path = tmp_path / "x.sock"
    first = listen(f"ipc://{path}", make_codec)
    with pytest.raises(InvalidAddressError, match="in use"):
        listen(f"ipc://{path}", make_codec)
    await first.aclose()
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(path))  # a socket file whose owner no longer listens
    stale.close()
    assert path.exists()
    second = listen(f"ipc://{path}", make_codec)
    await second.aclose()


async def test_inproc_names_are_unique() -> None:
    first = listen("inproc://unique-name", make_codec)
    with pytest.raises(InvalidAddressError):
        listen("inproc://unique-name", make_codec)
    await first.aclose()
    await listen("inproc://unique-name", make_codec).aclose()


@pytest.mark.parametrize(
    "address",
    [
        "nothing",
        "udp://127.0.0.1:9",
        "tcp://127.0.0.1",
        "tcp://0.0.0.0:0",
        "tcp://10.1.2.3:0",
        "inproc://",
        "ipc://" + "/x" * 80,
    ],
)
async def test_bad_or_unsafe_addresses_are_refused(address: str) -> None:
    with pytest.raises(InvalidAddressError):
        listen(address, make_codec)


async def test_remote_tcp_binding_is_opt_in() -> None:
    listener = listen("tcp://0.0.0.0:0", make_codec, allow_remote=True)
    assert listener.address.startswith("tcp://0.0.0.0:")
    await listener.aclose()


async def test_ipv6_loopback_and_localhost_bind() -> None:
    for address in ("tcp://localhost:0", "tcp://[::1]:0"):
        try:
            listener = listen(address, make_codec)
        except InvalidAddressError as exc:
            if "::1" in address:
                pytest.skip(f"no IPv6 loopback here: {exc}")
            raise
        client = connect(listener.address, make_codec())
        client.send(Hello("c", [], 1, "h"))
        server = await asyncio.wait_for(listener.accept(), 5)
        assert isinstance(await server.recv(), Hello)
        await client.aclose()
        await listener.aclose()
