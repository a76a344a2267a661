"""Walk primitives: `Sequential`, `Parallel`, `Loop` and `DynamicLoop`.

A walk is one of these sections, or a single node, built from nodes (a `GraphNode`, or the
name of a node defined elsewhere in the graph). During a walk every value a node outputs
stays visible to later nodes of the walk (the walk's *environment*); a node fires with the
current values of its inputs.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from mstar.errors import GraphValidationError
from mstar.graph.nodes import GraphNode

__all__ = [
    "DynamicLoop",
    "Loop",
    "Parallel",
    "Section",
    "Sequential",
    "iter_node_refs",
]


def _sections(kind: str, sections: Iterable[Section]) -> tuple[Section, ...]:
    out = tuple(sections)
    if not out:
        raise GraphValidationError(f"{kind} needs at least one section")
    for sec in out:
        if not isinstance(sec, str | GraphNode | Sequential | Parallel | Loop | DynamicLoop):
            raise GraphValidationError(f"{kind}: {sec!r} is not a node, node name or section")
    return out


def _max_iters(kind: str, max_iters: int | None, *, optional: bool = False) -> None:
    if max_iters is None and optional:
        return
    if not isinstance(max_iters, int) or isinstance(max_iters, bool) or max_iters < 1:
        raise GraphValidationError(f"{kind} max_iters must be an integer >= 1, got {max_iters!r}")


@dataclass(frozen=True, init=False)
class Sequential:
    """Run sections one after another; outputs of one feed the next.

    ``Sequential([a, b, ...]) : env -> env``::

        for section in sections:
            env = run(section, env)
        return env
    """

    sections: tuple[Section, ...]

    def __init__(self, sections: Iterable[Section]) -> None:
        object.__setattr__(self, "sections", _sections("Sequential", sections))


@dataclass(frozen=True, init=False)
class Parallel:
    """Fan out: every section runs on the same inputs; their outputs are gathered.

    ``Parallel([a, b, ...]) : env -> env``::

        outs = [run(section, dict(env)) for section in sections]  # concurrently
        for out in outs:
            env.update(out)   # branches must write disjoint slots
        return env
    """

    sections: tuple[Section, ...]

    def __init__(self, sections: Iterable[Section]) -> None:
        object.__setattr__(self, "sections", _sections("Parallel", sections))


@dataclass(frozen=True, init=False)
class Loop:
    """Run ``body`` exactly ``max_iters`` times; body outputs feed the next iteration.

    Values leaving the loop are those of the last iteration, except the names in
    ``accumulated_outputs``: their values from every iteration are concatenated (along
    dim 0 for tensors) and delivered once, after the last iteration.

    ``Loop(body, max_iters, accumulated_outputs) : env -> env``::

        acc = {name: [] for name in accumulated_outputs}
        for i in range(max_iters):
            env = run(body, env)              # accumulated names are held back ...
            for name in acc:
                acc[name].append(env.pop(name))
        env.update({name: concat(vals) for name, vals in acc.items()})  # ... sent once
        return env
    """

    body: Section
    max_iters: int
    accumulated_outputs: frozenset[str]

    def __init__(
        self, body: Section, max_iters: int, accumulated_outputs: Iterable[str] = ()
    ) -> None:
        _max_iters("Loop", max_iters)
        if isinstance(accumulated_outputs, str):
            raise GraphValidationError(
                "Loop accumulated_outputs takes a set of names, not a string"
            )
        object.__setattr__(self, "body", _sections("Loop", [body])[0])
        object.__setattr__(self, "max_iters", max_iters)
        object.__setattr__(self, "accumulated_outputs", frozenset(accumulated_outputs))


@dataclass(frozen=True, init=False)
class DynamicLoop:
    """Run ``body`` until a node of the body raises the ``stop`` signal, per request.

    The stop check is evaluated after each iteration (e.g. an LLM's EOS check, or a
    world-model rollout that reached the request's horizon). ``max_iters`` bounds it; it
    may be None only if some node of the body produces ``stop``.

    ``DynamicLoop(body, max_iters, stop) : env -> env``::

        i = 0
        while max_iters is None or i < max_iters:
            env = run(body, env)
            i += 1
            if env.signals.pop(stop, False):
                break
        return env
    """

    body: Section
    max_iters: int | None
    stop: str

    def __init__(self, body: Section, max_iters: int | None = None, stop: str = "stop") -> None:
        _max_iters("DynamicLoop", max_iters, optional=True)
        if not isinstance(stop, str) or not stop:
            raise GraphValidationError(f"DynamicLoop stop must name a signal, got {stop!r}")
        object.__setattr__(self, "body", _sections("DynamicLoop", [body])[0])
        object.__setattr__(self, "max_iters", max_iters)
        object.__setattr__(self, "stop", stop)


Section = GraphNode | str | Sequential | Parallel | Loop | DynamicLoop
"""A walk or part of one: a node (or a node's name) or a primitive over sections."""


def iter_node_refs(section: Section) -> Iterator[GraphNode | str]:
    """Yield every node (object or name) in a section, depth first, in order."""
    if isinstance(section, GraphNode | str):
        yield section
    elif isinstance(section, Sequential | Parallel):
        for sec in section.sections:
            yield from iter_node_refs(sec)
    else:
        yield from iter_node_refs(section.body)
