"""`Actor`: the base class of every runtime role, and its `RestartPolicy`.

An actor handles one message at a time, in arrival order, from a bounded mailbox. Its
lifecycle, run by the actor system:

    factory() -> on_start() -> handle(m1), handle(m2), ... -> on_stop()

- `handle` returns the reply of an `ask` (ignored for a `tell`). If it raises during an ask,
  the asker gets `ActorHandlerError` and the actor goes on; during a tell, `on_failure` runs
  and the actor goes on, unless `on_failure` raises: that crashes the actor.
- A crash (in `on_start` or `on_failure`) runs `on_stop`, then the restart policy decides:
  a fresh instance from the factory takes over the same mailbox, or the actor stops.
- When the actor stops, every message still queued is dropped and queued asks fail with
  `ActorDeadError`.
- A told message of one of `immediate_types` that finds the actor idle (nothing queued, no
  handler running) goes to `handle_now` at once, in the sender's call: one task switch less
  per message, with the same order and one-at-a-time guarantees.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    from mstar.actors.ref import ActorRef
    from mstar.actors.system import ActorSystem

__all__ = ["Actor", "RestartPolicy"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class RestartPolicy:
    """Restart a crashed actor at most `max_restarts` times within any `window_s` seconds."""

    max_restarts: int = 3
    window_s: float = 60.0

    def __post_init__(self) -> None:
        if self.max_restarts < 0:
            raise ValueError(f"max_restarts must be >= 0, got {self.max_restarts}")
        if self.window_s <= 0:
            raise ValueError(f"window_s must be > 0, got {self.window_s}")


class Actor:
    """Base class of actors: override `handle`, and the hooks you need.

    The system sets `name`, `ref` and `system` before `on_start` runs.
    """

    name: str
    ref: ActorRef
    system: ActorSystem
    # Told messages of these types may be handled by `handle_now` instead of `handle`.
    immediate_types: ClassVar[frozenset[type]] = frozenset()

    async def on_start(self) -> None:
        """Set up; runs before the first message. Raising here is a crash."""

    async def on_stop(self) -> None:
        """Release resources; runs after the last message, and after a crash."""

    async def on_failure(self, error: Exception, message: Any) -> None:
        """React to `handle` raising on a told message; log it by default. Raise to crash."""
        log.error("actor %r failed on %s", self.name, type(message).__name__, exc_info=error)

    async def handle(self, message: Any) -> Any:
        """Handle one message; return the reply of an ask (None when there is nothing to say)."""
        raise NotImplementedError(f"{type(self).__name__} does not handle {type(message).__name__}")

    def handle_now(self, message: Any) -> None:
        """Handle a told message of one of `immediate_types` synchronously.

        The system calls this instead of queueing the message when the actor is idle; when it
        is busy, the message is queued and `handle` gets it, so both must do the same. It runs
        inside the sender's call (or a link's receive callback): it must not block. If it
        raises, `on_failure` runs next, as when `handle` raises on a told message.
        """
        raise NotImplementedError(
            f"{type(self).__name__} does not handle {type(message).__name__} at once"
        )
