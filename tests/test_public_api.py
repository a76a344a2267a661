"""The public API: explicit `__all__` everywhere, consistent between the package and its parts."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import pytest

import mstar
import mstar.errors

SUBPACKAGES = [m.name for m in pkgutil.iter_modules(mstar.__path__) if m.ispkg]


def test_expected_subpackages_exist() -> None:
    assert {"graph", "streaming", "actors", "transport", "engines", "zoo"} <= set(SUBPACKAGES)


@pytest.mark.parametrize("name", ["mstar", "mstar.errors", *(f"mstar.{p}" for p in SUBPACKAGES)])
def test_all_is_explicit_unique_and_resolves(name: str) -> None:
    module = importlib.import_module(name)
    exported = module.__all__
    assert len(exported) == len(set(exported)), f"{name}.__all__ has duplicates"
    for attr in exported:
        assert hasattr(module, attr), f"{name}.__all__ lists {attr!r}, which does not exist"


def test_top_level_names_are_the_subpackages_objects() -> None:
    for attr in mstar.__all__:
        obj = getattr(mstar, attr)
        home = getattr(obj, "__module__", None)
        if home is None or not home.startswith("mstar.") or inspect.ismodule(obj):
            continue
        sub = importlib.import_module(".".join(home.split(".")[:2]))
        if sub.__name__ != home:
            assert attr in sub.__all__, f"mstar.{attr} is not exported by {sub.__name__}"
        assert getattr(sub, attr, obj) is obj


def test_every_error_derives_from_the_root_and_documents_itself() -> None:
    for attr in mstar.errors.__all__:
        cls = getattr(mstar.errors, attr)
        assert issubclass(cls, mstar.errors.MStarError)
        assert cls.__doc__ and cls.__doc__.startswith(("Raised ", "Root of")), attr
        assert cls.__module__ == "mstar.errors"
    defined = {
        n
        for n, v in vars(mstar.errors).items()
        if inspect.isclass(v) and issubclass(v, Exception) and v.__module__ == "mstar.errors"
    }
    assert defined == set(mstar.errors.__all__), (
        "every error class in mstar.errors must be in its __all__"
    )


def test_the_errors_callers_catch_and_the_node_types_authors_return_are_top_level() -> None:
    from mstar import (
        BatchedNode,
        FiringRows,
        ForwardKVNode,
        KVNode,
        RequestAbortedError,
        WorkerLostError,
        batched,
    )

    assert issubclass(RequestAbortedError, mstar.MStarError) and issubclass(
        WorkerLostError, mstar.MStarError
    )
    assert {BatchedNode, FiringRows, ForwardKVNode, KVNode} <= {
        getattr(mstar, n) for n in mstar.__all__
    }
    assert batched(lambda x: {"y": x["x"] + 1})([{"x": 1}]) == [{"y": 2}]
