"""Actors the actor tests talk to, in this process or in a spawned peer process."""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

from mstar.actors import Actor, ActorSystem
from mstar.wire import Ack, Ping, Pong, TensorBundle


class Echo(Actor):
    """Ping -> Pong; a TensorBundle comes back doubled; Pong(seq=n) -> Pong(pid of this process)."""

    async def handle(self, message: Any) -> Any:
        if type(message) is Ping:
            return Pong(message.seq, message.payload)
        if type(message) is TensorBundle:
            return TensorBundle({k: v * 2 for k, v in message.tensors.items()}, key=message.key)
        if type(message) is Pong:
            return Pong(os.getpid())
        return message


class Counter(Actor):
    """Count told Pings; Pong -> Pong(count); record TensorBundle sums."""

    def __init__(self) -> None:
        self.count = 0
        self.seqs: list[int] = []

    async def handle(self, message: Any) -> Any:
        if type(message) is Ping:
            self.count += 1
            self.seqs.append(message.seq)
            return None
        if type(message) is Pong:
            return Pong(self.count)
        return Ack()


class Failing(Actor):
    """Raise on every message."""

    async def handle(self, message: Any) -> Any:
        raise ValueError(f"cannot handle {type(message).__name__}")


class Stall(Actor):
    """Never answer: every handler waits until the actor is stopped (or cancelled)."""

    async def handle(self, message: Any) -> Any:
        await asyncio.Event().wait()


class Hog(Actor):
    """Ping(seq=n) -> Pong(n) after blocking the event loop for n milliseconds (a long step)."""

    async def handle(self, message: Any) -> Any:
        time.sleep(message.seq / 1000)  # holds the loop: no heartbeat goes out meanwhile
        return Pong(message.seq)


class BadReply(Actor):
    """Answer with something that is not a wire message."""

    async def handle(self, message: Any) -> Any:
        return {"not": "a wire message"}


async def setup(system: ActorSystem) -> None:
    """Spawn one of each (the peer process's setup)."""
    await system.spawn(Echo, name="echo")
    await system.spawn(Counter, name="counter")
    await system.spawn(Failing, name="failing")
    await system.spawn(Stall, name="stall")
    await system.spawn(BadReply, name="bad-reply")
    await system.spawn(Hog, name="hog")
    await system.spawn(Counter, name="tiny", mailbox_size=1)
