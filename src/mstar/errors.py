"""Every error mstar raises: one root, flat and precisely named subclasses."""

from __future__ import annotations

__all__ = [
    "MStarError",
    "GraphValidationError",
    "WalkExecutionError",
]


class MStarError(Exception):
    """Root of every error raised by mstar."""


class GraphValidationError(MStarError, ValueError):
    """Raised when a `ModelGraph` (nodes, edges, walks, partitions) is inconsistent."""


class WalkExecutionError(MStarError, RuntimeError):
    """Raised when a node fails while a walk runs; names the node, walk and request."""

    def __init__(self, message: str, *, node: str, walk: str, request_id: str) -> None:
        super().__init__(f"{message} (node {node!r}, walk {walk!r}, request {request_id!r})")
        self.node = node
        self.walk = walk
        self.request_id = request_id
