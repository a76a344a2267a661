"""Workers build only the zoo's models and allow-listed factories."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from mstar.actors import ActorSystem
from mstar.actors.process import SystemProcess
from mstar.errors import ActorHandlerError, UntrustedModelError
from mstar.runtime import AsyncEngine, EngineConfig, ModelSpec, Placement, Request
from mstar.runtime.messages import InitWorker
from mstar.runtime.trust import check_model_factory, is_trusted_factory
from mstar.runtime.worker import HOST_NAME
from mstar.runtime.worker_core import WorkerConfig
from mstar.wire import ActorId
from mstar.zoo.noop import NoopLoopModel


def make_noop(steps: int = 3) -> NoopLoopModel:
    """A factory outside the zoo (allow-listed by the tests that use it)."""
    return NoopLoopModel(steps)


@pytest.mark.parametrize(
    ("factory", "allowed", "trusted"),
    [
        ("mstar.zoo.toy:ToyModel", [], True),  # the zoo's
        ("mstar.zoo.noop:NoopLoopModel", [], True),
        ("os:system", [], False),
        ("mstar.zoo.registry:make_model", [], False),  # in the zoo package, not a zoo factory
        ("mymodels:Big", ["mymodels"], True),  # a module
        ("mymodels.sub:Big", ["mymodels"], True),
        ("mymodels_evil:Big", ["mymodels"], False),  # not a prefix of names, of modules
        ("mymodels:Big", ["mymodels:Big"], True),  # exact
        ("mymodels:Bigger", ["mymodels:Big"], False),
        ("mymodels:make_a", ["mymodels:make_"], False),  # a prefix must end in "." or ":"
        ("pkg.models.a:F", ["pkg.models."], True),
        ("x:F", ["", "  "], False),
    ],
)
def test_what_is_trusted(factory: str, allowed: list[str], trusted: bool) -> None:
    assert is_trusted_factory(factory, allowed) is trusted


def test_the_error_says_how_to_allow_a_factory() -> None:
    with pytest.raises(
        UntrustedModelError, match=r"allowed_model_factories=\['os'\].*--allow-model-factory"
    ):
        check_model_factory("os:system")


async def test_an_untrusted_factory_fails_before_any_worker_starts() -> None:
    config = EngineConfig(worker_processes=True)
    with pytest.raises(UntrustedModelError):
        await AsyncEngine.start(ModelSpec("tests.runtime.test_trust:make_noop"), config=config)


@pytest.mark.slow
async def test_an_allow_listed_factory_serves_in_worker_processes() -> None:
    config = EngineConfig(
        worker_processes=True, allowed_model_factories=("tests.runtime.test_trust",)
    )
    spec = ModelSpec("tests.runtime.test_trust:make_noop", {"steps": 4})
    async with await AsyncEngine.start(spec, config=config) as engine:
        outputs = await engine.run(Request("loop", {}, request_id="r"))
    assert [o.data for o in outputs] == [4]


@pytest.mark.slow
async def test_a_worker_host_refuses_an_init_naming_any_other_code() -> None:
    """What a peer that reached a worker could send: the host refuses to import it."""
    proc = SystemProcess(
        "mstar.runtime.worker:setup_worker_host", setup_args={"allowed_model_factories": []}
    )
    addresses = await asyncio.to_thread(proc.start)
    try:
        async with ActorSystem() as system:
            host = system.ref(HOST_NAME, addresses[0])
            init = InitWorker(
                0,
                "os:system",
                {"command": "true"},
                [],
                ActorId(system.address, "conductor"),
                {0: ActorId(addresses[0], "worker-0")},
                WorkerConfig(),
            )
            with pytest.raises(ActorHandlerError) as caught:
                await host.ask(init, timeout=30)
            assert caught.value.error_type == "UntrustedModelError"
    finally:
        await asyncio.to_thread(proc.stop)


def test_a_placement_is_unchanged_by_the_check() -> None:
    assert Placement.colocated(make_noop().graph()).ranks == (0,)


def test_the_zoo_declares_every_model_it_registers_as_an_entry_point() -> None:
    """Workers trust what installed packages declare (`mstar.models`); the runtime never imports the
    zoo for it."""
    from mstar.runtime.trust import declared_factories
    from mstar.zoo.registry import zoo_factories

    assert declared_factories() == zoo_factories()
    source = (Path(__file__).parents[2] / "src" / "mstar" / "runtime" / "trust.py").read_text()
    assert "mstar.zoo" not in source
