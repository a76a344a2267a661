"""`Mailbox`: an actor's bounded FIFO of pending messages.

A deque plus at most one waiting getter: cheaper than `asyncio.Queue` on the hot path, and a
get that finds a message returns without suspending.
"""

from __future__ import annotations

import asyncio
import collections
from typing import Generic, TypeVar

from mstar.errors import ActorDeadError, MailboxFullError

__all__ = ["Mailbox"]

T = TypeVar("T")


class Mailbox(Generic[T]):
    """A bounded FIFO read by one task.

    Args:
        capacity: the most items it holds; `put` beyond that raises `MailboxFullError`.
        owner: a name for error messages.
    """

    __slots__ = ("_closed", "_items", "_waiter", "capacity", "owner")

    def __init__(self, capacity: int, owner: str = "actor") -> None:
        if capacity < 1:
            raise ValueError(f"mailbox capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self.owner = owner
        self._items: collections.deque[T] = collections.deque()
        self._waiter: asyncio.Future[None] | None = None
        self._closed = False

    def __len__(self) -> int:
        return len(self._items)

    @property
    def is_closed(self) -> bool:
        """Whether `close` ran."""
        return self._closed

    def put(self, item: T) -> None:
        """Append `item`.

        Raises:
            ActorDeadError: the mailbox is closed (its actor stopped).
            MailboxFullError: it holds `capacity` items already.
        """
        if self._closed:
            raise ActorDeadError(f"actor {self.owner!r} is stopped")
        if len(self._items) >= self.capacity:
            raise MailboxFullError(
                f"mailbox of actor {self.owner!r} is full ({self.capacity} messages)"
            )
        self._items.append(item)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def get(self) -> T | None:
        """Return the oldest item, waiting for one; None once the mailbox is closed."""
        while not self._items:
            if self._closed:
                return None
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return self._items.popleft()

    def close(self) -> list[T]:
        """Refuse further items, wake the getter, and return the items never got."""
        self._closed = True
        items = list(self._items)
        self._items.clear()
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)
        return items
