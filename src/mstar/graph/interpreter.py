"""The reference interpreter: the walks of a `ModelGraph` for one request, in plain Python.

It is the oracle the distributed runtime is tested against, so it favours obviousness over
speed. Each partition runs as a generator that yields after every node firing; partitions
take turns, so a stream consumer fires while its producer is still looping.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from mstar.errors import WalkDeadlockError, WalkExecutionError
from mstar.graph.model_graph import ModelGraph
from mstar.graph.nodes import EMIT, Edge, GraphEdge, GraphNode, StreamingGraphEdge
from mstar.graph.walks import DynamicLoop, Loop, Parallel, Section, Sequential, iter_node_refs
from mstar.streaming import StreamBuffer

__all__ = [
    "Emission",
    "NodeFn",
    "WalkStateMachine",
    "accumulated_edges",
    "concat_values",
    "run_reference",
]

NodeFn = Callable[[Mapping[str, Any]], Mapping[str, Any]]
"""A node's computation: input name -> value in, output (or signal) name -> value out."""

Slot = tuple[str, str]


class WalkStateMachine(Protocol):
    """Picks each partition's walks for one request (a model implements this)."""

    def first_walk(self, partition: str, state: Any) -> str | None:
        """Return the partition's first walk, or None if it has nothing to do."""
        ...

    def next_walk(self, partition: str, state: Any, finished: str) -> str | None:
        """Return the walk after ``finished``, or None when the partition is done."""
        ...


@dataclass(frozen=True, slots=True)
class Emission:
    """One value streamed to the client through an `EMIT` edge."""

    partition: str
    walk: str
    node: str
    name: str
    modality: str
    value: Any


def concat_values(values: list[Any]) -> Any:
    """Concatenate per-iteration values: tensors along dim 0 (scalars stacked), lists joined.

    No values (the producer never output the name) concatenate to an empty list.
    """
    if values and all(isinstance(v, torch.Tensor) for v in values):
        return torch.stack(values) if values[0].dim() == 0 else torch.cat(values)
    if values and all(isinstance(v, list | tuple) for v in values):
        return [x for v in values for x in v]
    return list(values)


@dataclass
class _Env:
    values: dict[Slot, Any]
    signals: dict[str, Any] = field(default_factory=dict)


@dataclass
class _Accumulator:
    names: frozenset[str]
    body: frozenset[str]
    held: dict[tuple[str, str], list[Any]] = field(default_factory=dict)  # (node, name) -> values


class _Run:
    def __init__(
        self,
        graph: ModelGraph,
        nodes: Mapping[str, NodeFn],
        inputs: Mapping[str, Mapping[str, Any]],
        plan: WalkStateMachine,
        state: Any,
        request_id: str,
    ) -> None:
        missing = sorted(set(graph.nodes) - set(nodes))
        if missing:
            raise ValueError(f"no callable given for nodes {missing}")
        self.graph, self.nodes, self.plan, self.state, self.request_id = (
            graph,
            nodes,
            plan,
            state,
            request_id,
        )
        self.persistent: dict[Slot, Any] = {
            (n, k): v for n, vals in inputs.items() for k, v in vals.items()
        }
        self.emissions: list[Emission] = []
        self.buffers: dict[Slot, StreamBuffer[Any]] = {}
        for src in graph.nodes.values():
            for e in src.outputs:
                if isinstance(e, StreamingGraphEdge) and (e.dst, e.name) not in self.buffers:
                    policy = graph.connection_for(src.name, e).policy
                    self.buffers[(e.dst, e.name)] = StreamBuffer(policy)

    # --- scheduling ------------------------------------------------------------------------

    def run(self) -> list[Emission]:
        live = {p: self._partition(p) for p in self.graph.partitions}
        while live:
            progressed = False
            for part, gen in list(live.items()):
                try:
                    progressed |= next(gen)
                except StopIteration:
                    del live[part]
                    progressed = True
            if not progressed:
                raise WalkDeadlockError(
                    f"request {self.request_id!r}: partitions {sorted(live)} all wait for stream "
                    "chunks that can never arrive"
                )
        return self.emissions

    def _partition(self, part: str) -> Iterator[bool]:
        walk = self.plan.first_walk(part, self.state)
        while walk is not None:
            if walk not in self.graph.walks or self.graph.walk_partition[walk] != part:
                raise ValueError(
                    f"walk state machine chose {walk!r}, which is not a walk of partition {part!r}"
                )
            env = _Env(
                {
                    s: v
                    for s, v in self.persistent.items()
                    if self.graph.node_partition[s[0]] == part
                }
            )
            for slot in self._stream_slots(walk):
                while (chunk := self.buffers[slot].next_chunk()) is None:
                    if self.buffers[slot].is_over:
                        self._close_streams_from(part)
                        return  # the stream is over, and with it this partition
                    yield False
                env.values[slot] = chunk
            yield from self._section(walk, self.graph.walks[walk], env, [])
            walk = self.plan.next_walk(part, self.state, walk)
        self._close_streams_from(part)

    def _stream_slots(self, walk: str) -> list[Slot]:
        return [
            (n.name, i)
            for n in self.graph.walk_nodes(walk)
            for i in sorted(n.inputs)
            if (n.name, i) in self.buffers
        ]

    def _close_streams_from(self, part: str) -> None:
        for src in self.graph.nodes.values():
            if self.graph.node_partition[src.name] != part:
                continue
            for e in src.outputs:
                if isinstance(e, StreamingGraphEdge):
                    self.buffers[(e.dst, e.name)].close()

    # --- walks ---------------------------------------------------------------------------------

    def _section(
        self, walk: str, sec: Section, env: _Env, accs: list[_Accumulator]
    ) -> Iterator[bool]:
        if isinstance(sec, GraphNode):
            self._fire(walk, sec, env, accs)
            yield True
        elif isinstance(sec, Sequential):
            for s in sec.sections:
                yield from self._section(walk, s, env, accs)
        elif isinstance(sec, Parallel):
            before = dict(env.values)
            branches = [_Env(dict(before), dict(env.signals)) for _ in sec.sections]
            for s, benv in zip(sec.sections, branches, strict=True):
                yield from self._section(walk, s, benv, accs)
            for benv in branches:  # gather what each branch wrote (validation keeps them disjoint)
                env.values.update(
                    {k: v for k, v in benv.values.items() if before.get(k, benv) is not v}
                )
                env.signals.update(benv.signals)
        elif isinstance(sec, Loop):
            acc = _Accumulator(sec.accumulated_outputs, _body_names(sec.body))
            for _ in range(sec.max_iters):
                yield from self._section(walk, sec.body, env, [*accs, acc])
            for node, name, edges in accumulated_edges(sec, self.graph):
                values = acc.held.get((node.name, name), [])
                self._route(walk, node, name, concat_values(values), edges, env, accs)
        else:
            assert isinstance(sec, DynamicLoop)
            env.signals.pop(sec.stop, None)
            i = 0
            while sec.max_iters is None or i < sec.max_iters:
                yield from self._section(walk, sec.body, env, accs)
                i += 1
                if bool(env.signals.pop(sec.stop, False)):
                    break

    def _fire(self, walk: str, node: GraphNode, env: _Env, accs: list[_Accumulator]) -> None:
        def fail(message: str) -> WalkExecutionError:
            return WalkExecutionError(
                message, node=node.name, walk=walk, request_id=self.request_id
            )

        try:
            args = {i: env.values[(node.name, i)] for i in node.inputs}
        except KeyError as exc:
            raise fail(f"input {exc.args[0][1]!r} is missing when the node fires") from None
        try:
            out = self.nodes[node.name](args)
        except Exception as exc:
            raise fail(f"node raised {type(exc).__name__}: {exc}") from exc
        unknown = set(out) - node.output_names - node.signals
        if unknown:
            raise fail(f"node returned unknown outputs {sorted(unknown)}")
        for name, value in out.items():
            if name in node.signals:
                env.signals[name] = value
            else:
                self._route(
                    walk, node, name, value, [e for e in node.outputs if e.name == name], env, accs
                )

    def _route(
        self,
        walk: str,
        node: GraphNode,
        name: str,
        value: Any,
        edges: list[Edge],
        env: _Env,
        accs: list[_Accumulator],
    ) -> None:
        # Values leaving the innermost loop that accumulates this name are held back; the
        # loop routes their concatenation along the same edges when it ends.
        acc = next((a for a in reversed(accs) if name in a.names), None)
        held = [e for e in edges if acc is not None and e.dst not in acc.body]
        if acc is not None and held:
            acc.held.setdefault((node.name, name), []).append(value)
        for e in edges:
            if e in held:
                continue
            if isinstance(e, StreamingGraphEdge):
                self.buffers[(e.dst, e.name)].put([value])
            elif e.dst == EMIT:
                assert e.modality is not None
                part = self.graph.node_partition[node.name]
                self.emissions.append(Emission(part, walk, node.name, name, e.modality, value))
            else:
                env.values[(e.dst, e.name)] = value
                if isinstance(e, GraphEdge) and e.persist:
                    self.persistent[(e.dst, e.name)] = value


def accumulated_edges(loop: Loop, graph: ModelGraph) -> list[tuple[GraphNode, str, list[Edge]]]:
    """Return (producer, name, edges leaving the loop) for each accumulated output of a loop."""
    body = _body_names(loop.body)
    out = []
    for name in sorted(body):
        node = graph.nodes[name]
        for acc_name in sorted(loop.accumulated_outputs & node.output_names):
            edges = [e for e in node.outputs if e.name == acc_name and e.dst not in body]
            if edges:
                out.append((node, acc_name, edges))
    return out


def _body_names(section: Section) -> frozenset[str]:
    return frozenset(n.name if isinstance(n, GraphNode) else n for n in iter_node_refs(section))


def run_reference(
    graph: ModelGraph,
    nodes: Mapping[str, NodeFn],
    inputs: Mapping[str, Mapping[str, Any]],
    plan: WalkStateMachine,
    *,
    state: Any = None,
    request_id: str = "request",
) -> list[Emission]:
    """Run one request through ``graph`` and return what it emitted, in order.

    Args:
        graph: The model graph.
        nodes: Node name to its callable.
        inputs: Request inputs: node name to {input name: value} (the graph's ``inputs``).
        plan: Picks each partition's walks (``first_walk`` / ``next_walk``).
        state: Per-request state handed to ``plan``.
        request_id: Named in errors.

    A walk whose nodes take a streamed input fires once per chunk, waiting until one is
    ready; when its stream is over (the last chunk was consumed) its partition ends, unless
    the connection's policy has ``continue_after_done``, in which case the walk
    gets an empty final chunk and the state machine decides when to stop.

    Raises:
        WalkExecutionError: A node raised or could not fire (names node, walk, request).
        WalkDeadlockError: Partitions wait on each other's streams forever.
    """
    return _Run(graph, nodes, inputs, plan, state, request_id).run()
