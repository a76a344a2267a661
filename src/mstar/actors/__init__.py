"""Actors: bounded mailboxes, refs with tell/ask, supervision, links between systems."""

from __future__ import annotations

from mstar.actors.actor import Actor, RestartPolicy
from mstar.actors.config import SystemConfig
from mstar.actors.process import SystemProcess
from mstar.actors.ref import DEFAULT_ASK_TIMEOUT_S, ActorRef
from mstar.actors.system import ActorSystem

__all__ = [
    "DEFAULT_ASK_TIMEOUT_S",
    "Actor",
    "ActorRef",
    "ActorSystem",
    "RestartPolicy",
    "SystemConfig",
    "SystemProcess",
]
