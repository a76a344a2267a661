"""`WalkRunner`: one walk of one request, on one worker, in step with the other workers.

Every worker that hosts a node of the walk runs the same section tree with the reference
interpreter's semantics. A node placed here fires (through its engine) once its inputs are
present; a node placed elsewhere is skipped, and the values it sends to nodes here become
placeholders, resolved when its message arrives. Control flow is the same everywhere:
`Loop` counts are static, and a `DynamicLoop`'s stop signal travels from the worker that
raised it to the others. Values flow worker to worker directly; the conductor only sees
emissions, stream items and the walk's persisted values.

Messages are matched by key, so arrival order does not matter::

    (producer node, tag, destination node or "$signal", name)

where ``tag`` is the producer's firing count in this walk ("3"), or "acc<k>" for what the
k-th pass of an accumulating loop delivers at its end.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from mstar.errors import WalkExecutionError
from mstar.graph import (
    EMIT,
    DynamicLoop,
    Edge,
    GraphEdge,
    GraphNode,
    Loop,
    ModelGraph,
    Parallel,
    Section,
    Sequential,
    StreamingGraphEdge,
    accumulated_edges,
    concat_values,
    iter_node_refs,
)

__all__ = ["SIGNAL", "ValueKey", "WalkPorts", "WalkRunner"]

Slot = tuple[str, str]
ValueKey = tuple[str, str, str, str]
SIGNAL = "$signal"


class WalkPorts(Protocol):
    """How a `WalkRunner` reaches engines, peers and the conductor."""

    def fire(self, node: str, inputs: Mapping[str, Any]) -> Awaitable[Mapping[str, Any]]:
        """Run a local node on this request's inputs (batched by its engine)."""
        ...

    def send(self, rank: int, items: list[tuple[ValueKey, Any]]) -> None:
        """Send values (those of one firing) to the runner of this walk on another rank."""
        ...

    def emit(self, node: str, name: str, modality: str, value: Any) -> None:
        """Stream a value to the client (via the conductor)."""
        ...

    def stream(self, node: str, edge: StreamingGraphEdge, value: Any) -> None:
        """Append one item to a stream into another partition (via the conductor)."""
        ...

    def loop(
        self,
        node: str,
        inputs: Mapping[str, Any],
        max_iters: int | None,
        sink: Callable[[Mapping[str, Any]], None],
    ) -> Awaitable[None] | None:
        """Run a `DynamicLoop` over a local node natively, calling ``sink`` with each step's
        outputs.

        The awaitable ends with the loop (raising what ended it: the node's failure, or an
        exception ``sink`` raised). Return None when the node's engine has no native loop
        (the runner then fires the node once per iteration).
        """
        ...


_MISSING: Any = object()


class _Pending:
    """A value another worker will send; resolved once, shared by every env that holds it."""

    __slots__ = ("key", "value")
    _UNSET: Any = object()

    def __init__(self, key: ValueKey) -> None:
        self.key = key
        self.value: Any = _Pending._UNSET


@dataclass
class _Env:
    values: dict[Slot, Any]
    signals: dict[str, Any] = field(default_factory=dict)


@dataclass
class _Acc:
    names: frozenset[str]
    body: frozenset[str]
    held: dict[tuple[str, str], list[Any]] = field(default_factory=dict)


class WalkRunner:
    """Run this worker's share of one walk for one request.

    Args:
        graph: The model graph.
        walk: The walk's name.
        rank: This worker's rank.
        node_ranks: The rank of every node of the walk.
        initial: Starting values of this worker's input slots (persisted values, request
            inputs, a stream chunk).
        ports: Engines, peers and conductor.
        request_id: For errors.
    """

    def __init__(
        self,
        graph: ModelGraph,
        walk: str,
        rank: int,
        node_ranks: Mapping[str, int],
        initial: Mapping[Slot, Any],
        ports: WalkPorts,
        request_id: str,
    ) -> None:
        self.graph, self.walk, self.rank = graph, walk, rank
        self.node_ranks = node_ranks
        self.ports = ports
        self.request_id = request_id
        self.persisted: dict[Slot, Any] = {}
        self._initial = dict(initial)
        self._others = sorted(set(node_ranks.values()) - {rank})
        self._inbox: dict[ValueKey, asyncio.Future[Any]] = {}  # awaited, not arrived yet
        self._arrived: dict[ValueKey, Any] = {}  # arrived, not awaited yet (no future for those)
        self._fired: Counter[str] = Counter()
        self._outgoing: dict[int, list[tuple[ValueKey, Any]]] = {}  # sent once per firing
        self._loop_passes: Counter[int] = Counter()

    def deliver(self, key: ValueKey, value: Any) -> None:
        """Accept a value from another worker (before or after this runner needs it)."""
        future = self._inbox.pop(key, None)
        if future is None:
            self._arrived.setdefault(key, value)
        elif not future.done():
            future.set_result(value)

    async def run(self) -> dict[Slot, Any]:
        """Run the walk; return the values this worker sent along persist edges."""
        await self._section(self.graph.walks[self.walk], _Env(self._initial), [], frozenset())
        return self.persisted

    # --- traversal ---------------------------------------------------------------------------

    async def _section(
        self, sec: Section, env: _Env, accs: list[_Acc], stops: frozenset[str]
    ) -> None:
        if isinstance(sec, GraphNode):
            if self.node_ranks[sec.name] == self.rank:
                await self._fire(sec, env, accs, stops)
            else:
                self._expect(sec, env, accs, stops)
        elif isinstance(sec, Sequential):
            for s in sec.sections:
                # as above, without a coroutine per node (a loop body's every step)
                if isinstance(s, GraphNode):
                    if self.node_ranks[s.name] == self.rank:
                        await self._fire(s, env, accs, stops)
                    else:
                        self._expect(s, env, accs, stops)
                else:
                    await self._section(s, env, accs, stops)
        elif isinstance(sec, Parallel):
            before = dict(env.values)
            branches = [_Env(dict(before), dict(env.signals)) for _ in sec.sections]
            await _all(
                self._section(s, b, accs, stops)
                for s, b in zip(sec.sections, branches, strict=True)
            )
            for b in branches:
                env.values.update({k: v for k, v in b.values.items() if before.get(k, b) is not v})
                env.signals.update(b.signals)
        elif isinstance(sec, Loop):
            acc = _Acc(sec.accumulated_outputs, frozenset(n.name for n in _nodes(sec.body)))
            for _ in range(sec.max_iters):
                await self._section(sec.body, env, [*accs, acc], stops)
            self._loop_passes[id(sec)] += 1
            tag = f"acc{self._loop_passes[id(sec)]}"
            for node, name, edges in accumulated_edges(sec, self.graph):
                if self.node_ranks[node.name] == self.rank:
                    value = concat_values(acc.held.get((node.name, name), []))
                    self._route(node, tag, name, value, edges, env, accs)
                else:
                    self._expect_edges(node, tag, edges, env, accs)
            self._flush()
        else:
            assert isinstance(sec, DynamicLoop)
            inner = stops | {sec.stop}
            env.signals.pop(sec.stop, None)
            if await self._native_loop(sec, env, accs, inner):
                return
            i = 0
            while sec.max_iters is None or i < sec.max_iters:
                await self._section(sec.body, env, accs, inner)
                i += 1
                stop = env.signals.pop(sec.stop, False)
                if type(stop) is _Pending:
                    stop = await self._resolve(stop)
                if bool(stop):
                    break

    async def _fire(
        self, node: GraphNode, env: _Env, accs: list[_Acc], stops: frozenset[str]
    ) -> None:
        args = self._ready_inputs(node, env)
        if args is None:
            args = await self._inputs(node, env)
        try:
            out = await self.ports.fire(node.name, args)
        except WalkExecutionError:
            raise
        except Exception as exc:
            raise self._error(
                node, f"node raised {type(exc).__name__}: {exc}", type(exc).__name__
            ) from exc
        self._absorb(node, out, env, accs, stops)

    async def _native_loop(
        self, loop: DynamicLoop, env: _Env, accs: list[_Acc], stops: frozenset[str]
    ) -> bool:
        """Hand a `DynamicLoop` over one local node to its engine, if the engine loops natively.

        A KV-cache engine runs the whole loop as its decode loop (continuous batching, the
        stop check per step); each step's outputs are routed as a firing's would be.
        """
        node = loop.body
        if not isinstance(node, GraphNode) or self.node_ranks[node.name] != self.rank:
            return False
        steps = self.ports.loop(
            node.name,
            await self._inputs(node, env),
            loop.max_iters,
            lambda out: self._absorb(node, out, env, accs, stops),
        )
        if steps is None:
            return False
        try:
            await steps
        except WalkExecutionError:
            raise
        except Exception as exc:
            raise self._error(
                node, f"node raised {type(exc).__name__}: {exc}", type(exc).__name__
            ) from exc
        env.signals.pop(loop.stop, None)
        return True

    def _ready_inputs(self, node: GraphNode, env: _Env) -> dict[str, Any] | None:
        """Return the node's inputs if every one is here already (else None: `_inputs` waits)."""
        args: dict[str, Any] = {}
        values = env.values
        name_ = node.name
        for name in node.inputs:
            value = values.get((name_, name), _MISSING)
            if type(value) is _Pending:
                pending = value
                if pending.value is _Pending._UNSET and pending.key in self._arrived:
                    pending.value = self._arrived.pop(pending.key)
                value = pending.value
                if value is _Pending._UNSET:
                    return None
            elif value is _MISSING:
                return None  # `_inputs` names it
            args[name] = value
        return args

    async def _inputs(self, node: GraphNode, env: _Env) -> dict[str, Any]:
        args: dict[str, Any] = {}
        values = env.values
        for name in node.inputs:
            value = values.get((node.name, name), _MISSING)
            if value is _MISSING:
                raise self._error(node, f"input {name!r} is missing when the node fires")
            if type(value) is _Pending:
                value = await self._resolve(value)
            args[name] = value
        return args

    def _absorb(
        self,
        node: GraphNode,
        out: Mapping[str, Any],
        env: _Env,
        accs: list[_Acc],
        stops: frozenset[str],
    ) -> None:
        """Route one firing's outputs and signals."""
        self._fired[node.name] += 1
        tag = str(self._fired[node.name])
        edges_by_name = node.edges_by_name
        for name, value in out.items():
            edges = edges_by_name.get(name)
            if edges is not None:
                self._route(node, tag, name, value, edges, env, accs)
            elif name in node.signals:
                env.signals[name] = value
                if name in stops:
                    for r in self._others:
                        self._outgoing.setdefault(r, []).append(
                            ((node.name, tag, SIGNAL, name), value)
                        )
            else:
                raise self._error(node, f"node returned unknown output {name!r}")
        self._flush()

    def _flush(self) -> None:
        """Send what a firing produced for other ranks: one message per rank."""
        if self._outgoing:
            for rank, items in self._outgoing.items():
                self.ports.send(rank, items)
            self._outgoing = {}

    def _route(
        self,
        node: GraphNode,
        tag: str,
        name: str,
        value: Any,
        edges: Sequence[Edge],
        env: _Env,
        accs: list[_Acc],
    ) -> None:
        if accs:
            acc = next((a for a in reversed(accs) if name in a.names), None)
            if acc is not None:
                held = [e for e in edges if e.dst not in acc.body]
                if held:
                    acc.held.setdefault((node.name, name), []).append(value)
                    edges = [e for e in edges if e not in held]
        for e in edges:
            if isinstance(e, StreamingGraphEdge):
                self.ports.stream(node.name, e, value)
            elif e.dst == EMIT:
                assert e.modality is not None
                self.ports.emit(node.name, name, e.modality, value)
            else:
                if isinstance(e, GraphEdge) and e.persist:
                    self.persisted[(e.dst, e.name)] = value
                rank = self.node_ranks.get(e.dst)
                if rank == self.rank:
                    env.values[(e.dst, e.name)] = value
                elif rank is not None:
                    self._outgoing.setdefault(rank, []).append(
                        ((node.name, tag, e.dst, e.name), value)
                    )

    def _expect(self, node: GraphNode, env: _Env, accs: list[_Acc], stops: frozenset[str]) -> None:
        """Account for a remote node's firing: placeholders for what it sends here."""
        self._fired[node.name] += 1
        tag = str(self._fired[node.name])
        edges: Sequence[Edge] = node.outputs
        if accs:
            edges = []
            for e in node.outputs:
                acc = next((a for a in reversed(accs) if e.name in a.names), None)
                if acc is None or e.dst in acc.body:
                    edges.append(e)
        self._expect_edges(node, tag, edges, env, accs)
        for name in node.signals & stops:
            env.signals[name] = _Pending((node.name, tag, SIGNAL, name))

    def _expect_edges(
        self, node: GraphNode, tag: str, edges: Sequence[Edge], env: _Env, accs: list[_Acc]
    ) -> None:
        for e in edges:
            if (
                isinstance(e, GraphEdge)
                and e.dst != EMIT
                and self.node_ranks.get(e.dst) == self.rank
            ):
                env.values[(e.dst, e.name)] = _Pending((node.name, tag, e.dst, e.name))

    # --- values from other workers ---------------------------------------------------------

    async def _resolve(self, value: Any) -> Any:
        if not isinstance(value, _Pending):
            return value
        if value.value is _Pending._UNSET:
            key = value.key
            arrived = self._arrived.pop(key, _MISSING)
            if arrived is _MISSING:
                future = self._inbox.get(key)
                if future is None:
                    future = self._inbox[key] = asyncio.get_running_loop().create_future()
                arrived = await future
            value.value = arrived
        return value.value

    def _error(self, node: GraphNode, message: str, cause: str = "") -> WalkExecutionError:
        return WalkExecutionError(
            message, node=node.name, walk=self.walk, request_id=self.request_id, cause=cause
        )


def _nodes(section: Section) -> list[GraphNode]:
    return [n for n in iter_node_refs(section) if isinstance(n, GraphNode)]


async def _all(coros: Any) -> None:
    """Run coroutines concurrently; on the first failure cancel the rest and re-raise it."""
    try:
        async with asyncio.TaskGroup() as tg:
            for coro in coros:
                c: Coroutine[Any, Any, None] = coro
                tg.create_task(c)
    except* Exception as group:
        raise group.exceptions[0] from None
