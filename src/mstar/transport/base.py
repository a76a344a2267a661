"""The transport interface: channels and listeners, and a registry keyed by address scheme.

A `Channel` is an ordered, message-preserving, two-way link to one peer that carries
`Envelope`s: `send` (never blocks), `recv`, `aclose`, and async iteration. A `Listener`
accepts channels at an address. `listen(address)` and `connect(address)` pick the transport
from the address scheme (`inproc://`, `ipc://`, `tcp://`).

Channels deliver either by pull (`recv`, iteration) or by push (`deliver(sink)` calls `sink`
for every envelope as it arrives); the actor system uses push, which saves a task switch per
message. A channel never yields a malformed message: it drops it, counts it in
`num_rejected`, and when the message was an `Ask`, fails it at the sender with
`ErrorReply(kind="ProtocolError")`.
"""

from __future__ import annotations

import asyncio
import collections
import ipaddress
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Protocol, Self
from urllib.parse import urlsplit

from mstar.errors import InvalidAddressError, TransportClosedError
from mstar.wire import Envelope

if TYPE_CHECKING:
    from mstar.transport.curve import CurveKeys
from mstar.transport.codec import LinkCodec

__all__ = [
    "Address",
    "Channel",
    "ChannelBase",
    "Listener",
    "Sink",
    "Transport",
    "connect",
    "get_transport",
    "listen",
    "parse_address",
    "register_transport",
]

log = logging.getLogger(__name__)

Sink = Callable[[Envelope], None]


@dataclass(frozen=True, slots=True)
class Address:
    """A parsed transport address: `scheme://rest`, where `rest` is a name, path or host:port."""

    scheme: str
    rest: str

    def __str__(self) -> str:
        return f"{self.scheme}://{self.rest}"


def parse_address(address: str) -> Address:
    """Split `scheme://rest`.

    Raises:
        InvalidAddressError: there is no `://`.
    """
    scheme, sep, rest = address.partition("://")
    if not sep or not scheme:
        raise InvalidAddressError(
            f"{address!r} is not a transport address (expected inproc://NAME, ipc://PATH or tcp://HOST:PORT)"
        )
    return Address(scheme.lower(), rest)


def is_loopback_host(host: str) -> bool:
    """Return whether `host` (an IP literal or "localhost") names this machine's loopback."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def split_host_port(rest: str) -> tuple[str, str]:
    """Split `host:port` (IPv6 hosts in brackets).

    Raises:
        InvalidAddressError: the form is not `host:port`.
    """
    parts = urlsplit(f"//{rest}")
    try:
        port = parts.port
    except ValueError:
        port = None
    host = parts.hostname
    if host is None or (port is None and not rest.endswith((":*", ":0"))):
        raise InvalidAddressError(f"tcp address needs HOST:PORT, got {rest!r}")
    return (f"[{host}]" if ":" in host else host), ("0" if port is None else str(port))


class Channel(Protocol):
    """An ordered two-way link to one peer, carrying envelopes."""

    @property
    def is_closed(self) -> bool:
        """Whether this end was closed or the peer went away."""
        ...

    @property
    def codec(self) -> LinkCodec | None:
        """The link's codec (None for in-process channels, which pass objects by reference)."""
        ...

    @property
    def num_rejected(self) -> int:
        """How many malformed or oversize messages were dropped."""
        ...

    def send(self, envelope: Envelope) -> None:
        """Queue `envelope` for the peer; never blocks.

        Raises:
            TransportClosedError: the channel is closed.
            ProtocolError: the envelope cannot be encoded.
            MessageTooLargeError: the encoded envelope is over the link's limit.
        """
        ...

    async def recv(self) -> Envelope:
        """Return the next envelope.

        Raises:
            TransportClosedError: the channel closed and nothing is left to read.
        """
        ...

    async def deliver(self, sink: Sink) -> None:
        """Call `sink` with every envelope as it arrives, until the channel closes."""
        ...

    async def aclose(self) -> None:
        """Close this end; the peer sees end of stream. Idempotent."""
        ...

    def __aiter__(self) -> AsyncIterator[Envelope]: ...


class Listener(Protocol):
    """Accepts channels at an address."""

    @property
    def address(self) -> str:
        """The address peers connect to (the chosen port or path filled in)."""
        ...

    async def accept(self) -> Channel:
        """Return the next new channel.

        Raises:
            TransportClosedError: the listener is closed.
        """
        ...

    async def aclose(self) -> None:
        """Stop accepting, close the channels it accepted, remove any socket file."""
        ...

    def __aiter__(self) -> AsyncIterator[Channel]: ...


class Transport(Protocol):
    """Makes listeners and channels for one address scheme."""

    def listen(
        self,
        address: Address,
        make_codec: Callable[[], LinkCodec],
        *,
        allow_remote: bool,
        curve: CurveKeys | None = None,
    ) -> Listener:
        """Bind at `address` now and return the listener (CURVE-secured where it applies)."""
        ...

    def connect(
        self, address: Address, codec: LinkCodec, *, curve: CurveKeys | None = None
    ) -> Channel:
        """Return a channel to `address` at once; messages queue until the peer is reached."""
        ...


class ChannelBase:
    """Shared plumbing of channels: an incoming queue or a push sink, and close state."""

    def __init__(self, codec: LinkCodec | None = None) -> None:
        self._codec = codec
        self._incoming: collections.deque[Envelope] = collections.deque()
        self._waiter: asyncio.Future[None] | None = None
        self._sink: Sink | None = None
        self._closed = False
        self._closed_event = asyncio.Event()
        self._num_rejected = 0

    @property
    def is_closed(self) -> bool:
        return self._closed

    @property
    def codec(self) -> LinkCodec | None:
        return self._codec

    @property
    def num_rejected(self) -> int:
        return self._num_rejected

    def _push(self, envelope: Envelope) -> None:
        """Hand an arrived envelope to the sink, or queue it for `recv`."""
        if self._sink is not None:
            self._sink(envelope)
            return
        self._incoming.append(envelope)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _mark_closed(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._closed_event.set()
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def recv(self) -> Envelope:
        while not self._incoming:
            if self._closed:
                raise TransportClosedError("channel closed")
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return self._incoming.popleft()

    async def deliver(self, sink: Sink) -> None:
        while self._incoming:
            sink(self._incoming.popleft())
        self._sink = sink
        try:
            await self._closed_event.wait()
        finally:
            self._sink = None

    async def __anext__(self) -> Envelope:
        try:
            return await self.recv()
        except TransportClosedError:
            raise StopAsyncIteration from None

    def __aiter__(self) -> Self:
        return self

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        raise NotImplementedError


_TRANSPORTS: dict[str, Transport] = {}


def register_transport(scheme: str, transport: Transport) -> None:
    """Make `transport` serve addresses `scheme://...` (replacing any previous one)."""
    _TRANSPORTS[scheme.lower()] = transport


def get_transport(address: Address) -> Transport:
    """Return the transport for the address's scheme.

    Raises:
        InvalidAddressError: no transport is registered for the scheme.
    """
    try:
        return _TRANSPORTS[address.scheme]
    except KeyError:
        known = ", ".join(sorted(f"{s}://" for s in _TRANSPORTS))
        raise InvalidAddressError(
            f"no transport for {address.scheme}:// (known: {known})"
        ) from None


def listen(
    address: str,
    make_codec: Callable[[], LinkCodec],
    *,
    allow_remote: bool = False,
    curve: CurveKeys | None = None,
) -> Listener:
    """Bind a listener at `address`; call it from a coroutine (the running loop drives it).

    Args:
        address: `inproc://NAME`, `ipc://PATH` (`ipc://` picks a private path) or
            `tcp://HOST:PORT` (port 0 picks a free port).
        make_codec: makes the codec of each accepted channel.
        allow_remote: permit TCP on non-loopback interfaces.
        curve: CURVE keys: a tcp listener then admits only clients holding them.
    """
    parsed = parse_address(address)
    return get_transport(parsed).listen(parsed, make_codec, allow_remote=allow_remote, curve=curve)


def connect(address: str, codec: LinkCodec, *, curve: CurveKeys | None = None) -> Channel:
    """Open a channel to the listener at `address`; call it from a coroutine.

    Messages sent before the peer is reached wait in the channel (ZeroMQ reconnects). With
    ``curve``, a tcp channel talks only to a server holding the keys' server secret.
    """
    parsed = parse_address(address)
    return get_transport(parsed).connect(parsed, codec, curve=curve)
