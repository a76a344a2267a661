"""Placement: which worker rank hosts which (node, walk), from a YAML file.

```yaml
model: orpheus
node_groups:
  - {node_names: [LLM], ranks: [0], graph_walks: [prefill]}
  - {node_names: [LLM], ranks: [1], graph_walks: [decode]}
  - {node_names: [snac_decoder], ranks: [0]}
```

On a Ray cluster (`EngineConfig.ray_address`), ``ray_resources`` pins the group's ranks to
the nodes that advertise those custom resources (each rank's worker asks for them):

```yaml
node_groups:
  - {node_names: [LLM], ranks: [0], ray_resources: {gpu_box_a: 1}}
  - {node_names: [snac_decoder], ranks: [1], ray_resources: {gpu_box_b: 1}}
```

``rank_resources`` does the same per rank, for the ranks of one group (replicas) that belong
on different nodes: ``rank_resources: {0: {node_a: 1}, 1: {node_b: 1}}``.

``backend: ray`` switches Ray on from the file itself, as ``EngineConfig(ray_address=...)`` /
``mstar serve --ray-address`` do; ``ray_address`` names the cluster (default: the
``RAY_ADDRESS`` variable, else ``auto``). ``backend: local`` keeps the workers on this
machine. A file and a config that name different clusters, or a local file with a Ray
config, are a `PlacementError`:

```yaml
backend: ray
ray_address: auto
node_groups: ...
```

A group without ``graph_walks`` covers its nodes in every walk that uses them. Every
(node, walk) pair of the graph must be covered by exactly one group. A group with several
ranks spreads requests over them (replicas). ``kv_cache_share`` gives the group's KV-cache
nodes that fraction each of their rank's KV-cache budget (``EngineConfig.kv_cache_memory``):

```yaml
node_groups:
  - {node_names: [thinker], ranks: [0], kv_cache_share: 0.6}
  - {node_names: [talker, code_predictor], ranks: [0], kv_cache_share: 0.2}
```

``tensor_parallel: N`` shards the group's nodes over N ranks each (`mstar.engines.parallel`):
its ranks, in order, form ``len(ranks) / N`` tensor-parallel groups (replicas of the sharded
node); each group's first rank schedules and is the rank the conductor sends walks to. The
other nodes keep their own placement (a sharded thinker beside an unsharded talker):

```yaml
node_groups:
  - {node_names: [thinker], ranks: [0, 1], tensor_parallel: 2}
  - {node_names: [talker, code_predictor, code2wav], ranks: [2]}
```

A tensor-parallel group's ranks share a machine (their collectives go through shared memory);
on a Ray cluster they are placed together, unless ``allow_cross_node_tp: true`` lets them
spread (collectives then go through ``torch.distributed``'s gloo; such a group shards one
node).

``deterministic: true`` serves deterministically, as ``EngineConfig(deterministic=True)`` and
``mstar serve --deterministic`` do (either one turns it on).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import msgspec
import msgspec.yaml

from mstar.errors import PlacementError
from mstar.graph import ModelGraph

__all__ = ["RAY_ADDRESS_ENV", "NodeGroup", "Placement", "TensorParallelRole"]

RAY_ADDRESS_ENV = "RAY_ADDRESS"
"""The variable naming the Ray cluster of a ``backend: ray`` placement without ``ray_address``."""


class NodeGroup(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Nodes (optionally only in some walks) hosted by the given ranks."""

    node_names: list[str]
    ranks: list[int]
    graph_walks: list[str] | None = None
    kv_cache_share: float | None = None
    ray_resources: dict[str, float] | None = None
    tensor_parallel: int = 1
    allow_cross_node_tp: bool = False

    def tensor_parallel_groups(self) -> list[tuple[int, ...]]:
        """Return the ranks of each tensor-parallel group (one group per rank without it)."""
        n = max(1, self.tensor_parallel)
        return [tuple(self.ranks[i : i + n]) for i in range(0, len(self.ranks), n)]


class TensorParallelRole(msgspec.Struct, frozen=True):
    """One tensor-parallel group a worker takes part in: its nodes, its ranks (the first leads),
    and the name of the shared-memory file its collectives run through."""

    nodes: tuple[str, ...]
    ranks: tuple[int, ...]
    channel: str
    source: str = "tensor_parallel"  # where the placement declares it ("node_groups[0]")
    store: str | None = None  # host:port of the TCPStore of a group over machines (gloo)


class _PlacementFile(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    node_groups: list[NodeGroup]
    model: str | None = None
    rank_resources: dict[int, dict[str, float]] | None = None
    backend: Literal["local", "ray"] | None = None
    ray_address: str | None = None
    deterministic: bool = False


@dataclass(frozen=True)
class Placement:
    """A validated map from (node, walk) to the ranks that host it.

    ``backend`` is where the workers run (``"ray"``: on the Ray cluster at ``ray_address``;
    ``"local"``: on this machine; None: as the engine's config says). ``deterministic``: serve
    deterministically (see `EngineConfig.deterministic`).
    """

    groups: tuple[NodeGroup, ...]
    model: str | None = None
    rank_resources: dict[int, dict[str, float]] | None = None
    backend: Literal["local", "ray"] | None = None
    ray_address: str | None = None
    deterministic: bool = False

    @classmethod
    def colocated(cls, graph: ModelGraph) -> Placement:
        """Place every node of ``graph`` on rank 0: the default, one process."""
        return cls((NodeGroup(sorted(graph.nodes), [0]),), graph.name)

    @classmethod
    def from_yaml(cls, source: str | Path) -> Placement:
        """Parse a placement file (a path, or YAML text).

        Raises:
            PlacementError: The file is missing or not a valid placement.
        """
        if isinstance(source, Path) or (
            isinstance(source, str) and "\n" not in source and source.endswith((".yaml", ".yml"))
        ):
            path = Path(source)
            if not path.is_file():
                raise PlacementError(f"placement file {str(path)!r} does not exist")
            text = path.read_text()
            where = str(path)
        else:
            text, where = str(source), "placement"
        try:
            spec = msgspec.yaml.decode(text, type=_PlacementFile)
        except msgspec.ValidationError as exc:
            raise PlacementError(f"{where}: {exc}") from None
        except msgspec.DecodeError as exc:
            raise PlacementError(f"{where} is not valid YAML: {exc}") from None
        if spec.ray_address is not None and spec.backend != "ray":
            raise PlacementError(f"{where}: ray_address needs backend: ray")
        return cls(
            tuple(spec.node_groups),
            spec.model,
            spec.rank_resources,
            spec.backend,
            spec.ray_address,
            spec.deterministic,
        )

    def resolve(
        self, graph: ModelGraph, num_ranks: int | None = None
    ) -> dict[tuple[str, str], tuple[int, ...]]:
        """Check this placement against ``graph``; return (node, walk) -> ranks.

        Raises:
            PlacementError: Naming the unknown node or walk, the unavailable rank, the
                (node, walk) placed twice or not at all.
        """
        if self.model is not None and self.model != graph.name:
            raise PlacementError(f"placement is for model {self.model!r}, not {graph.name!r}")
        uses = {(n.name, w) for w in graph.walks for n in graph.walk_nodes(w)}
        out: dict[tuple[str, str], tuple[int, ...]] = {}
        for i, group in enumerate(self.groups):
            where = f"node_groups[{i}]"
            _check_ranks(where, group.ranks, num_ranks)
            if not group.node_names:
                raise PlacementError(f"{where}: node_names is empty")
            for node in group.node_names:
                if node not in graph.nodes:
                    raise PlacementError(
                        f"{where}: unknown node {node!r} (nodes: {', '.join(sorted(graph.nodes))})"
                    )
            for walk in group.graph_walks or ():
                if walk not in graph.walks:
                    raise PlacementError(
                        f"{where}: unknown walk {walk!r} (walks: {', '.join(graph.walks)})"
                    )
            leaders = _check_tensor_parallel(where, group)
            walks: Iterable[str] = (
                group.graph_walks if group.graph_walks is not None else graph.walks
            )
            for node in group.node_names:
                covered = [(node, w) for w in walks if (node, w) in uses]
                if group.graph_walks is not None and not covered:
                    raise PlacementError(
                        f"{where}: node {node!r} is used by none of {group.graph_walks}"
                    )
                for key in covered:
                    if key in out:
                        raise PlacementError(
                            f"{where}: node {node!r} in walk {key[1]!r} is already placed"
                        )
                    out[key] = leaders
        self.tensor_parallel_groups()  # a rank in two of them
        for node, walk in sorted(uses - out.keys()):
            raise PlacementError(
                f"node {node!r} in walk {walk!r} has no placement: add it to a node group"
            )
        return out

    def to_yaml(self) -> str:
        """Return this placement as YAML text (what `from_yaml` reads)."""
        spec = _PlacementFile(
            list(self.groups),
            self.model,
            self.rank_resources,
            self.backend,
            self.ray_address,
            self.deterministic,
        )
        return msgspec.yaml.encode(spec).decode()

    def cluster_address(self, configured: str | None) -> str | None:
        """Return the Ray cluster to run on, given the config's ``ray_address`` (None: run locally).

        A ``backend: ray`` placement names it (``ray_address``, else ``$RAY_ADDRESS``, else
        ``"auto"``) unless the config does; both may name it only if they agree.

        Raises:
            PlacementError: The placement and the config disagree.
        """
        if self.backend == "local" and configured is not None:
            raise PlacementError(
                "the placement says backend: local, but the engine is configured for the "
                f"Ray cluster {configured!r}"
            )
        if self.backend != "ray":
            if self.ray_address is not None:
                raise PlacementError("ray_address needs backend: ray")
            return configured
        if (
            configured is not None
            and self.ray_address is not None
            and configured != self.ray_address
        ):
            raise PlacementError(
                f"the placement names the Ray cluster {self.ray_address!r} and the engine's "
                f"config {configured!r}: "
                "name it in one place (or the same in both)"
            )
        return configured or self.ray_address or os.environ.get(RAY_ADDRESS_ENV) or "auto"

    def kv_cache_shares(self, rank: int) -> dict[str, float]:
        """Return node -> KV-cache share of the groups on ``rank`` that set one.

        Raises:
            PlacementError: A share is outside (0, 1], or a node gets two different ones.
        """
        shares: dict[str, float] = {}
        for i, group in enumerate(self.groups):
            share = group.kv_cache_share
            if share is None or rank not in group.ranks:
                continue
            if not 0.0 < share <= 1.0:
                raise PlacementError(
                    f"node_groups[{i}]: kv_cache_share must be in (0, 1], got {share}"
                )
            for node in group.node_names:
                if shares.get(node, share) != share:
                    raise PlacementError(
                        f"node_groups[{i}]: node {node!r} has two kv_cache_share values"
                    )
                shares[node] = share
        return shares

    def ray_resources(self, rank: int) -> dict[str, float]:
        """Return the Ray resources the worker of ``rank`` asks for (the largest amount named for
        it).

        Raises:
            PlacementError: An amount is not positive.
        """
        asks = [
            (f"node_groups[{i}].ray_resources", g.ray_resources)
            for i, g in enumerate(self.groups)
            if rank in g.ranks
        ]
        asks.append((f"rank_resources[{rank}]", (self.rank_resources or {}).get(rank)))
        out: dict[str, float] = {}
        for where, resources in asks:
            for name, amount in (resources or {}).items():
                if not amount > 0:
                    raise PlacementError(f"{where}[{name!r}] must be > 0, got {amount}")
                out[name] = max(out.get(name, 0.0), float(amount))
        return out

    def tensor_parallel_groups(self) -> list[tuple[int, tuple[str, ...], tuple[int, ...]]]:
        """Return each tensor-parallel group: its node group's index, its nodes, its ranks.

        Raises:
            PlacementError: A rank is in two tensor-parallel groups, or in one and another group
                of the same nodes.
        """
        out = []
        seen: dict[int, str] = {}
        for i, group in enumerate(self.groups):
            if group.tensor_parallel <= 1:
                continue
            for ranks in group.tensor_parallel_groups():
                for rank in ranks:
                    if rank in seen:
                        raise PlacementError(
                            f"node_groups[{i}]: rank {rank} is already in the tensor-parallel "
                            f"group of {seen[rank]}"
                        )
                    seen[rank] = f"node_groups[{i}]"
                out.append((i, tuple(group.node_names), ranks))
        return out

    @property
    def ranks(self) -> tuple[int, ...]:
        """Return every rank this placement uses, sorted."""
        return tuple(sorted({r for g in self.groups for r in g.ranks}))


def _check_tensor_parallel(where: str, group: NodeGroup) -> tuple[int, ...]:
    """Check a group's ``tensor_parallel``; return the ranks walks go to (each TP group's
    first)."""
    n = group.tensor_parallel
    if n < 1:
        raise PlacementError(f"{where}: tensor_parallel must be >= 1, got {n}")
    if len(group.ranks) % n:
        raise PlacementError(
            f"{where}: tensor_parallel {n} needs a multiple of {n} ranks, got {group.ranks}"
        )
    if n > 1 and group.graph_walks is not None:
        raise PlacementError(
            f"{where}: a tensor-parallel group serves its nodes in every walk (no graph_walks)"
        )
    return tuple(ranks[0] for ranks in group.tensor_parallel_groups())


def _check_ranks(where: str, ranks: list[int], num_ranks: int | None) -> None:
    if not ranks:
        raise PlacementError(f"{where}: ranks is empty")
    if len(set(ranks)) != len(ranks):
        raise PlacementError(f"{where}: ranks {ranks} has duplicates")
    for r in ranks:
        if r < 0 or (num_ranks is not None and r >= num_ranks):
            available = "none" if num_ranks == 0 else f"0..{num_ranks - 1}" if num_ranks else ">= 0"
            raise PlacementError(f"{where}: rank {r} is not available (ranks {available})")
