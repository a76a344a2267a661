"""Which model factories a worker may build: the zoo's, and those an operator allow-listed.

A worker process rebuilds its model from a ``"package.module:callable"`` named in the
message that initialises it. Importing and calling whatever a message names would let anyone
who can reach the worker run code there, so a worker builds only:

- the factories of the zoo registry (`mstar.zoo.registry`), and
- factories matching an allow-list entry (`EngineConfig.allowed_model_factories`,
  ``mstar serve --allow-model-factory``): an exact ``module:callable``, a module (``pkg.models``
  allows ``pkg.models:Any`` and ``pkg.models.sub:Any``), or a prefix ending in ``.`` or ``:``.

The allow-list reaches a worker with its launch (process arguments, a Ray actor's
constructor), never in a message.
"""

from __future__ import annotations

from collections.abc import Iterable

from mstar.errors import UntrustedModelError

__all__ = ["check_model_factory", "is_trusted_factory"]


def is_trusted_factory(factory: str, allowed: Iterable[str] = ()) -> bool:
    """Return whether ``factory`` is a zoo factory or matches an entry of ``allowed``."""
    from mstar.zoo.registry import zoo_factories  # the zoo imports the runtime

    if factory in zoo_factories():
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
            f"(allowed: {allowed or 'none'}): pass EngineConfig(allowed_model_factories=[{factory.partition(':')[0]!r}]) "
            "or `mstar serve --allow-model-factory MODULE` to let workers build it"
        )
