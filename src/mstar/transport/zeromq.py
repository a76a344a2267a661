"""ZeroMQ transports (`ipc://PATH`, `tcp://HOST:PORT`): pyzmq sockets driven by the event loop.

A listener is one ROUTER socket; each peer that connects (a DEALER) becomes one channel,
told apart by the identity frame ROUTER puts in front of its messages:

    DEALER --[frame0 header][tensor frames...]--> ROUTER --[identity][frame0][...]--> channel

Each socket is driven by a reader callback on its file descriptor (as `zmq.asyncio` does
internally, but without a future and a task wake-up per message): the callback drains
every waiting message and hands it to its channel, which pushes it to the channel's sink or
queues it for `recv`. Sends go straight to the socket. ZeroMQ's descriptor is
edge-triggered, so after every send the socket's events are checked again.

Tensor frames are sent without copying (`copy=False`) and received as zmq frames that the
decoded tensors view directly. High-water marks are off: ROUTER silently drops messages to a
peer over its mark, which would lose replies; flow control belongs to the actors' bounded
mailboxes.

Binding is to loopback only unless `allow_remote`; `ipc://` alone picks a private socket
path, and a socket file left by a dead process is replaced, never one a live process serves.
With CURVE keys, a tcp listener admits only clients holding them and every tcp connection
is encrypted (`mstar.transport.curve`); ipc sockets live in a private directory instead.

A connecting tcp channel watches its connection (a ZeroMQ socket monitor): once established,
a connection the peer closes (its process died, with its machine or not) closes the
channel at once, so that its link is lost now rather than at the heartbeat timeout.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import logging
import os
import socket
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import zmq
from zmq.utils.monitor import parse_monitor_message

from mstar.errors import (
    InvalidAddressError,
    MessageTooLargeError,
    ProtocolError,
    TransportClosedError,
)
from mstar.transport.base import (
    Address,
    ChannelBase,
    is_loopback_host,
    register_transport,
    split_host_port,
)
from mstar.transport.codec import LinkCodec, salvage_call_id
from mstar.transport.curve import secure_client, secure_server
from mstar.transport.janitor import make_owned_name, runtime_dir
from mstar.wire import Envelope, ErrorReply

if TYPE_CHECKING:
    from mstar.transport.curve import CurveKeys

__all__ = ["ZmqChannel", "ZmqListener", "ZmqServerChannel", "ZmqTransport"]

log = logging.getLogger(__name__)

# sockaddr_un.sun_path holds 108 bytes including the terminating NUL.
_MAX_IPC_PATH = 107
# Messages handled per reader callback before other callbacks get a turn.
_BATCH = 64
# How long a closed socket keeps trying to deliver what was queued (a Goodbye, say).
_LINGER_MS = 200
# Plain ints: pyzmq's flag enums cost a Python-level call for every `&` and `|`, several
# times per message.
_POLLIN = int(zmq.POLLIN)
_POLLOUT = int(zmq.POLLOUT)
_NOBLOCK = int(zmq.NOBLOCK)
_MORE = int(zmq.NOBLOCK | zmq.SNDMORE)
# Likewise an option passed as its enum member costs a conversion on every call: EVENTS is
# read about three times per message.
_EVENTS = int(zmq.EVENTS)
_HANDSHAKE_SUCCEEDED = int(zmq.EVENT_HANDSHAKE_SUCCEEDED)
_DISCONNECTED = int(zmq.EVENT_DISCONNECTED)
# Smaller frames are copied into the message (what pyzmq would do anyway, but without a
# zmq.Frame object per frame); larger ones are sent without copying.
_COPY_THRESHOLD = zmq.COPY_THRESHOLD


def _make_socket(kind: int) -> zmq.Socket[bytes]:
    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(kind)
    sock.setsockopt(zmq.LINGER, _LINGER_MS)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    return sock


class _SocketDriver:
    """Run one socket on the event loop: drain it on readability, send without blocking.

    Args:
        sock: the socket (owned: closed by `close`).
        on_frames: called with each received multipart message.
    """

    def __init__(self, sock: zmq.Socket[bytes], on_frames: Callable[[list[Any]], None]) -> None:
        self._sock = sock
        self._on_frames = on_frames
        self._loop = asyncio.get_running_loop()
        self._fd: int = sock.FD
        self._get: Callable[[int], int] = sock.get  # type: ignore[assignment]
        self._send = sock.send
        self._recv: Callable[[], zmq.Frame] = functools.partial(sock.recv, _NOBLOCK, copy=False)  # type: ignore[assignment]
        self._backlog: collections.deque[list[Any]] = collections.deque()
        self._is_scheduled = False
        self.is_closed = False
        self._loop.add_reader(self._fd, self._drain)
        self._schedule()  # messages may be waiting already, and the descriptor is edge-triggered

    def send(self, frames: list[Any]) -> None:
        """Send a multipart message now (or after earlier ones the socket could not take yet).

        Raises:
            TransportClosedError: the socket is closed.
        """
        if self.is_closed:
            raise TransportClosedError("socket is closed")
        backlog = self._backlog
        if backlog:
            backlog.append(frames)
        else:
            try:
                self._send_now(frames)
            except zmq.Again:
                backlog.append(frames)
            except zmq.ZMQError as exc:
                raise TransportClosedError(f"socket send failed: {exc}") from exc
        # Sending may have consumed the descriptor's edge while input is waiting.
        if not self._is_scheduled and self._get(_EVENTS) & (
            _POLLOUT | _POLLIN if backlog else _POLLIN
        ):
            self._schedule()

    def _send_now(self, frames: list[Any]) -> None:
        # ZeroMQ takes a multipart message whole or not at all: only the first part can
        # raise Again. Frames are bytes (headers, identities) or arrays (tensors).
        send = self._send
        last = frames[-1]
        for frame in frames[:-1] if len(frames) > 1 else ():
            send(frame, _MORE, copy=type(frame) is bytes and len(frame) < _COPY_THRESHOLD)
        send(last, _NOBLOCK, copy=type(last) is bytes and len(last) < _COPY_THRESHOLD)

    def _schedule(self) -> None:
        self._is_scheduled = True
        self._loop.call_soon(self._drain)

    def _drain(self) -> None:
        self._is_scheduled = False
        get, recv, on_frames = self._get, self._recv, self._on_frames
        for _ in range(_BATCH):
            if self.is_closed:
                return
            events = get(_EVENTS)
            if self._backlog and events & _POLLOUT:
                self._flush_backlog()
            if not events & _POLLIN:
                return
            try:
                # The later parts of a multipart message arrive with the first.
                frame = recv()
                frames = [frame]
                while frame.more:
                    frame = recv()
                    frames.append(frame)
            except zmq.Again:
                return
            try:
                on_frames(frames)
            except Exception:
                log.exception("failed to handle a ZeroMQ message")
        if not self.is_closed and not self._is_scheduled:
            self._schedule()  # more may be waiting: go on after other callbacks had a turn

    def _flush_backlog(self) -> None:
        while self._backlog:
            try:
                self._send_now(self._backlog[0])
            except zmq.Again:
                return
            self._backlog.popleft()

    def close(self) -> None:
        """Stop reading and close the socket (queued messages linger briefly)."""
        if self.is_closed:
            return
        self.is_closed = True
        with contextlib.suppress(RuntimeError, ValueError):
            self._loop.remove_reader(self._fd)  # the loop may be closed already
        self._sock.close()


class _FrameHandler(ChannelBase):
    """Decoding and rejection shared by both kinds of ZeroMQ channel."""

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
        log.warning(
            "dropped a malformed message (%s)%s",
            exc,
            "" if call_id is None else f", failing call {call_id}",
        )
        if call_id is not None:
            with contextlib.suppress(ProtocolError, MessageTooLargeError, TransportClosedError):
                self.send(ErrorReply(call_id, type(exc).__name__, str(exc)))

    def send(self, envelope: Envelope) -> None:
        if self._closed:
            raise TransportClosedError("channel is closed")
        self._send_frames(self._codec.encode(envelope))

    def _send_frames(self, frames: list[Any]) -> None:
        raise NotImplementedError


class _ConnectionWatch:
    """Call ``on_lost`` when a socket's established connection is closed by the peer."""

    def __init__(self, sock: zmq.Socket[bytes], on_lost: Callable[[], None]) -> None:
        self._on_lost = on_lost
        self._is_up = False
        self._mon = sock.get_monitor_socket(_HANDSHAKE_SUCCEEDED | _DISCONNECTED)
        self._sock = sock
        self._loop = asyncio.get_running_loop()
        self._fd: int = self._mon.FD
        self._is_closed = False
        self._loop.add_reader(self._fd, self._drain)
        self._loop.call_soon(self._drain)  # edge-triggered, like the socket's own descriptor

    def _drain(self) -> None:
        while not self._is_closed and int(self._mon.get(_EVENTS)) & _POLLIN:
            event = parse_monitor_message(self._mon.recv_multipart(_NOBLOCK))["event"]
            if event == _HANDSHAKE_SUCCEEDED:
                self._is_up = True
            elif event == _DISCONNECTED and self._is_up:
                self._on_lost()
                return

    def close(self) -> None:
        if self._is_closed:
            return
        self._is_closed = True
        with contextlib.suppress(RuntimeError, ValueError):
            self._loop.remove_reader(self._fd)
        with contextlib.suppress(zmq.ZMQError):
            self._sock.disable_monitor()
        self._mon.close(linger=0)


class ZmqChannel(_FrameHandler):
    """The connecting end: a DEALER socket (its connection watched, on tcp)."""

    def __init__(self, sock: zmq.Socket[bytes], codec: LinkCodec, *, watch: bool = False) -> None:
        super().__init__(codec)
        self._driver = _SocketDriver(sock, self._arrived)
        self._watch = _ConnectionWatch(sock, self._peer_closed) if watch else None

    def _send_frames(self, frames: list[Any]) -> None:
        self._driver.send(frames)

    def _peer_closed(self) -> None:
        log.info("the peer closed the connection")
        self._close_now()

    def _close_now(self) -> None:
        if self._closed:
            return
        self._mark_closed()
        if self._watch is not None:
            self._watch.close()
        self._driver.close()

    async def aclose(self) -> None:
        self._close_now()


class ZmqServerChannel(_FrameHandler):
    """The accepting end for one peer: the listener's ROUTER socket plus the peer's identity."""

    def __init__(self, listener: ZmqListener, identity: bytes, codec: LinkCodec) -> None:
        super().__init__(codec)
        self._listener = listener
        self._identity = identity

    def _send_frames(self, frames: list[Any]) -> None:
        self._listener._driver.send([self._identity, *frames])

    async def aclose(self) -> None:
        if self._closed:
            return
        self._mark_closed()
        self._listener._forget(self._identity, self)


class ZmqListener:
    """A bound ROUTER socket whose peers become `ZmqServerChannel`s."""

    def __init__(
        self,
        sock: zmq.Socket[bytes],
        address: str,
        make_codec: Callable[[], LinkCodec],
        ipc_path: Path | None,
    ) -> None:
        self._address = address
        self._make_codec = make_codec
        self._ipc_path = ipc_path
        self._channels: dict[bytes, ZmqServerChannel] = {}
        self._new: collections.deque[ZmqServerChannel] = collections.deque()
        self._waiter: asyncio.Future[None] | None = None
        self._closed = False
        self._driver = _SocketDriver(sock, self._route)

    @property
    def address(self) -> str:
        return self._address

    def _forget(self, identity: bytes, channel: ZmqServerChannel) -> None:
        if self._channels.get(identity) is channel:
            del self._channels[identity]

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
        while not self._new:
            if self._closed:
                raise TransportClosedError(f"{self._address} is closed")
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return self._new.popleft()

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        for channel in list(self._channels.values()):
            await channel.aclose()
        self._new.clear()
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)
        self._driver.close()
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
        self,
        address: Address,
        make_codec: Callable[[], LinkCodec],
        *,
        allow_remote: bool,
        curve: CurveKeys | None = None,
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
        sock = _make_socket(zmq.ROUTER)
        if self.scheme == "tcp" and endpoint.startswith("tcp://["):
            sock.setsockopt(zmq.IPV6, 1)
        if self.scheme == "tcp" and curve is not None:
            secure_server(sock, curve)
        try:
            sock.bind(endpoint)
        except zmq.ZMQError as exc:
            sock.close(linger=0)
            raise InvalidAddressError(f"cannot bind {endpoint}: {exc}") from exc
        bound = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        return ZmqListener(sock, bound, make_codec, ipc_path)

    def connect(
        self, address: Address, codec: LinkCodec, *, curve: CurveKeys | None = None
    ) -> ZmqChannel:
        if self.scheme == "ipc" and not address.rest:
            raise InvalidAddressError("connecting needs a path: ipc://PATH")
        if self.scheme == "tcp":
            _, port = split_host_port(address.rest)
            if port == "0":
                raise InvalidAddressError(f"connecting needs a port: {address}")
        sock = _make_socket(zmq.DEALER)
        if self.scheme == "tcp" and address.rest.startswith("["):
            sock.setsockopt(zmq.IPV6, 1)
        if self.scheme == "tcp" and curve is not None:
            secure_client(sock, curve)
        # watching from before connecting
        channel = ZmqChannel(sock, codec, watch=self.scheme == "tcp")
        try:
            sock.connect(str(address))
        except zmq.ZMQError as exc:
            channel._close_now()
            raise InvalidAddressError(f"cannot connect to {address}: {exc}") from exc
        return channel


register_transport("ipc", ZmqTransport("ipc"))
register_transport("tcp", ZmqTransport("tcp"))
