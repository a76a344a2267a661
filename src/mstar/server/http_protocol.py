"""The HTTP/1.1 connection protocol of the server: uvicorn's h11 one, with a header deadline.

uvicorn closes a keep-alive connection that stays idle after a response
(``timeout_keep_alive``), but not one that never sends a request, nor one that trickles its
request line and headers a byte at a time: either holds a socket and a task forever. Here
each request's headers must be complete within ``header_timeout_s`` of the moment the server
began waiting for them (the connection opened, or the previous response ended); otherwise
the connection is closed. A WebSocket upgrade ends the deadline for good: from then on the
connection is a session (a robot's lasts hours), kept alive by WebSocket pings.

    uvicorn.Config(app, http=timed_h11(10.0), timeout_keep_alive=5)
"""

from __future__ import annotations

import asyncio
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

__all__ = ["HeaderTimeoutH11Protocol", "timed_h11"]


class HeaderTimeoutH11Protocol(H11Protocol):
    """`H11Protocol` that closes connections whose request headers take too long."""

    header_timeout_s = 10.0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._header_deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        """Start waiting for the first request's headers."""
        super().connection_made(transport)
        self._await_headers()

    def data_received(self, data: bytes) -> None:
        """Feed h11; stop the deadline once a request's headers are complete."""
        cycle = self.cycle
        super().data_received(data)
        if self.cycle is not cycle:  # a new request cycle: its headers arrived
            self._cancel_deadline()

    def on_response_complete(self) -> None:
        """Start waiting for the next request's headers (uvicorn's keep-alive timer runs too)."""
        cycle = self.cycle
        super().on_response_complete()
        # A pipelined request may already have started a new cycle: it has its headers.
        if self.cycle is cycle and not self.transport.is_closing():
            self._await_headers()

    def handle_websocket_upgrade(self, event: h11.Request) -> None:
        """Hand the connection to the WebSocket protocol: its headers are complete."""
        # The transport now belongs to the WebSocket protocol, so this protocol's
        # connection_lost never comes: a deadline left armed would cut the session off.
        self._cancel_deadline()
        super().handle_websocket_upgrade(event)

    def connection_lost(self, exc: Exception | None) -> None:
        """Forget the deadline."""
        self._cancel_deadline()
        super().connection_lost(exc)

    def _await_headers(self) -> None:
        self._cancel_deadline()
        self._header_deadline = self.loop.call_later(self.header_timeout_s, self._headers_timed_out)

    def _cancel_deadline(self) -> None:
        if self._header_deadline is not None:
            self._header_deadline.cancel()
            self._header_deadline = None

    def _headers_timed_out(self) -> None:
        self._header_deadline = None
        # A connection handed to another protocol (an upgrade) is no longer ours to close.
        if self.transport.get_protocol() is self and not self.transport.is_closing():
            self.logger.info(
                "closing a connection whose request headers took over %s s", self.header_timeout_s
            )
            self.transport.close()


def timed_h11(header_timeout_s: float) -> type[HeaderTimeoutH11Protocol]:
    """Return the protocol class with the given header deadline (uvicorn takes a class)."""
    if header_timeout_s <= 0:
        raise ValueError(f"header_timeout_s must be > 0, got {header_timeout_s}")
    return type(
        "HeaderTimeoutH11Protocol",
        (HeaderTimeoutH11Protocol,),
        {"header_timeout_s": header_timeout_s},
    )
