"""ZeroMQ transports (`ipc://PATH`, `tcp://HOST:PORT`) on pyzmq asyncio sockets.

A listener is one ROUTER socket; each peer that connects (a DEALER) becomes one channel,
told apart by the identity frame ROUTER puts in front of its messages:

    DEALER --[frame0 header][tensor frames...]--> ROUTER --[identity][frame0][...]--> channel

Tensor frames are sent without copying (`copy=False`) and received as zmq frames that the
decoded tensors view directly. High-water marks are off: ROUTER silently drops messages to a
peer over its mark, which would lose replies; flow control belongs to the actors' bounded
mailboxes.

Binding is to loopback only unless `allow_remote`; `ipc://` alone picks a private socket
path, and a socket file left by a dead process is replaced, never one a live process serves.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import zmq
import zmq.asyncio

from mstar.errors import (
    InvalidAddressError,
    MessageTooLargeError,
    ProtocolError,
    TransportClosedError,
)
from mstar.messages import Envelope, ErrorReply
from mstar.transport.base import (
    Address,
    ChannelBase,
    is_loopback_host,
    register_transport,
    split_host_port,
)
from mstar.transport.codec import LinkCodec, salvage_call_id
from mstar.transport.janitor import make_owned_name, runtime_dir

__all__ = ["ZmqChannel", "ZmqListener", "ZmqServerChannel", "ZmqTransport"]

log = logging.getLogger(__name__)

# sockaddr_un.sun_path holds 108 bytes including the terminating NUL.
_MAX_IPC_PATH = 107


def _context() -> zmq.asyncio.Context:
    return zmq.asyncio.Context.instance()


def _configure(sock: zmq.asyncio.Socket) -> None:
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)


class _FrameHandler(ChannelBase):
    """Decoding, rejection and sending shared by both kinds of ZeroMQ channel."""

    _codec: LinkCodec

    def _arrived(self, frames: list[Any]) -> None:
        if self._closed:
            return
        try:
            envelope = self._codec.decode(frames)
        except (ProtocolError, MessageTooLargeError) as exc:
            self._reject(frames, exc)
            return
        self._push(envelope)

    def _reject(self, frames: list[Any], exc: Exception) -> None:
        self._num_rejected += 1
        call_id = salvage_call_id(frames)
        log.warning("dropped a malformed message (%s)%s", exc, "" if call_id is None else f", failing call {call_id}")
        if call_id is not None:
            with contextlib.suppress(ProtocolError, MessageTooLargeError, TransportClosedError):
                self.send(ErrorReply(call_id, type(exc).__name__, str(exc)))

    def send(self, envelope: Envelope) -> None:
        if self._closed:
            raise TransportClosedError("channel is closed")
        self._send_frames(self._codec.encode(envelope))

    def _send_frames(self, frames: list[Any]) -> None:
        raise NotImplementedError


def _check_send(future: asyncio.Future[Any]) -> None:
    if not future.cancelled() and future.exception() is not None:
        log.warning("a ZeroMQ send failed: %s", future.exception())


def _start_send(sock: zmq.asyncio.Socket, frames: list[Any]) -> None:
    # pyzmq sends at once when it can and keeps later sends in order when it cannot.
    try:
        future = cast("asyncio.Future[Any]", sock.send_multipart(frames, copy=False))
    except zmq.ZMQError as exc:
        raise TransportClosedError(f"socket is closed ({exc})") from exc
    if future.done():
        _check_send(future)
    else:
        future.add_done_callback(_check_send)


class ZmqChannel(_FrameHandler):
    """The connecting end: a DEALER socket."""

    def __init__(self, sock: zmq.asyncio.Socket, codec: LinkCodec) -> None:
        super().__init__(codec)
        self._sock = sock

    def _send_frames(self, frames: list[Any]) -> None:
        _start_send(self._sock, frames)

    async def _read_one(self) -> bool:
        """Read one message into the channel; return False once closed."""
        try:
            frames = await self._sock.recv_multipart(copy=False)
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if self._closed and (current is None or not current.cancelling()):
                return False
            raise
        except zmq.ZMQError:
            if self._closed:
                return False
            raise
        self._arrived(frames)
        return True

    async def recv(self) -> Envelope:
        while not self._incoming and not self._closed:
            if not await self._read_one():
                break
        return await super().recv()

    async def deliver(self, sink: Callable[[Envelope], None]) -> None:
        while self._incoming:
            sink(self._incoming.popleft())
        self._sink = sink
        try:
            while not self._closed and await self._read_one():
                pass
        finally:
            self._sink = None

    async def aclose(self) -> None:
        if self._closed:
            return
        self._mark_closed()
        self._sock.close(linger=0)


class ZmqServerChannel(_FrameHandler):
    """The accepting end for one peer: the listener's ROUTER socket plus the peer's identity."""

    def __init__(self, listener: ZmqListener, identity: bytes, codec: LinkCodec) -> None:
        super().__init__(codec)
        self._listener = listener
        self._identity = identity

    def _send_frames(self, frames: list[Any]) -> None:
        _start_send(self._listener._sock, [self._identity, *frames])

    async def recv(self) -> Envelope:
        await self._listener._read_until(lambda: bool(self._incoming) or self._closed, self)
        return await super().recv()

    async def deliver(self, sink: Callable[[Envelope], None]) -> None:
        while self._incoming:
            sink(self._incoming.popleft())
        self._sink = sink
        try:
            await self._listener._read_until(lambda: self._closed, self)
        finally:
            self._sink = None

    async def aclose(self) -> None:
        if self._closed:
            return
        self._mark_closed()
        self._listener._forget(self._identity, self)
        self._listener._wake_reader(self)


class ZmqListener:
    """A bound ROUTER socket whose peers become `ZmqServerChannel`s.

    One socket serves every channel, so one coroutine at a time reads it and routes what it
    reads: whichever of `accept`, a channel's `recv` or `deliver` is waiting holds the
    "baton" and passes it on when its own wait is over.
    """

    def __init__(
        self,
        sock: zmq.asyncio.Socket,
        address: str,
        make_codec: Callable[[], LinkCodec],
        ipc_path: Path | None,
    ) -> None:
        self._sock = sock
        self._address = address
        self._make_codec = make_codec
        self._ipc_path = ipc_path
        self._channels: dict[bytes, ZmqServerChannel] = {}
        self._new: collections.deque[ZmqServerChannel] = collections.deque()
        self._closed = False
        self._is_reading = False
        self._baton: collections.deque[asyncio.Future[None]] = collections.deque()
        self._waiter: asyncio.Future[None] | None = None
        self._reader: ZmqListener | ChannelBase | None = None
        self._read: asyncio.Future[Any] | None = None

    @property
    def address(self) -> str:
        return self._address

    def _forget(self, identity: bytes, channel: ZmqServerChannel) -> None:
        if self._channels.get(identity) is channel:
            del self._channels[identity]

    async def _read_until(self, done: Callable[[], bool], owner: ZmqListener | ChannelBase) -> None:
        """Read and route messages (or wait for the reader to) until `done()` or close."""
        loop = asyncio.get_running_loop()
        try:
            while not done() and not self._closed:
                if self._is_reading:
                    # Woken when the reader passes the baton, or when `owner` gets input.
                    future = loop.create_future()
                    self._baton.append(future)
                    owner._waiter = future
                    try:
                        await future
                    finally:
                        if owner._waiter is future:
                            owner._waiter = None
                    continue
                self._is_reading = True
                self._reader = owner
                read = cast("asyncio.Future[list[Any]]", self._sock.recv_multipart(copy=False))
                self._read = read
                try:
                    frames = await read
                except asyncio.CancelledError:
                    current = asyncio.current_task()
                    if current is not None and current.cancelling():
                        raise
                    continue  # the read was cancelled to wake us: see `_wake_reader`
                except zmq.ZMQError:
                    if self._closed:
                        return
                    raise
                finally:
                    self._is_reading = False
                    self._reader = self._read = None
                self._route(frames)
        finally:
            if not self._is_reading:
                self._pass_baton()

    def _wake_reader(self, owner: ZmqListener | ChannelBase) -> None:
        """Interrupt the read of `owner`, whose wait is over for another reason (it closed)."""
        if self._reader is owner and self._read is not None and not self._read.done():
            self._read.cancel()

    def _pass_baton(self) -> None:
        while self._baton:
            future = self._baton.popleft()
            if not future.done():
                future.set_result(None)
                return

    def _route(self, frames: list[Any]) -> None:
        if len(frames) < 2:
            return
        identity = frames[0].bytes
        channel = self._channels.get(identity)
        if channel is None:
            channel = ZmqServerChannel(self, identity, self._make_codec())
            self._channels[identity] = channel
            self._new.append(channel)
            if self._waiter is not None and not self._waiter.done():
                self._waiter.set_result(None)
        channel._arrived(frames[1:])

    async def accept(self) -> ZmqServerChannel:
        await self._read_until(lambda: bool(self._new), self)
        if not self._new:
            raise TransportClosedError(f"{self._address} is closed")
        return self._new.popleft()

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        for channel in list(self._channels.values()):
            await channel.aclose()
        self._new.clear()
        while self._baton:
            self._pass_baton()
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)
        self._sock.close(linger=0)
        if self._ipc_path is not None:
            with contextlib.suppress(FileNotFoundError):
                self._ipc_path.unlink()

    def __aiter__(self) -> ZmqListener:
        return self

    async def __anext__(self) -> ZmqServerChannel:
        try:
            return await self.accept()
        except TransportClosedError:
            raise StopAsyncIteration from None


def _claim_ipc_path(rest: str) -> Path:
    """Return the socket path to bind, after removing a stale file nobody serves."""
    path = runtime_dir() / make_owned_name(".sock") if not rest else Path(rest)
    if len(os.fsencode(path)) > _MAX_IPC_PATH:
        raise InvalidAddressError(f"ipc path {str(path)!r} is longer than {_MAX_IPC_PATH} bytes")
    if path.exists():
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(os.fspath(path))
        except ConnectionRefusedError:
            path.unlink()  # left by a dead process
        except OSError as exc:
            raise InvalidAddressError(f"cannot bind ipc://{path}: {exc}") from exc
        else:
            raise InvalidAddressError(f"ipc://{path} is in use by a live process")
        finally:
            probe.close()
    return path


class ZmqTransport:
    """Listeners and channels for one ZeroMQ scheme (`ipc` or `tcp`)."""

    def __init__(self, scheme: str) -> None:
        self.scheme = scheme

    def listen(
        self, address: Address, make_codec: Callable[[], LinkCodec], *, allow_remote: bool
    ) -> ZmqListener:
        ipc_path: Path | None = None
        if self.scheme == "ipc":
            ipc_path = _claim_ipc_path(address.rest)
            endpoint = f"ipc://{ipc_path}"
        else:
            host, port = split_host_port(address.rest)
            if host == "localhost":
                host = "127.0.0.1"
            if not allow_remote and not is_loopback_host(host):
                raise InvalidAddressError(
                    f"refusing to bind tcp://{host}: not a loopback address "
                    "(pass allow_remote=True to serve other machines)"
                )
            endpoint = f"tcp://{host}:{'*' if port == '0' else port}"
        sock = _context().socket(zmq.ROUTER)
        _configure(sock)
        if self.scheme == "tcp" and endpoint.startswith("tcp://["):
            sock.setsockopt(zmq.IPV6, 1)
        try:
            sock.bind(endpoint)
        except zmq.ZMQError as exc:
            sock.close(linger=0)
            raise InvalidAddressError(f"cannot bind {endpoint}: {exc}") from exc
        bound = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        return ZmqListener(sock, bound, make_codec, ipc_path)

    def connect(self, address: Address, codec: LinkCodec) -> ZmqChannel:
        if self.scheme == "ipc" and not address.rest:
            raise InvalidAddressError("connecting needs a path: ipc://PATH")
        if self.scheme == "tcp":
            _, port = split_host_port(address.rest)
            if port == "0":
                raise InvalidAddressError(f"connecting needs a port: {address}")
        sock = _context().socket(zmq.DEALER)
        _configure(sock)
        if self.scheme == "tcp" and address.rest.startswith("["):
            sock.setsockopt(zmq.IPV6, 1)
        try:
            sock.connect(str(address))
        except zmq.ZMQError as exc:
            sock.close(linger=0)
            raise InvalidAddressError(f"cannot connect to {address}: {exc}") from exc
        return ZmqChannel(sock, codec)


register_transport("ipc", ZmqTransport("ipc"))
register_transport("tcp", ZmqTransport("tcp"))
