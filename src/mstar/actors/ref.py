"""`ActorRef`: how an actor is reached, in this system or another one.

A ref names an actor by its system's address and its name, so it means the same thing in
every process: send `ref.id` inside a message, and the receiver turns it back into a ref with
`system.ref(actor_id)`. A ref is resolved by name on every send; a new actor spawned under
the same name receives what old refs send.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Final

from mstar.wire import ActorId

if TYPE_CHECKING:
    from mstar.actors.system import ActorSystem

__all__ = ["DEFAULT_ASK_TIMEOUT_S", "ActorRef"]

# Bounded by default: an ask that nobody answers fails instead of hanging.
DEFAULT_ASK_TIMEOUT_S: Final = 30.0


class ActorRef:
    """A handle to an actor: `tell` sends and forgets, `ask` sends and awaits the reply."""

    __slots__ = ("_system", "address", "name")

    def __init__(self, system: ActorSystem, address: str, name: str) -> None:
        self._system = system
        self.address = address
        self.name = name

    @property
    def id(self) -> ActorId:
        """This ref as a wire value, to put in messages."""
        return ActorId(self.address, self.name)

    def tell(self, message: Any) -> None:
        """Send `message` without waiting for anything.

        A remote actor that is not running, or whose mailbox is full, drops the message; its
        system logs that. Use `ask` when the sender must know.

        Raises:
            ActorDeadError: the actor is local and not running.
            MailboxFullError: the actor is local and its mailbox is full.
            ProtocolError: the actor is remote and `message` is not a wire message.
            TransportClosedError: the link or the system is closed.
        """
        self._system._tell(self, message)

    async def ask(self, message: Any, *, timeout: float | None = DEFAULT_ASK_TIMEOUT_S) -> Any:
        """Send `message` and return the actor's reply.

        Args:
            message: any object for a local actor; a registered `mstar.wire.WireMessage` for a
                remote one.
            timeout: seconds to wait for the reply; None waits as long as the link lives.

        Raises:
            AskTimeoutError: no reply within `timeout`.
            ActorDeadError: the actor is not running, or stopped before answering.
            ActorHandlerError: the actor's handler raised.
            MailboxFullError: the actor's mailbox is full.
            PeerLostError: the actor's system went away before answering.
            ProtocolError: the message or the reply is not a wire message (remote actors).
            TransportClosedError: the link or this system is closed.
        """
        return await self._system._ask(self, message, timeout)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ActorRef):
            return NotImplemented
        return self.address == other.address and self.name == other.name

    def __hash__(self) -> int:
        return hash((self.address, self.name))

    def __repr__(self) -> str:
        return f"ActorRef({self.name!r} at {self.address})"
