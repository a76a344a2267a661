"""The serving runtime: placement of nodes on worker ranks (conductor and workers build on it)."""

from __future__ import annotations

from mstar.runtime.placement import NodeGroup, Placement

__all__ = ["NodeGroup", "Placement"]
