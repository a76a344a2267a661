"""Which model factories a worker may build: the zoo's, and those an operator allow-listed.

A worker process rebuilds its model from a ``"package.module:callable"`` named in the
message that initialises it. Importing and calling whatever a message names would let anyone
who can reach the worker run code there, so a worker builds only:

- the factories installed packages declare in the ``mstar.models`` entry-point group (the
  zoo's own, in mstar's ``pyproject.toml``; a model package's, in its own), and
- factories matching an allow-list entry (`EngineConfig.allowed_model_factories`,
  ``mstar serve --allow-model-factory``): an exact ``module:callable``, a module (``pkg.models``
  allows ``pkg.models:Any`` and ``pkg.models.sub:Any``), or a prefix ending in ``.`` or ``:``.

The allow-list reaches a worker with its launch (process arguments, a Ray actor's
constructor), never in a message.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from importlib.metadata import entry_points

from mstar.errors import UntrustedModelError

__all__ = ["ENTRY_POINT_GROUP", "check_model_factory", "declared_factories", "is_trusted_factory"]

ENTRY_POINT_GROUP = "mstar.models"


@functools.cache
def declared_factories() -> frozenset[str]:
    """Return the factories installed packages declare in the ``mstar.models`` group."""
    return frozenset(
        entry.value.replace(" ", "") for entry in entry_points(group=ENTRY_POINT_GROUP)
    )


def is_trusted_factory(factory: str, allowed: Iterable[str] = ()) -> bool:
    """Return whether ``factory`` is a declared one or matches an entry of ``allowed``."""
    if factory in declared_factories():
        return True
    module = factory.partition(":")[0]
    for entry in allowed:
        entry = entry.strip()
        if not entry:
            continue
        if factory == entry or (entry.endswith((".", ":")) and factory.startswith(entry)):
            return True
        if ":" not in entry and (module == entry or module.startswith(entry + ".")):
            return True
    return False


def check_model_factory(factory: str, allowed: Iterable[str] = ()) -> None:
    """Refuse a factory that is neither the zoo's nor allow-listed.

    Raises:
        UntrustedModelError: Saying how to allow it.
    """
    allowed = list(allowed)
    if not is_trusted_factory(factory, allowed):
        raise UntrustedModelError(
            f"model factory {factory!r} is not in the zoo and not allow-listed "
            f"(allowed: {allowed or 'none'}): pass "
            f"EngineConfig(allowed_model_factories=[{factory.partition(':')[0]!r}]) "
            "or `mstar serve --allow-model-factory MODULE` to let workers build it"
        )
