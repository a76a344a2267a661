"""`PeerLink`: one channel to a peer actor system, with its handshake, calls and upkeep.

The client side sends `Hello` first; the server answers with its own. Each side that can map
the other's shared arena does so and says `ArenaAttached`; from then on the other side sends
large CPU tensors through its arena. Both sides send a `Heartbeat` when they sent nothing else
for a heartbeat interval; a link that hears nothing for the heartbeat timeout is lost, and
its pending asks fail with `PeerLostError`. A peer on this host is watched by its process
instead (`watched_pid`): it is lost once its process exited, seen within a heartbeat
interval, and never for silence alone, since a long step that starves its event loop (or
holds the GIL from its heartbeat) leaves a healthy process quiet.

CUDA IPC is used on a link only where both sides can open handles and see a common CUDA
device (each names the UUIDs of its devices in its `Hello`): the codec sends tensors on those
devices as handles and everything else by bytes. When a same-host peer's process is gone, the
handles sent to it are released (`LinkCodec.release_cuda_sent`).

A link to another process carries each message in its wire form (`WireMessage.to_wire`) and
hands what arrives to actors converted back (`WireMessage.from_wire`); an in-process link
passes messages by reference, as they are.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import threading
import time
from typing import TYPE_CHECKING, Any

import msgspec

from mstar import errors
from mstar.errors import (
    ActorHandlerError,
    MessageTooLargeError,
    PeerLostError,
    ProtocolError,
    TransportClosedError,
)
from mstar.transport.base import Channel
from mstar.transport.cuda_ipc import local_cuda_device_uuids
from mstar.transport.janitor import is_pid_alive, sweep_stale
from mstar.transport.shm import ArenaMapping
from mstar.wire import (
    PROTOCOL_VERSION,
    ArenaAttached,
    ArenaRelease,
    Ask,
    Envelope,
    ErrorReply,
    Goodbye,
    Heartbeat,
    Hello,
    Reply,
    Tell,
    WireMessage,
    is_wire_message,
)

if TYPE_CHECKING:
    from mstar.actors.system import ActorSystem

__all__ = ["PeerLink", "RemoteReply", "error_from_reply", "error_reply", "shared_cuda_devices"]

log = logging.getLogger(__name__)

_HEARTBEAT = Heartbeat()

# Error kinds a peer may name in an ErrorReply, rebuilt here as the same class.
_REBUILDABLE: dict[str, type[errors.MStarError]] = {
    cls.__name__: cls
    for cls in (
        errors.ActorDeadError,
        errors.ActorNotFoundError,
        errors.MailboxFullError,
        errors.ProtocolError,
        errors.MessageTooLargeError,
        errors.TransportClosedError,
        errors.PeerLostError,
    )
}


def shared_cuda_devices(peer: Hello, *, same_host: bool) -> frozenset[str]:
    """Return the UUIDs of the CUDA devices a link to `peer` may pass by IPC handle.

    Empty unless the peer is another process on this host, both sides can open CUDA IPC
    handles, and both see the device.
    """
    if not same_host or peer.pid == os.getpid() or not peer.cuda_ipc:
        return frozenset()
    return frozenset(peer.cuda_device_uuids).intersection(local_cuda_device_uuids())


def error_reply(call_id: int, error: BaseException) -> ErrorReply:
    """Describe `error` for the asker of call `call_id`."""
    if isinstance(error, ActorHandlerError):
        return ErrorReply(call_id, "ActorHandlerError", str(error), error.error_type)
    kind = type(error).__name__
    if kind not in _REBUILDABLE:
        return ErrorReply(call_id, "ActorHandlerError", f"{kind}: {error}", kind)
    return ErrorReply(call_id, kind, str(error))


def error_from_reply(reply: ErrorReply) -> errors.MStarError:
    """Rebuild the error a peer reported."""
    cls = _REBUILDABLE.get(reply.kind)
    if cls is None:
        return ActorHandlerError(reply.message, error_type=reply.error_type or reply.kind)
    return cls(reply.message)


class RemoteReply:
    """Where the answer to a peer's ask goes: back over its link, under its call id."""

    __slots__ = ("call_id", "link")

    def __init__(self, link: PeerLink, call_id: int) -> None:
        self.link = link
        self.call_id = call_id

    def resolve(self, value: Any) -> None:
        if value is not None and not is_wire_message(value):
            self.fail(
                ProtocolError(
                    f"reply of type {type(value).__name__} is not a wire message "
                    "(register it with mstar.wire.register_messages)"
                )
            )
            return
        try:
            self.link.send(
                Reply(self.call_id, self.link.outgoing(value) if value is not None else None)
            )
        except (ProtocolError, MessageTooLargeError) as exc:
            self.fail(exc)
        except TransportClosedError:
            pass

    def fail(self, error: BaseException) -> None:
        with contextlib.suppress(TransportClosedError, ProtocolError, MessageTooLargeError):
            self.link.send(error_reply(self.call_id, error))


class PeerLink:
    """One channel to a peer system.

    Args:
        system: the owning system.
        channel: the channel.
        address: the address this side connected to (None when the peer connected to us).
    """

    def __init__(self, system: ActorSystem, channel: Channel, address: str | None) -> None:
        self.system = system
        self.channel = channel
        self.codec = channel.codec
        self.address = address
        self.is_client = address is not None
        self.peer: Hello | None = None
        self.pending: dict[int, asyncio.Future[Any]] = {}
        self.handshake: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.last_recv = self.last_send = time.monotonic()
        self.is_closed = False
        # The peer's pid, where it runs on this host and this side can see it (see the
        # module's docstring); None: silence for the heartbeat timeout is what loses it.
        self.watched_pid: int | None = None
        self._loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()
        self._releases: collections.deque[int] = collections.deque()
        self._release_scheduled = False

    def __repr__(self) -> str:
        peer = self.address or (
            self.peer.addresses[0] if self.peer and self.peer.addresses else "?"
        )
        return f"PeerLink({peer})"

    @property
    def label(self) -> str:
        """The peer's best known address, for messages."""
        if self.address is not None:
            return self.address
        if self.peer is not None and self.peer.addresses:
            return self.peer.addresses[-1]
        return "an unidentified peer"

    def send(self, envelope: Envelope) -> None:
        """Send an envelope (see `Channel.send` for errors).

        Arena releases queued on this thread go first, so that the peer has its slots back
        before it reads anything sent after the tensors were dropped.
        """
        if self._releases and threading.get_ident() == self._loop_thread:
            self._flush_releases()
        self.channel.send(envelope)
        self.last_send = time.monotonic()

    def outgoing(self, message: WireMessage) -> WireMessage:
        """Return ``message`` as this link carries it: in wire form unless in-process."""
        return message if self.codec is None else message.to_wire()

    def incoming(self, message: WireMessage) -> WireMessage:
        """Return a message that arrived on this link as actors handle it."""
        return message if self.codec is None else message.from_wire()

    def silence_error(self, now: float, interval: float, timeout: float) -> PeerLostError | None:
        """Return why the link is lost, if it is: its peer's process exited, or it was silent too
        long."""
        silent_s = now - self.last_recv
        if self.watched_pid is not None:
            if silent_s > interval and not is_pid_alive(self.watched_pid):
                return PeerLostError(f"{self.label} is gone: its process {self.watched_pid} exited")
            return None
        if silent_s > timeout:
            return PeerLostError(f"{self.label} sent nothing for {timeout} s")
        return None

    def send_heartbeat(self) -> None:
        """Send a heartbeat, unless the channel is already closed."""
        with contextlib.suppress(TransportClosedError):
            self.send(_HEARTBEAT)

    def start(self) -> None:
        """Open the handshake (client side)."""
        self.send(self._hello())

    def _hello(self) -> Hello:
        """Return the system's hello, plus what this process offers for CUDA IPC."""
        hello = self.system._hello()
        # In-process links pass tensors by reference: no need to wake CUDA for them.
        uuids = local_cuda_device_uuids() if self.codec is not None else ()
        if not uuids:
            return hello
        return msgspec.structs.replace(hello, cuda_ipc=True, cuda_device_uuids=list(uuids))

    # ---------------------------------------------------------------------------- incoming

    def on_envelope(self, envelope: Envelope) -> None:
        """Handle one envelope from the peer (the channel's sink)."""
        if self.is_closed:
            return  # arrived after the link was given up, before its channel closed
        self.last_recv = time.monotonic()
        kind = type(envelope)
        try:
            if kind is Tell or kind is Ask:
                if self.peer is None:
                    raise ProtocolError("message before the handshake")
                self.system._deliver(self, envelope)  # type: ignore[arg-type]
            elif kind is Reply or kind is ErrorReply:
                future = self.pending.pop(envelope.call_id, None)  # type: ignore[union-attr]
                if future is not None and not future.done():
                    if kind is Reply:
                        body = envelope.body  # type: ignore[union-attr]
                        future.set_result(None if body is None else self.incoming(body))
                    else:
                        future.set_exception(error_from_reply(envelope))  # type: ignore[arg-type]
            elif kind is Heartbeat:
                pass
            elif kind is Hello:
                self._on_hello(envelope)  # type: ignore[arg-type]
            elif kind is ArenaRelease:
                if self.codec is not None:
                    self.codec.release(envelope.offsets)  # type: ignore[union-attr]
            elif kind is ArenaAttached:
                if self.codec is not None and self.system._arena is not None:
                    self.codec.local_arena = self.system._arena
            elif kind is Goodbye:
                reason = envelope.reason or "no reason given"  # type: ignore[union-attr]
                self.lose(PeerLostError(f"{self.label} closed the link ({reason})"), graceful=True)
        except ProtocolError as exc:
            log.warning("protocol violation from %s: %s", self.label, exc)
            if kind is Hello or self.peer is None:
                self.lose(exc)
        except Exception:
            # A bug here must not take the link (or, for in-process links, the sender) down.
            log.exception("failed to handle %s from %s", kind.__name__, self.label)

    def _on_hello(self, hello: Hello) -> None:
        if self.peer is not None:
            raise ProtocolError("second Hello on one link")
        if hello.protocol != PROTOCOL_VERSION:
            raise ProtocolError(
                f"peer speaks wire protocol {hello.protocol}, this side {PROTOCOL_VERSION}"
            )
        self.peer = hello
        if not self.is_client:
            self.send(self._hello())
        self.system._register_link(self, hello)
        same_host = hello.host_id == self.system._host_id
        if same_host and hello.pid != os.getpid() and is_pid_alive(hello.pid):
            self.watched_pid = hello.pid
        codec = self.codec
        if codec is not None:
            codec.max_message_bytes = min(
                codec.max_message_bytes, hello.max_message_bytes or codec.max_message_bytes
            )
            codec.cuda_ipc_device_uuids = shared_cuda_devices(hello, same_host=same_host)
            codec.cuda_ipc = bool(codec.cuda_ipc_device_uuids)
            if same_host and hello.arena is not None and self.system.config.shm_arena_bytes > 0:
                try:
                    codec.peer_arena = ArenaMapping(
                        hello.arena.name, hello.arena.nbytes, self._queue_release
                    )
                except (OSError, ProtocolError) as exc:
                    log.info("not mapping the arena of %s: %s", self.label, exc)
                else:
                    self.send(ArenaAttached())
        if not self.handshake.done():
            self.handshake.set_result(None)

    # ------------------------------------------------------------------------ arena slots

    def _queue_release(self, offset: int) -> None:
        # Runs when a tensor view of the peer's arena dies, in whichever thread dropped it.
        self._releases.append(offset)
        if self._release_scheduled or self.is_closed:
            return
        self._release_scheduled = True
        try:
            if threading.get_ident() == self._loop_thread:
                self._loop.call_soon(self._flush_releases)
            else:
                self._loop.call_soon_threadsafe(self._flush_releases)
        except RuntimeError:
            pass  # the loop is closed: the link is gone, and the owner frees everything

    def _flush_releases(self) -> None:
        self._release_scheduled = False
        offsets = []
        while self._releases:
            offsets.append(self._releases.popleft())
        if offsets and not self.is_closed:
            with contextlib.suppress(TransportClosedError):
                self.channel.send(ArenaRelease(offsets))
                self.last_send = time.monotonic()

    # ------------------------------------------------------------------------------ close

    def lose(self, error: Exception, *, graceful: bool = False) -> None:
        """Close the link: fail pending asks with `error`, free its arena slots, forget it.

        Unless the peer said goodbye first, it is told why (if it can still hear), so that a
        peer that was only slow opens a fresh link instead of talking into a dead one.

        Args:
            error: what pending asks fail with.
            graceful: the peer said goodbye (logged quietly, not answered).
        """
        if self.is_closed:
            return
        if not graceful:
            with contextlib.suppress(Exception):
                self.send(Goodbye(str(error)))
        self.is_closed = True
        pending, self.pending = self.pending, {}
        for future in pending.values():
            if not future.done():
                future.set_exception(_copy(error))
        if not self.handshake.done():
            self.handshake.set_exception(_copy(error))
            self.handshake.exception()  # retrieved: connect() may not be waiting
        if self.codec is not None:
            self.codec.release_all()
            if self.codec.peer_arena is not None:
                self.codec.peer_arena.close()
        self.system._forget_link(self, error)
        peer = self.peer
        if (
            isinstance(error, PeerLostError)
            and peer is not None
            and peer.pid != os.getpid()
            and not is_pid_alive(peer.pid)
        ):
            sweep_stale(peer.pid)
        if (
            self.codec is not None
            and self.codec.cuda_ipc
            and self.watched_pid is not None
            and not is_pid_alive(self.watched_pid)
        ):
            # Only a process seen alive at the handshake (this pid namespace) is known dead.
            self.codec.release_cuda_sent()
        if graceful or isinstance(error, TransportClosedError):
            log.info("closed link to %s: %s", self.label, error)
        else:
            log.warning("lost link to %s: %s", self.label, error)
        self.system._spawn_task(self.channel.aclose())


def _copy(error: Exception) -> Exception:
    # One exception object raised in many tasks would collect all their tracebacks.
    try:
        return type(error)(*error.args)
    except TypeError:
        return error
