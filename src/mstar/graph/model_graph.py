"""`ModelGraph`: nodes, named walks, partitions and the streams between partitions."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from mstar.errors import GraphValidationError
from mstar.graph.nodes import EMIT, GraphEdge, GraphNode, StreamingGraphEdge
from mstar.graph.walks import DynamicLoop, Loop, Parallel, Section, Sequential, iter_node_refs
from mstar.streaming.policies import (
    ChunkPolicy,
)

__all__ = ["Connection", "ModelGraph"]

Slot = tuple[str, str]  # (node, input name)


@dataclass(frozen=True, slots=True)
class Connection:
    """A stream from partition ``src`` to partition ``dst`` carrying tensor ``name``.

    Every `StreamingGraphEdge` named ``name`` from a node of ``src`` to a node of ``dst``
    goes through this connection; ``policy`` decides when the consumer fires.
    """

    src: str
    dst: str
    name: str
    policy: ChunkPolicy

    def __post_init__(self) -> None:
        if not isinstance(self.policy, ChunkPolicy):
            raise GraphValidationError(
                f"connection {self.src}->{self.dst} {self.name!r}: policy must be a chunk policy, "
                f"got {self.policy!r}"
            )

    def __str__(self) -> str:
        return f"connection {self.src} -> {self.dst}: {self.name}, {self.policy}"


class ModelGraph:
    """A model's computation graph G and its walks W, validated on construction.

    Args:
        walks: Walk name to section. A section may name nodes by string; they resolve to
            the `GraphNode` objects found anywhere in the walks or in ``nodes``.
        partitions: Partition name to the names of its walks. Partitions run
            asynchronously for one request; every node belongs to exactly one.
        connections: The streams between partitions, with their chunk policies.
        inputs: Node name to the input names the request supplies (via preprocessing).
        nodes: Extra node definitions, for walks that name nodes by string.
        name: The model's name, for the text IR.

    Raises:
        GraphValidationError: Naming the offending node, edge or walk.
    """

    def __init__(
        self,
        walks: Mapping[str, Section],
        partitions: Mapping[str, Iterable[str]],
        connections: Iterable[Connection] = (),
        inputs: Mapping[str, Iterable[str]] | None = None,
        nodes: Iterable[GraphNode] = (),
        name: str = "model",
    ) -> None:
        self.name = name
        self.partitions = {p: tuple(ws) for p, ws in partitions.items()}
        self.connections = tuple(connections)
        self.inputs = {n: frozenset(names) for n, names in (inputs or {}).items()}
        self.nodes = self._collect_nodes(walks, nodes)
        self.walks = {w: self._resolve(w, sec) for w, sec in walks.items()}
        self.walk_partition = self._map_walks()
        self.node_partition = self._map_nodes()
        self.validate()

    # --- lookups -------------------------------------------------------------------------

    def connection_for(self, src_node: str, edge: StreamingGraphEdge) -> Connection:
        """Return the connection that carries a streaming edge leaving ``src_node``."""
        key = (self.node_partition[src_node], self.node_partition[edge.dst], edge.name)
        for conn in self.connections:
            if (conn.src, conn.dst, conn.name) == key:
                return conn
        raise GraphValidationError(
            f"streaming edge {edge.name!r} from {src_node!r} to {edge.dst!r} has no chunk policy: "
            f"add Connection({key[0]!r}, {key[1]!r}, {edge.name!r}, <policy>)"
        )

    def walk_nodes(self, walk: str) -> list[GraphNode]:
        """Return the distinct nodes of a walk, in first-use order."""
        seen: dict[str, GraphNode] = {}
        for ref in iter_node_refs(self.walks[walk]):
            assert isinstance(ref, GraphNode)
            seen.setdefault(ref.name, ref)
        return list(seen.values())

    def stream_inputs(self, node: str) -> frozenset[str]:
        """Return the inputs of ``node`` fed by streaming edges."""
        return frozenset(
            e.name
            for src in self.nodes.values()
            for e in src.outputs
            if isinstance(e, StreamingGraphEdge) and e.dst == node
        )

    # --- construction ----------------------------------------------------------------------

    @staticmethod
    def _collect_nodes(
        walks: Mapping[str, Section], extra: Iterable[GraphNode]
    ) -> dict[str, GraphNode]:
        if not walks:
            raise GraphValidationError("a ModelGraph needs at least one walk")
        found: dict[str, GraphNode] = {}
        candidates = list(extra) + [
            ref
            for sec in walks.values()
            for ref in iter_node_refs(sec)
            if isinstance(ref, GraphNode)
        ]
        for node in candidates:
            other = found.setdefault(node.name, node)
            if other is not node and other != node:
                raise GraphValidationError(
                    f"duplicate node name {node.name!r}: two different nodes use it"
                )
        return found

    def _resolve(self, walk: str, section: Section) -> Section:
        if isinstance(section, str):
            if section not in self.nodes:
                raise GraphValidationError(f"walk {walk!r} refers to unknown node {section!r}")
            return self.nodes[section]
        if isinstance(section, GraphNode):
            return self.nodes[section.name]
        if isinstance(section, Sequential):
            return Sequential(self._resolve(walk, s) for s in section.sections)
        if isinstance(section, Parallel):
            return Parallel(self._resolve(walk, s) for s in section.sections)
        if isinstance(section, Loop):
            return Loop(
                self._resolve(walk, section.body), section.max_iters, section.accumulated_outputs
            )
        return DynamicLoop(self._resolve(walk, section.body), section.max_iters, section.stop)

    def _map_walks(self) -> dict[str, str]:
        if not self.partitions:
            raise GraphValidationError("a ModelGraph needs at least one partition")
        owner: dict[str, str] = {}
        for part, walks in self.partitions.items():
            if not walks:
                raise GraphValidationError(f"partition {part!r} has no walks")
            for w in walks:
                if w not in self.walks:
                    raise GraphValidationError(f"partition {part!r} lists unknown walk {w!r}")
                if w in owner:
                    raise GraphValidationError(
                        f"walk {w!r} is in two partitions: {owner[w]!r} and {part!r}"
                    )
                owner[w] = part
        for w in self.walks:
            if w not in owner:
                raise GraphValidationError(f"walk {w!r} is in no partition")
        return owner

    def _map_nodes(self) -> dict[str, str]:
        owner: dict[str, str] = {}
        for walk, part in self.walk_partition.items():
            for node in self.walk_nodes(walk):
                prev = owner.setdefault(node.name, part)
                if prev != part:
                    raise GraphValidationError(
                        f"node {node.name!r} is used by partitions {prev!r} and {part!r} "
                        f"(walk {walk!r}); "
                        "a node belongs to one partition"
                    )
        for name in self.nodes:
            if name not in owner:
                raise GraphValidationError(f"node {name!r} is in no walk")
        return owner

    # --- validation -----------------------------------------------------------------------

    def validate(self) -> None:
        """Check the whole graph; raise `GraphValidationError` naming what is wrong."""
        self._validate_edges()
        self._validate_connections()
        self._validate_inputs()
        for walk, section in self.walks.items():
            self._validate_section(walk, section)
            self._check_available(walk, section, self._initial_slots(self.walk_partition[walk]))

    def _validate_edges(self) -> None:
        for node in self.nodes.values():
            part = self.node_partition[node.name]
            for e in node.outputs:
                if e.dst == EMIT:
                    continue
                if e.dst not in self.nodes:
                    raise GraphValidationError(
                        f"node {node.name!r} has edge {e.name!r} to unknown node {e.dst!r}"
                    )
                if e.name not in self.nodes[e.dst].inputs:
                    raise GraphValidationError(
                        f"edge {e.name!r} from {node.name!r} to {e.dst!r}: {e.dst!r} has no "
                        f"input {e.name!r}"
                    )
                dst_part = self.node_partition[e.dst]
                if isinstance(e, StreamingGraphEdge):
                    if dst_part == part:
                        raise GraphValidationError(
                            f"streaming edge {e.name!r} from {node.name!r} to {e.dst!r} "
                            "stays inside "
                            f"partition {part!r}: use a GraphEdge"
                        )
                    self.connection_for(node.name, e)
                elif dst_part != part:
                    raise GraphValidationError(
                        f"edge {e.name!r} from {node.name!r} ({part}) to {e.dst!r} "
                        f"({dst_part}) crosses "
                        "partitions: use a StreamingGraphEdge with a Connection"
                    )

    def _validate_connections(self) -> None:
        seen: set[tuple[str, str, str]] = set()
        for c in self.connections:
            for p in (c.src, c.dst):
                if p not in self.partitions:
                    raise GraphValidationError(f"{c} names unknown partition {p!r}")
            key = (c.src, c.dst, c.name)
            if key in seen:
                raise GraphValidationError(f"{c} is declared twice")
            seen.add(key)
            used = any(
                isinstance(e, StreamingGraphEdge)
                and e.name == c.name
                and self.node_partition[n.name] == c.src
                and self.node_partition.get(e.dst) == c.dst
                for n in self.nodes.values()
                for e in n.outputs
            )
            if not used:
                raise GraphValidationError(
                    f"{c} carries nothing: no StreamingGraphEdge {c.name!r} matches it"
                )

    def _validate_inputs(self) -> None:
        for node, names in self.inputs.items():
            if node not in self.nodes:
                raise GraphValidationError(f"request inputs name unknown node {node!r}")
            extra = names - self.nodes[node].inputs
            if extra:
                raise GraphValidationError(
                    f"request inputs {sorted(extra)} are not inputs of node {node!r}"
                )

    def _validate_section(self, walk: str, section: Section) -> None:
        if isinstance(section, GraphNode | str):
            return
        if isinstance(section, Sequential | Parallel):
            for s in section.sections:
                self._validate_section(walk, s)
            if isinstance(section, Parallel):
                self._check_disjoint_branches(walk, section)
            return
        self._validate_section(walk, section.body)
        body = [n for n in iter_node_refs(section.body) if isinstance(n, GraphNode)]
        if isinstance(section, Loop):
            produced = {name for n in body for name in n.output_names}
            missing = section.accumulated_outputs - produced
            if missing:
                raise GraphValidationError(
                    f"walk {walk!r}: Loop accumulates {sorted(missing)}, which no node of "
                    "its body outputs"
                )
        elif not any(section.stop in n.signals for n in body):
            why = "can never terminate" if section.max_iters is None else "never stops early"
            raise GraphValidationError(
                f"walk {walk!r} {why}: DynamicLoop stop signal {section.stop!r} is raised by "
                "no node "
                f"of its body ({', '.join(sorted({n.name for n in body}))}); add it to a "
                "node's signals"
            )

    def _check_disjoint_branches(self, walk: str, section: Parallel) -> None:
        writer: dict[Slot, int] = {}
        for i, branch in enumerate(section.sections):
            for ref in iter_node_refs(branch):
                assert isinstance(ref, GraphNode)
                for e in ref.outputs:
                    slot = (e.dst, e.name)
                    if (
                        isinstance(e, GraphEdge)
                        and e.dst != EMIT
                        and writer.setdefault(slot, i) != i
                    ):
                        raise GraphValidationError(
                            f"walk {walk!r}: Parallel branches {writer[slot]} and {i} both "
                            f"write input {e.name!r} of {e.dst!r}"
                        )

    def _initial_slots(self, partition: str) -> set[Slot]:
        slots = {(n, i) for n, names in self.inputs.items() for i in names}
        for node in self.nodes.values():
            for e in node.outputs:
                if isinstance(e, StreamingGraphEdge) or (isinstance(e, GraphEdge) and e.persist):
                    slots.add((e.dst, e.name))
        return {s for s in slots if self.node_partition.get(s[0]) == partition}

    def _check_available(self, walk: str, section: Section, avail: set[Slot]) -> set[Slot]:
        """Return the slots filled after ``section``; raise if a node could fire without an
        input."""
        if isinstance(section, GraphNode):
            missing = sorted(i for i in section.inputs if (section.name, i) not in avail)
            if missing:
                raise GraphValidationError(
                    f"walk {walk!r}: input {missing[0]!r} of node {section.name!r} is "
                    "provided by nothing "
                    "before the node runs (no earlier node, persist edge, stream or request input)"
                )
            return avail | {
                (e.dst, e.name)
                for e in section.outputs
                if isinstance(e, GraphEdge) and e.dst != EMIT
            }
        if isinstance(section, Sequential):
            for s in section.sections:
                avail = self._check_available(walk, s, avail)
            return avail
        if isinstance(section, Parallel):
            out = set(avail)
            for s in section.sections:
                out |= self._check_available(walk, s, avail)
            return out
        assert isinstance(section, Loop | DynamicLoop)
        return self._check_available(walk, section.body, avail)

    # --- text IR ----------------------------------------------------------------------------

    def __str__(self) -> str:
        lines = [f"model {self.name}"]
        if self.inputs:
            slots = sorted(f"{n}.{i}" for n, names in self.inputs.items() for i in names)
            lines.append(f"  inputs: {', '.join(slots)}")
        for node in self.nodes.values():
            outs = ", ".join(str(e) for e in node.outputs) or "-"
            sig = f"; signals: {', '.join(sorted(node.signals))}" if node.signals else ""
            lines.append(f"  node {node.name}({', '.join(sorted(node.inputs))}) -> {outs}{sig}")
        for part, walks in self.partitions.items():
            lines.append(f"  partition {part}")
            for w in walks:
                lines.extend(_format_walk(w, self.walks[w]))
        lines.extend(f"  {c}" for c in self.connections)
        return "\n".join(lines)

    def __repr__(self) -> str:
        return (
            f"ModelGraph({self.name!r}, walks={list(self.walks)}, "
            f"partitions={list(self.partitions)})"
        )


def _format_walk(walk: str, section: Section) -> list[str]:
    if isinstance(section, GraphNode | str):
        return [f"    walk {walk} = {section}"]
    return [f"    walk {walk} =", *_format_section(section, "      ")]


def _format_section(section: Section, indent: str) -> list[str]:
    if isinstance(section, GraphNode | str):
        return [f"{indent}{section}"]
    if isinstance(section, Sequential | Parallel):
        lines = [f"{indent}{type(section).__name__}"]
        return lines + [
            line for s in section.sections for line in _format_section(s, indent + "  ")
        ]
    if isinstance(section, Loop):
        acc = (
            f", accumulated_outputs=[{', '.join(sorted(section.accumulated_outputs))}]"
            if section.accumulated_outputs
            else ""
        )
        head = f"{indent}Loop(max_iters={section.max_iters}{acc})"
    else:
        head = f"{indent}DynamicLoop(max_iters={section.max_iters}, stop={section.stop})"
    return [head, *_format_section(section.body, indent + "  ")]
