"""`ActorSystem`: spawns, finds, supervises and stops actors, and links to peer systems.

    async with ActorSystem() as system:
        await system.serve("ipc://")                   # let other processes reach our actors
        echo = await system.spawn(Echo, name="echo")
        reply = await echo.ask(Ping(1))
        worker = system.ref("tcp://127.0.0.1:5555", "worker-0")   # an actor elsewhere
        worker.tell(TensorBundle({"x": x}))

Every task (one per actor, one per link, one per listener, the heartbeat) belongs to the
system's TaskGroup. A system has one address per `serve` plus `peer://<system id>`, which
peers learn at the handshake; a ref's address is the first one served (or that fallback).
Messages between actors of one system never leave the process; messages to another system
go over a `PeerLink`, opened on first use by the scheme of the address.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import os
import socket
import time
import uuid
from collections.abc import Callable, Coroutine
from dataclasses import replace
from pathlib import Path
from types import TracebackType
from typing import Any, Self

import mstar.transport  # noqa: F401  (registers every transport)
from mstar.actors.actor import Actor, RestartPolicy
from mstar.actors.cell import ActorCell, fail_reply
from mstar.actors.config import SystemConfig
from mstar.actors.link import PeerLink, RemoteReply
from mstar.actors.ref import DEFAULT_ASK_TIMEOUT_S, ActorRef
from mstar.actors.timeouts import AskTimeouts
from mstar.errors import (
    ActorDeadError,
    ActorNameTakenError,
    ActorNotFoundError,
    MailboxFullError,
    PeerLostError,
    ProtocolError,
    TransportClosedError,
)
from mstar.transport.base import Channel, Listener, connect, listen, parse_address
from mstar.transport.codec import LinkCodec
from mstar.transport.shm import SharedArena, is_shm_available
from mstar.transport.tally import TransportTally
from mstar.wire import (
    SYSTEM_TARGET,
    Ack,
    ActorId,
    ArenaInfo,
    Ask,
    Hello,
    Lookup,
    Ping,
    Pong,
    Tell,
    is_wire_message,
)

__all__ = ["ActorSystem", "FaultHook", "SystemConfig", "default_host_id"]

log = logging.getLogger(__name__)

FaultHook = Callable[[str, Any, Callable[[], None]], bool]
"""``hook(target actor name, message, deliver) -> taken``: see `ActorSystem.fault_hook`."""


def default_host_id() -> str:
    """Return what tells this machine (and boot) apart: processes share /dev/shm and CUDA IPC only
    within it."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


class ActorSystem:
    """Runs actors and links them to peer systems; an async context manager.

    Args:
        config: settings; defaults if None.
    """

    def __init__(self, config: SystemConfig | None = None) -> None:
        self.config = config or SystemConfig()
        self.system_id = uuid.uuid4().hex
        self._host_id = self.config.host_id or default_host_id()
        self._self_address = f"peer://{self.system_id}"
        self._served: list[str] = []
        self._own: set[str] = {self._self_address}
        self._cells: dict[str, ActorCell] = {}
        self._links: set[PeerLink] = set()
        self._routes: dict[str, PeerLink] = {}
        self._listeners: list[Listener] = []
        self._arena: SharedArena | None = None
        # Tensor bytes this system's links sent and received (see `mstar.transport.tally`).
        self.transport_tally = TransportTally()
        self._call_ids = itertools.count(1)
        self._timeouts = AskTimeouts()
        self._names = itertools.count(1)
        self._tg: asyncio.TaskGroup | None = None
        self._heartbeat: asyncio.Task[None] | None = None
        self._link_lost_callbacks: list[Callable[[list[str], Exception], None]] = []
        self._is_closed = False
        # Fault injection (chaos runs, tests); None costs one attribute check per message. It
        # sees every message this system tells and every message a peer sends its actors, and
        # returns True to take it: drop it, or call ``deliver()`` later to pass it on then.
        self.fault_hook: FaultHook | None = None

    # ------------------------------------------------------------------------ lifecycle

    async def __aenter__(self) -> Self:
        if self._tg is not None or self._is_closed:
            raise RuntimeError("an ActorSystem can be entered once")
        self._tg = asyncio.TaskGroup()
        await self._tg.__aenter__()
        self._heartbeat = self._tg.create_task(self._heartbeat_loop(), name="mstar-heartbeat")
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        assert self._tg is not None
        try:
            await self._shutdown()
        finally:
            # Every task was told to end above; an error in the body propagates as it is,
            # not wrapped in the group's ExceptionGroup.
            await self._tg.__aexit__(None, None, None)
        return None

    async def _shutdown(self) -> None:
        if self._is_closed:
            return
        self._is_closed = True
        await asyncio.gather(*(self.stop(ref) for ref in [c.ref for c in self._cells.values()]))
        for link in list(self._links):
            link.lose(TransportClosedError("the actor system is shut down"))
        for listener in self._listeners:
            await listener.aclose()
        if self._heartbeat is not None:
            self._heartbeat.cancel()
        if self._arena is not None:
            self._arena.close()

    @property
    def is_closed(self) -> bool:
        """Whether the system shut down (or is shutting down)."""
        return self._is_closed

    @property
    def address(self) -> str:
        """The address in this system's refs: the first one served, else `peer://<id>`."""
        return self._served[0] if self._served else self._self_address

    @property
    def addresses(self) -> list[str]:
        """Every address that reaches this system."""
        return [*self._served, self._self_address]

    def _spawn_task(self, coro: Coroutine[Any, Any, Any], name: str | None = None) -> None:
        if self._tg is None:
            coro.close()
            raise RuntimeError("the ActorSystem is not running: use `async with ActorSystem()`")
        try:
            self._tg.create_task(coro, name=name)
        except RuntimeError:
            coro.close()  # the group is finishing; whatever this was is moot

    def _check_open(self) -> None:
        if self._tg is None:
            raise RuntimeError("the ActorSystem is not running: use `async with ActorSystem()`")
        if self._is_closed:
            raise TransportClosedError("the actor system is shut down")

    # --------------------------------------------------------------------------- actors

    async def spawn(
        self,
        factory: Callable[[], Actor],
        *,
        name: str | None = None,
        mailbox_size: int | None = None,
        restart: RestartPolicy | None = None,
    ) -> ActorRef:
        """Start an actor and return its ref once `on_start` has finished.

        Args:
            factory: makes the actor (an `Actor` subclass, or a zero-argument callable);
                called again on each restart.
            name: unique in this system; generated if None.
            mailbox_size: mailbox capacity; the config's default if None.
            restart: when to restart after a crash; None never restarts.

        Raises:
            ActorNameTakenError: a running actor has this name.
            ActorDeadError: the actor failed to start (and was not restarted).
        """
        self._check_open()
        if name is None:
            base = getattr(factory, "__name__", "")
            base = base.lower() if base.isidentifier() else "actor"
            name = f"{base}-{next(self._names)}"
        if not name or name == SYSTEM_TARGET:
            raise ValueError(f"invalid actor name {name!r}")
        if name in self._cells:
            raise ActorNameTakenError(f"an actor named {name!r} is already running")
        ref = ActorRef(self, self.address, name)
        cell = ActorCell(self, ref, factory, mailbox_size or self.config.mailbox_size, restart)
        self._cells[name] = cell
        assert self._tg is not None
        cell.task = self._tg.create_task(cell.run(), name=f"actor:{name}")
        await cell.started
        return ref

    def _unregister(self, cell: ActorCell) -> None:
        if self._cells.get(cell.name) is cell:
            del self._cells[cell.name]

    async def stop(self, ref: ActorRef | str, *, timeout: float | None = None) -> None:
        """Stop a local actor: it finishes its current message, then `on_stop` runs.

        Asks still queued fail with `ActorDeadError`. Called from the actor itself, it
        returns at once and the actor stops after the current message. A handler still busy
        after `timeout` (the config's `stop_timeout_s` if None) is cancelled, without
        `on_stop`. Stopping an actor that is not running does nothing.
        """
        name = ref if isinstance(ref, str) else ref.name
        if not isinstance(ref, str) and ref.address not in self._own:
            raise ValueError(f"{ref!r} belongs to another actor system")
        cell = self._cells.get(name)
        if cell is None:
            return
        cell.request_stop()
        if asyncio.current_task() is cell.task:
            return
        limit = self.config.stop_timeout_s if timeout is None else timeout
        try:
            async with asyncio.timeout(limit):
                await cell.done.wait()
        except TimeoutError:
            log.warning("actor %r did not stop within %s s; cancelling it", name, limit)
            if cell.task is not None:
                cell.task.cancel()
            await cell.done.wait()

    def ref(self, target: ActorId | str, address: str | None = None) -> ActorRef:
        """Return a ref without checking that the actor exists.

        Args:
            target: an actor name, or an `ActorId` received in a message.
            address: the actor's system; this system if None (ignored for an `ActorId`).
        """
        if isinstance(target, ActorId):
            return ActorRef(self, target.address, target.name)
        return ActorRef(self, address or self.address, target)

    async def lookup(
        self,
        name: str,
        *,
        address: str | None = None,
        timeout: float | None = DEFAULT_ASK_TIMEOUT_S,
    ) -> ActorRef:
        """Return a ref to a running actor, asking its system if it is remote.

        Raises:
            ActorNotFoundError: no actor runs under `name` there.
        """
        if address is None or address in self._own:
            if name not in self._cells:
                raise ActorNotFoundError(f"no actor named {name!r} in this system")
            return ActorRef(self, self.address, name)
        await self._ask(ActorRef(self, address, SYSTEM_TARGET), Lookup(name), timeout)
        return ActorRef(self, address, name)

    # -------------------------------------------------------------------------- sending

    def _tell(self, ref: ActorRef, message: Any) -> None:
        if self.fault_hook is not None and self._hooked(
            ref.name, message, self._tell, ref, message
        ):
            return
        if ref.address in self._own:
            cell = self._cells.get(ref.name)
            if cell is None:
                raise self._no_actor(ref.name)
            cell.offer(message, None)
            return
        _check_wire(message)
        link = self._link_to(ref.address)
        link.send(Tell(ref.name, link.outgoing(message)))

    async def _ask(self, ref: ActorRef, message: Any, timeout: float | None) -> Any:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        if ref.address in self._own:
            cell = self._cells.get(ref.name)
            if cell is None:
                raise self._no_actor(ref.name)
            cell.offer(message, future)
            return await self._wait(future, ref, timeout)
        _check_wire(message)
        link = self._link_to(ref.address)
        call_id = next(self._call_ids)
        link.pending[call_id] = future
        try:
            link.send(Ask(ref.name, call_id, link.outgoing(message)))
            return await self._wait(future, ref, timeout)
        finally:
            link.pending.pop(call_id, None)

    def _no_actor(self, name: str) -> Exception:
        if self._is_closed:
            return TransportClosedError("the actor system is shut down")
        return ActorDeadError(f"no actor named {name!r} is running")

    async def _wait(self, future: asyncio.Future[Any], ref: ActorRef, timeout: float | None) -> Any:
        if timeout is None:
            return await future
        bucket = self._timeouts.add(future, ref, timeout)
        try:
            return await future
        finally:
            self._timeouts.discard(bucket, future)

    def _deliver(self, link: PeerLink, envelope: Tell | Ask) -> None:
        """Hand a peer's message to a local actor (or to the system itself)."""
        if self.fault_hook is not None and self._hooked(
            envelope.target, envelope.body, self._deliver, link, envelope
        ):
            return
        is_ask = type(envelope) is Ask
        reply = RemoteReply(link, envelope.call_id) if is_ask else None  # type: ignore[union-attr]
        if envelope.target == SYSTEM_TARGET:
            if reply is not None:
                self._answer_system(envelope.body, reply)
            return
        cell = self._cells.get(envelope.target)
        try:
            if cell is None:
                raise ActorDeadError(f"no actor named {envelope.target!r} is running")
            cell.offer(link.incoming(envelope.body), reply)
        except (ActorDeadError, MailboxFullError) as exc:
            if reply is not None:
                fail_reply(reply, exc)
            else:
                log.warning("dropped a message from %s: %s", link.label, exc)

    def _hooked(self, target: str, message: Any, send: Callable[..., None], *args: Any) -> bool:
        assert self.fault_hook is not None
        return self.fault_hook(target, message, functools.partial(self._unhooked, send, *args))

    def _unhooked(self, send: Callable[..., None], *args: Any) -> None:
        """Pass on a message the fault hook took, without the hook seeing it again."""
        hook, self.fault_hook = self.fault_hook, None
        try:
            send(*args)
        finally:
            self.fault_hook = hook

    def _answer_system(self, body: Any, reply: RemoteReply) -> None:
        if type(body) is Lookup:
            if body.name in self._cells:
                reply.resolve(Ack())
            else:
                reply.fail(ActorNotFoundError(f"no actor named {body.name!r} at {self.address}"))
        elif type(body) is Ping:
            reply.resolve(Pong(body.seq, body.payload))
        else:
            reply.fail(ProtocolError(f"the system does not answer {type(body).__name__}"))

    # ---------------------------------------------------------------------------- links

    def _ensure_arena(self) -> None:
        if self._arena is None and self.config.shm_arena_bytes > 0 and is_shm_available():
            try:
                self._arena = SharedArena(self.config.shm_arena_bytes)
            except OSError as exc:
                log.warning("no shared-memory arena (%s); tensors will travel as frames", exc)
                self.config = replace(self.config, shm_arena_bytes=0)

    def _make_codec(self, transport: str) -> LinkCodec:
        return LinkCodec(
            max_message_bytes=self.config.max_message_bytes,
            shm_min_bytes=self.config.shm_min_tensor_bytes,
            transport=transport,
            tally=self.transport_tally,
        )

    def _hello(self) -> Hello:
        arena = self._arena
        return Hello(
            system_id=self.system_id,
            addresses=self.addresses,
            pid=os.getpid(),
            host_id=self._host_id,
            max_message_bytes=self.config.max_message_bytes,
            arena=None if arena is None else ArenaInfo(arena.name, arena.nbytes),
        )

    async def serve(self, address: str) -> str:
        """Accept peers at `address` and return the bound address.

        Args:
            address: `inproc://NAME`, `ipc://PATH` (`ipc://` picks a private path) or
                `tcp://HOST:PORT` (loopback unless the config allows remote; port 0 picks one).

        Raises:
            InvalidAddressError: the address is malformed, in use, or not allowed.
        """
        self._check_open()
        scheme = parse_address(address).scheme
        if scheme != "inproc":
            self._ensure_arena()
        make_codec = functools.partial(self._make_codec, scheme)
        listener = listen(
            address, make_codec, allow_remote=self.config.allow_remote, curve=self.config.curve
        )
        self._listeners.append(listener)
        self._served.append(listener.address)
        self._own.add(listener.address)
        self._spawn_task(self._accept_loop(listener), name=f"listener:{listener.address}")
        return listener.address

    async def _accept_loop(self, listener: Listener) -> None:
        async for channel in listener:
            if self._is_closed:
                await channel.aclose()
                continue
            self._add_link(channel, None)

    def _add_link(self, channel: Channel, address: str | None) -> PeerLink:
        link = PeerLink(self, channel, address)
        self._links.add(link)
        if address is not None:
            self._routes[address] = link
        self._spawn_task(self._run_link(link), name=f"link:{address or 'accepted'}")
        return link

    async def _run_link(self, link: PeerLink) -> None:
        await link.channel.deliver(link.on_envelope)
        if not link.is_closed:
            link.lose(PeerLostError(f"{link.label} disconnected"))

    def _link_to(self, address: str) -> PeerLink:
        link = self._routes.get(address)
        if link is not None:
            return link
        self._check_open()
        scheme = parse_address(address).scheme
        if scheme == "peer":
            raise PeerLostError(f"no link to {address} (that system is not connected to this one)")
        if scheme != "inproc":
            self._ensure_arena()
        link = self._add_link(
            connect(address, self._make_codec(scheme), curve=self.config.curve), address
        )
        link.start()
        return link

    async def connect(self, address: str, *, timeout: float = 10.0) -> None:
        """Open a link to the system serving `address` and wait for its handshake.

        Sends work without this (links open on first use); this checks the peer is there.

        Raises:
            PeerLostError: no answer within `timeout`, or the link broke.
            ProtocolError: the peer speaks another protocol version.
        """
        link = self._link_to(address)
        try:
            async with asyncio.timeout(timeout):
                # Shielded: other callers may wait for the same handshake.
                await asyncio.shield(link.handshake)
        except TimeoutError:
            link.lose(PeerLostError(f"no actor system answered at {address} within {timeout} s"))
            raise PeerLostError(
                f"no actor system answered at {address} within {timeout} s"
            ) from None

    def drop_link(self, address: str, error: Exception) -> None:
        """Give up the link to the system at ``address`` now (its process is known dead).

        Its pending asks fail with ``error`` at once instead of at the heartbeat timeout; a
        later send to the address opens a fresh link.
        """
        link = self._routes.get(address)
        if link is not None:
            link.lose(error)

    def on_link_lost(self, callback: Callable[[list[str], Exception], None]) -> None:
        """Call ``callback(addresses, error)`` whenever a link to a peer system is lost.

        ``addresses`` are those the peer was known by (the one connected to, and what it
        said at the handshake); ``error`` is what its pending asks failed with.
        """
        self._link_lost_callbacks.append(callback)

    def _register_link(self, link: PeerLink, hello: Hello) -> None:
        for address in hello.addresses:
            if address in self._own:
                continue
            current = self._routes.get(address)
            # A new system at a known address (a restarted peer) replaces the old link;
            # a second link to the same system keeps the first.
            if current is None or (
                current.peer is not None and current.peer.system_id != hello.system_id
            ):
                self._routes[address] = link

    def _forget_link(self, link: PeerLink, error: Exception | None = None) -> None:
        self._links.discard(link)
        for address in [a for a, routed in self._routes.items() if routed is link]:
            del self._routes[address]
        if error is not None and self._link_lost_callbacks and not self._is_closed:
            addresses = [
                a for a in [link.address, *(link.peer.addresses if link.peer else [])] if a
            ]
            for callback in list(self._link_lost_callbacks):
                try:
                    callback(addresses, error)
                except Exception:
                    log.exception("a link-lost callback failed")

    async def _heartbeat_loop(self) -> None:
        interval = self.config.heartbeat_interval_s
        timeout = self.config.heartbeat_timeout_s
        last_tick = time.monotonic()
        while True:
            await asyncio.sleep(interval)
            now = time.monotonic()
            # If this loop was blocked, peers' messages wait unread: do not blame them.
            stalled = now - last_tick > 2 * interval
            last_tick = now
            for link in list(self._links):
                if stalled:
                    link.last_recv = max(link.last_recv, now - interval)
                error = link.silence_error(now, interval, timeout)
                if error is not None:
                    link.lose(error)
                elif now - link.last_send >= interval:
                    link.send_heartbeat()


def _check_wire(message: Any) -> None:
    if not is_wire_message(message):
        raise ProtocolError(
            f"{type(message).__name__} is not a wire message: only registered "
            "mstar.wire.WireMessage types can be sent to another actor system"
        )
