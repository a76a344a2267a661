"""`ActorCell`: the task that runs one actor, supervises it and answers for it when it stops."""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from mstar.actors.actor import Actor, RestartPolicy
from mstar.actors.mailbox import Mailbox
from mstar.errors import ActorDeadError, ActorHandlerError

if TYPE_CHECKING:
    from mstar.actors.ref import ActorRef
    from mstar.actors.system import ActorSystem

__all__ = ["ActorCell", "fail_reply", "handler_error", "resolve_reply"]

log = logging.getLogger(__name__)


def resolve_reply(reply: Any, value: Any) -> None:
    """Deliver `value` to whoever asked (a future in this process, or a `RemoteReply`)."""
    if isinstance(reply, asyncio.Future):
        if not reply.done():
            reply.set_result(value)
    else:
        reply.resolve(value)


def fail_reply(reply: Any, error: BaseException) -> None:
    """Deliver `error` to whoever asked."""
    if isinstance(reply, asyncio.Future):
        if not reply.done():
            reply.set_exception(error)
    else:
        reply.fail(error)


def handler_error(name: str, exc: BaseException) -> ActorHandlerError:
    """Wrap an exception raised by actor `name`'s handler for the asker."""
    error = ActorHandlerError(
        f"actor {name!r} failed: {type(exc).__name__}: {exc}", error_type=type(exc).__name__
    )
    error.__cause__ = exc
    return error


class _Failed:
    """Queued in place of a told message whose `handle_now` raised `error`."""

    __slots__ = ("error",)

    def __init__(self, error: Exception) -> None:
        self.error = error


class ActorCell:
    """Run one actor: start it, feed it its mailbox, restart it on crashes, stop it.

    Args:
        system: the owning system.
        ref: the actor's ref.
        factory: makes a fresh instance (again after each crash).
        mailbox_size: mailbox capacity.
        restart: None never restarts.
    """

    def __init__(
        self,
        system: ActorSystem,
        ref: ActorRef,
        factory: Callable[[], Actor],
        mailbox_size: int,
        restart: RestartPolicy | None,
    ) -> None:
        self.system = system
        self.ref = ref
        self.name = ref.name
        self.factory = factory
        self.restart = restart
        self.mailbox: Mailbox[tuple[Any, Any]] = Mailbox(mailbox_size, ref.name)
        self.started: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.done = asyncio.Event()
        self.task: asyncio.Task[None] | None = None
        self.is_stopping = False
        self.num_restarts = 0
        self._restart_times: collections.deque[float] = collections.deque()
        # The running instance while it waits for mail with nothing queued (else None).
        self._idle: Actor | None = None

    def offer(self, message: Any, reply: Any) -> None:
        """Queue a message (`reply` None for a tell), or hand it to an idle actor's `handle_now`.

        Raises:
            ActorDeadError: the actor is stopping or stopped.
            MailboxFullError: the mailbox is full.
        """
        actor = self._idle
        if (
            actor is not None
            and reply is None
            and type(message) in actor.immediate_types
            and not self.is_stopping
            and not self.mailbox
        ):
            try:
                actor.handle_now(message)
            except Exception as exc:
                # `on_failure` is a coroutine: the actor's task runs it next.
                self.mailbox.put((_Failed(exc), message))
            return
        self.mailbox.put((message, reply))

    def request_stop(self) -> None:
        """Stop after the current message; fail queued asks now."""
        if self.is_stopping:
            return
        self.is_stopping = True
        self._fail_queued(self.mailbox.close())

    def _fail_queued(self, items: list[tuple[Any, Any]]) -> None:
        for _, reply in items:
            if reply is not None:
                fail_reply(reply, ActorDeadError(f"actor {self.name!r} stopped"))

    async def run(self) -> None:
        """Run the actor until it stops; never raises except on cancellation."""
        try:
            while True:
                actor = await self._start_instance()
                if actor is None:
                    break
                crashed = await self._serve(actor)
                await self._stop_instance(actor)
                if not crashed or not self._may_restart():
                    break
        finally:
            self.request_stop()
            if not self.started.done():
                self.started.set_exception(
                    ActorDeadError(f"actor {self.name!r} stopped while starting")
                )
            self.system._unregister(self)
            self.done.set()

    async def _start_instance(self) -> Actor | None:
        while not self.is_stopping:
            try:
                actor = self.factory()
                actor.name, actor.ref, actor.system = self.name, self.ref, self.system
                await actor.on_start()
            except Exception as exc:
                log.error("actor %r failed to start", self.name, exc_info=exc)
                if self._may_restart():
                    continue
                if not self.started.done():
                    error = ActorDeadError(
                        f"actor {self.name!r} failed to start: {type(exc).__name__}: {exc}"
                    )
                    error.__cause__ = exc
                    self.started.set_exception(error)
                return None
            if not self.started.done():
                self.started.set_result(None)
            return actor
        return None

    async def _serve(self, actor: Actor) -> bool:
        """Handle messages until stopped (return False) or crashed (return True)."""
        mailbox = self.mailbox
        try:
            while not self.is_stopping:
                if not mailbox:
                    self._idle = actor
                item = await mailbox.get()
                self._idle = None
                if item is None:
                    return False
                if type(item[0]) is _Failed:
                    if await self._on_failure(actor, item[0].error, item[1]):
                        return True
                elif await self._handle(actor, *item):
                    return True
                # Drop the message here, so that tensors in it can be freed while we wait.
                item = None
            return False
        finally:
            self._idle = None

    async def _handle(self, actor: Actor, message: Any, reply: Any) -> bool:
        """Handle one message; return whether the actor crashed."""
        try:
            result = await actor.handle(message)
        except asyncio.CancelledError:
            if reply is not None:
                fail_reply(reply, ActorDeadError(f"actor {self.name!r} was cancelled"))
            raise
        except Exception as exc:
            if reply is not None:
                fail_reply(reply, handler_error(self.name, exc))
                return False
            return await self._on_failure(actor, exc, message)
        if reply is not None:
            resolve_reply(reply, result)
        return False

    async def _on_failure(self, actor: Actor, exc: Exception, message: Any) -> bool:
        """Run `on_failure` for a told message that raised; return whether the actor crashed."""
        try:
            await actor.on_failure(exc, message)
        except Exception as crash:
            log.error("actor %r crashed", self.name, exc_info=crash)
            return True
        return False

    async def _stop_instance(self, actor: Actor) -> None:
        try:
            await actor.on_stop()
        except Exception as exc:
            log.error("actor %r failed in on_stop", self.name, exc_info=exc)

    def _may_restart(self) -> bool:
        policy = self.restart
        if policy is None or self.is_stopping:
            return False
        now = time.monotonic()
        while self._restart_times and now - self._restart_times[0] > policy.window_s:
            self._restart_times.popleft()
        if len(self._restart_times) >= policy.max_restarts:
            log.error(
                "actor %r crashed %d times within %s s; stopping it",
                self.name,
                len(self._restart_times) + 1,
                policy.window_s,
            )
            return False
        self._restart_times.append(now)
        self.num_restarts += 1
        log.warning("restarting actor %r (restart %d)", self.name, self.num_restarts)
        return True
