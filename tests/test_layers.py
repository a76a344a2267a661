"""The packages form layers: no import from a lower package to a higher one, no cycle."""

from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "mstar"
# Lowest first; a package may import only packages before it (and itself).
LAYERS = [
    "errors", "wire", "transport", "actors", "streaming", "graph", "engines", "progress", "runtime",
    "bench", "zoo", "baselines", "client", "server", "demo", "cli", "__init__",
]  # fmt: skip


def _imports() -> dict[str, set[str]]:
    edges: dict[str, set[str]] = defaultdict(set)
    for path in SRC.rglob("*.py"):
        if path.name == "__main__.py":  # an entry point (`python -m mstar.bench`) may run the CLI
            continue
        package = path.relative_to(SRC).parts[0].removesuffix(".py")
        for match in re.finditer(r"^\s*(?:from|import) mstar\.(\w+)", path.read_text(), re.M):
            if match[1] != package:
                edges[package].add(match[1])
    return edges


def test_every_package_has_a_layer() -> None:
    packages = {p.relative_to(SRC).parts[0].removesuffix(".py") for p in SRC.rglob("*.py")}
    assert packages <= set(LAYERS), packages - set(LAYERS)


def test_no_package_imports_one_above_it() -> None:
    rank = {name: i for i, name in enumerate(LAYERS)}
    upward = sorted(
        (a, b) for a, targets in _imports().items() for b in targets if rank[b] > rank[a]
    )
    assert not upward, f"imports from a lower package to a higher one: {upward}"
