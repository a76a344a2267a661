"""Graph nodes and the edges that leave them."""

from __future__ import annotations

import functools
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Final

from mstar.errors import GraphValidationError

__all__ = [
    "EMIT",
    "MODALITIES",
    "Edge",
    "GraphEdge",
    "GraphNode",
    "StreamingGraphEdge",
]

EMIT: Final = "EMIT"
"""Destination of an edge whose tensor streams to the client."""

MODALITIES: Final = frozenset({"text", "audio", "image", "video", "action", "latent"})
"""Modalities an `EMIT` edge can be tagged with."""


def _check_name(kind: str, name: object) -> None:
    if not isinstance(name, str) or not name:
        raise GraphValidationError(f"{kind} name must be a non-empty string, got {name!r}")


@dataclass(frozen=True, slots=True)
class GraphEdge:
    """A named tensor flow from the node that lists it to ``dst``.

    Args:
        dst: Name of the receiving node, or `EMIT` to stream the tensor to the client.
        name: Tensor name; also the input name it fills at ``dst``.
        persist: Keep the tensor for the request's next walks (e.g. the last sampled token
            from ``prefill`` to ``decode``), not just for the rest of this walk.
        modality: For `EMIT` edges, one of `MODALITIES`.
    """

    dst: str
    name: str
    persist: bool = False
    modality: str | None = None

    def __post_init__(self) -> None:
        _check_name("edge destination", self.dst)
        _check_name("edge", self.name)
        if self.dst == EMIT:
            if self.modality not in MODALITIES:
                raise GraphValidationError(
                    f"edge {self.name!r} to EMIT needs modality= one of {sorted(MODALITIES)}, "
                    f"got {self.modality!r}"
                )
            if self.persist:
                raise GraphValidationError(f"edge {self.name!r} to EMIT cannot persist")
        elif self.modality is not None:
            raise GraphValidationError(
                f"edge {self.name!r} to {self.dst!r}: modality is only for edges to EMIT"
            )

    def __str__(self) -> str:
        if self.dst == EMIT:
            return f"{self.name} -> EMIT[{self.modality}]"
        return f"{self.name} -> {self.dst}" + (" (persist)" if self.persist else "")


@dataclass(frozen=True, slots=True)
class StreamingGraphEdge:
    """A tensor flow into another partition, delivered in chunks.

    Each value the producer emits on this edge is one stream item. On the consumer side
    items collect in a `StreamBuffer`; the `Connection` between the two partitions names
    the chunk policy, and ``dst``'s input ``name`` receives each `Chunk`.
    """

    dst: str
    name: str

    def __post_init__(self) -> None:
        _check_name("edge destination", self.dst)
        _check_name("edge", self.name)
        if self.dst == EMIT:
            raise GraphValidationError(
                f"streaming edge {self.name!r} cannot go to EMIT: use GraphEdge(EMIT, ...)"
            )

    def __str__(self) -> str:
        return f"{self.name} ~> {self.dst} (stream)"


Edge = GraphEdge | StreamingGraphEdge


@dataclass(frozen=True, init=False)
class GraphNode:
    """One unit of compute (an encoder, an LLM, a codec) and the edges leaving it.

    A node fires with a mapping from each of its ``inputs`` to a value and returns a
    mapping from output names to values; every edge in ``outputs`` with that name carries
    the value. ``signals`` are control outputs that no edge carries, such as the stop flag
    a `DynamicLoop` checks.
    """

    name: str
    inputs: frozenset[str]
    outputs: tuple[Edge, ...]
    signals: frozenset[str] = field(default=frozenset())

    def __init__(
        self,
        name: str,
        inputs: Iterable[str] = (),
        outputs: Iterable[Edge] = (),
        signals: Iterable[str] = (),
    ) -> None:
        _check_name("node", name)
        if name == EMIT:
            raise GraphValidationError(f"{EMIT!r} is reserved and cannot name a node")
        if isinstance(inputs, str) or isinstance(signals, str):
            raise GraphValidationError(
                f"node {name!r}: inputs and signals take a set of names, not a string"
            )
        object.__setattr__(self, "name", name)
        object.__setattr__(self, "inputs", frozenset(inputs))
        object.__setattr__(self, "outputs", tuple(outputs))
        object.__setattr__(self, "signals", frozenset(signals))
        for edge in self.outputs:
            if not isinstance(edge, GraphEdge | StreamingGraphEdge):
                raise GraphValidationError(f"node {name!r}: output {edge!r} is not a GraphEdge")
        seen: set[tuple[str, str]] = set()
        for edge in self.outputs:
            key = (edge.dst, edge.name)
            if key in seen:
                raise GraphValidationError(
                    f"node {name!r} has two edges {edge.name!r} to {edge.dst!r}"
                )
            seen.add(key)
        clash = self.signals & self.output_names
        if clash:
            raise GraphValidationError(
                f"node {name!r}: {sorted(clash)} are both signals and edge names"
            )

    @functools.cached_property
    def output_names(self) -> frozenset[str]:
        """Return the names carried by this node's edges."""
        return frozenset(edge.name for edge in self.outputs)

    @functools.cached_property
    def edges_by_name(self) -> dict[str, tuple[Edge, ...]]:
        """Return this node's edges grouped by the name they carry."""
        out: dict[str, list[Edge]] = {}
        for edge in self.outputs:
            out.setdefault(edge.name, []).append(edge)
        return {name: tuple(edges) for name, edges in out.items()}

    def __str__(self) -> str:
        return self.name
