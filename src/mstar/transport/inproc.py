"""The in-process transport (`inproc://NAME`): the reference implementation.

A channel pair shares one event loop; `send` hands the envelope object itself to the other
end (no encoding, tensors passed by reference), so in-process links cost a function call.
Both ends must run on the loop the listener was created on.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable
from typing import TYPE_CHECKING

from mstar.errors import InvalidAddressError, PeerLostError, TransportClosedError
from mstar.transport.base import Address, ChannelBase, register_transport
from mstar.transport.codec import LinkCodec
from mstar.wire import Envelope

if TYPE_CHECKING:
    from mstar.transport.curve import CurveKeys

__all__ = ["InprocChannel", "InprocListener", "InprocTransport"]

_LISTENERS: dict[str, InprocListener] = {}


class InprocChannel(ChannelBase):
    """One end of an in-process channel pair."""

    def __init__(self) -> None:
        super().__init__(None)
        self._peer: InprocChannel | None = None

    @classmethod
    def pair(cls) -> tuple[InprocChannel, InprocChannel]:
        """Return two connected ends."""
        a, b = cls(), cls()
        a._peer, b._peer = b, a
        return a, b

    def send(self, envelope: Envelope) -> None:
        if self._closed or self._peer is None:
            raise TransportClosedError("in-process channel is closed")
        self._peer._push(envelope)

    async def aclose(self) -> None:
        self._mark_closed()
        if self._peer is not None:
            self._peer._mark_closed()


class InprocListener:
    """Accepts in-process channels under a name."""

    def __init__(self, name: str) -> None:
        if not name:
            raise InvalidAddressError("inproc:// needs a name, e.g. inproc://conductor")
        if name in _LISTENERS:
            raise InvalidAddressError(f"inproc://{name} is already bound in this process")
        self._name = name
        self._loop = asyncio.get_running_loop()
        self._pending: collections.deque[InprocChannel] = collections.deque()
        self._accepted: list[InprocChannel] = []
        self._waiter: asyncio.Future[None] | None = None
        self._closed = False
        _LISTENERS[name] = self

    @property
    def address(self) -> str:
        return f"inproc://{self._name}"

    def _connect(self) -> InprocChannel:
        if asyncio.get_running_loop() is not self._loop:
            raise InvalidAddressError(f"{self.address} belongs to another event loop")
        client, server = InprocChannel.pair()
        self._pending.append(server)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)
        return client

    async def accept(self) -> InprocChannel:
        while not self._pending:
            if self._closed:
                raise TransportClosedError(f"{self.address} is closed")
            self._waiter = self._loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        channel = self._pending.popleft()
        self._accepted = [c for c in self._accepted if not c.is_closed]
        self._accepted.append(channel)
        return channel

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        if _LISTENERS.get(self._name) is self:
            del _LISTENERS[self._name]
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)
        for channel in [*self._pending, *self._accepted]:
            await channel.aclose()
        self._pending.clear()
        self._accepted.clear()

    def __aiter__(self) -> InprocListener:
        return self

    async def __anext__(self) -> InprocChannel:
        try:
            return await self.accept()
        except TransportClosedError:
            raise StopAsyncIteration from None


class InprocTransport:
    """Listeners and channels for `inproc://NAME`."""

    def listen(
        self,
        address: Address,
        make_codec: Callable[[], LinkCodec],
        *,
        allow_remote: bool,
        curve: CurveKeys | None = None,
    ) -> InprocListener:
        return InprocListener(address.rest)

    def connect(
        self, address: Address, codec: LinkCodec, *, curve: CurveKeys | None = None
    ) -> InprocChannel:
        listener = _LISTENERS.get(address.rest)
        if listener is None:
            raise PeerLostError(f"nothing listens at {address} in this process")
        return listener._connect()


register_transport("inproc", InprocTransport())
