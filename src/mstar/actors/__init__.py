"""Actors: bounded mailboxes, refs with tell/ask, supervision, links between systems.

`mstar.wire` (the link protocol) sits below the transports, which import it; the
system and the process launcher sit above them, so they load on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from mstar.actors.actor import Actor, RestartPolicy
from mstar.actors.config import SystemConfig
from mstar.actors.ref import DEFAULT_ASK_TIMEOUT_S, ActorRef

if TYPE_CHECKING:
    from mstar.actors.process import SystemProcess
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

_LAZY = {"ActorSystem": "mstar.actors.system", "SystemProcess": "mstar.actors.process"}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'mstar.actors' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
