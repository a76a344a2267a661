"""AsyncEngine end to end: co-located and with workers in separate processes.

Outputs must equal the reference interpreter's; many concurrent requests with random aborts
must leave no state behind (conductor and worker tables, engine queues, shared segments,
socket files, processes).
"""

from __future__ import annotations

import asyncio
import gc
import os
import random
from collections import defaultdict
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import psutil
import pytest
import pytest_asyncio
import torch

from mstar.errors import PlacementError, RequestAbortedError, WalkExecutionError
from mstar.graph import Emission, run_reference
from mstar.runtime import Placement
from mstar.runtime.async_engine import CONDUCTOR_PROCESS, AsyncEngine
from mstar.runtime.engine_config import EngineConfig, EngineStats
from mstar.runtime.messages import WalkStepStats
from mstar.runtime.model import ModelSpec, Output, Request
from mstar.transport.janitor import SHM_DIR, runtime_dir
from mstar.zoo.toy import ToyModel, ToyPlan, make_toy_inputs, prepare_toy_images
from tests.helpers import wait_until_idle

SPREAD = """
model: toy-composite
node_groups:
  - {node_names: [encoder, lm, init, image_encoder, cond], ranks: [0]}
  - {node_names: [vocoder, uncond], ranks: [1]}
  - {node_names: [combine, vae], ranks: [2]}
"""
SEED = 3

pytestmark = pytest.mark.asyncio(loop_scope="module")


def reference(request: Request) -> list[Emission]:
    model = ToyModel(seed=SEED)
    images = (
        prepare_toy_images(request.data["images"], model.config)
        if request.task == "image_edit"
        else None
    )
    inputs = make_toy_inputs(
        request.data["text"], model.config, request.data.get("seed", 0), images
    )
    return run_reference(model.graph(), model._nodes, inputs, ToyPlan(), state=request.task)


def assert_same(outputs: list[Output], emissions: list[Emission]) -> None:
    got: dict[tuple[str, str], list[Any]] = defaultdict(list)
    want: dict[tuple[str, str], list[Any]] = defaultdict(list)
    for o in outputs:
        got[(o.node, o.name)].append(o.data)
    for e in emissions:
        want[(e.node, e.name)].append(e.value)
    assert got.keys() == want.keys()
    for key in want:
        assert len(got[key]) == len(want[key]), key
        for a, b in zip(got[key], want[key], strict=True):
            assert torch.equal(torch.as_tensor(a), torch.as_tensor(b)), key


def requests(n: int, seed: int = 0) -> list[Request]:
    rng = random.Random(seed)
    words = ["hello", "mstar serves graphs", "a", "composite", "models walk"]
    out = []
    for i in range(n):
        task = rng.choice(["speech", "image", "image_edit"])
        data: dict[str, Any] = {"text": rng.choice(words), "seed": i}
        if task == "image_edit":
            data["images"] = [
                torch.randint(
                    0,
                    256,
                    (12, 10, 3),
                    dtype=torch.uint8,
                    generator=torch.Generator().manual_seed(i),
                )
            ]
        out.append(Request(task, data))
    return out


def mstar_files(pids: set[int]) -> set[Path]:
    """Return the shared segments and socket files that processes ``pids`` own now."""
    prefixes = tuple(f"mstar-{pid}-" for pid in pids)
    return {
        p
        for d in (SHM_DIR, runtime_dir())
        if d.exists()
        for p in d.iterdir()
        if p.name.startswith(prefixes)
    }


@pytest_asyncio.fixture(scope="module", loop_scope="module", params=["colocated", "processes"])
async def engine(request: pytest.FixtureRequest) -> AsyncIterator[AsyncEngine]:
    config = EngineConfig(worker_processes=request.param == "processes")
    spec = ModelSpec("mstar.zoo.toy:ToyModel", {"seed": SEED})
    before = set(psutil.Process().children(recursive=True))
    eng = await AsyncEngine.start(spec, Placement.from_yaml(SPREAD), config)
    pids = {os.getpid()} | {p.pid for p in eng.processes.values() if p.pid is not None}
    yield eng
    await eng.shutdown()
    assert mstar_files(pids) == set(), "shared segments or socket files left behind"
    leftover = set(psutil.Process().children(recursive=True)) - before
    orphans = [
        p.cmdline()
        for p in leftover
        if p.is_running()
        and p.status() != psutil.STATUS_ZOMBIE
        and "resource_tracker" not in " ".join(p.cmdline())
    ]
    assert not orphans, f"orphan worker processes: {orphans}"


@pytest.mark.timeout(300)
async def test_outputs_equal_the_reference(engine: AsyncEngine) -> None:
    reqs = requests(12)
    results = await asyncio.gather(*(engine.run(r) for r in reqs))
    for r, outputs in zip(reqs, results, strict=True):
        assert_same(outputs, reference(r))
        assert all(o.request_id == r.request_id for o in outputs)
    await wait_until_idle(engine)


@pytest.mark.timeout(300)
async def test_concurrent_requests_with_random_aborts_leave_nothing_behind(
    engine: AsyncEngine,
) -> None:
    reqs = requests(40, seed=1)
    rng = random.Random(7)
    victims = {r.request_id for r in rng.sample(reqs, 12)}
    started = asyncio.Event()

    async def run(r: Request) -> list[Output]:
        outputs = []
        async for out in engine.generate(r):
            outputs.append(out)
            started.set()
        return outputs

    tasks = [asyncio.ensure_future(run(r)) for r in reqs]
    await started.wait()
    for rid in victims:
        await engine.abort(rid)
    results = await asyncio.gather(*tasks, return_exceptions=True)
    for r, result in zip(reqs, results, strict=True):
        if isinstance(result, BaseException):
            assert isinstance(result, RequestAbortedError) and r.request_id in victims
        else:
            assert_same(result, reference(r))
    # a request still completes after all that, and nothing is held
    assert_same(await engine.run(reqs[0]), reference(reqs[0]))
    await wait_until_idle(engine)


@pytest.mark.timeout(300)
async def test_leaving_generate_early_aborts_the_request(engine: AsyncEngine) -> None:
    req = Request("speech", {"text": "a long enough request"})
    async for _ in engine.generate(req):
        break
    await asyncio.sleep(0)
    assert_same(
        await engine.run(Request("image", {"text": "next"})),
        reference(Request("image", {"text": "next"})),
    )
    await wait_until_idle(engine)


def _moved(stats: EngineStats, direction: str) -> int:
    return sum(
        kinds[direction] for process in stats.transport.values() for kinds in process.values()
    )


@pytest.mark.timeout(300)
async def test_stats_give_step_times_per_walk_and_tensor_bytes_per_transport(
    engine: AsyncEngine,
) -> None:
    await wait_until_idle(engine)
    before = await engine.engine_stats()
    for task in ("speech", "image"):  # one request at a time: no step mixes walks
        await engine.run(Request(task, {"text": "count my steps"}))
    await wait_until_idle(engine)
    after = await engine.engine_stats()
    # SPREAD places lm on rank 0: its steps split exactly between prefill and decode
    lm, lm_before = after.walks[0]["lm"], before.walks[0].get("lm", {})
    zero = WalkStepStats(0, 0, 0.0, [])
    steps = {w: t.steps - lm_before.get(w, zero).steps for w, t in lm.items()}
    inputs = {w: t.inputs - lm_before.get(w, zero).inputs for w, t in lm.items()}
    assert steps["prefill"] == 1 and steps["decode"] >= 1 and inputs == steps
    assert sum(steps.values()) == after.nodes[0]["lm"]["steps"] - before.nodes[0].get("lm", {}).get(
        "steps", 0
    )
    for t in lm.values():
        assert sum(t.bucket_counts) == t.steps and t.inputs >= t.steps and t.seconds > 0
    assert "image_gen" in after.walks[2]["vae"] and set(after.walks[2]["vae"]) <= {
        "image_gen",
        "image_edit",
    }
    assert {"vocode"} == set(after.walks[1]["vocoder"])
    if engine.config.worker_processes:
        assert set(after.transport) == {CONDUCTOR_PROCESS, "rank0", "rank1", "rank2"}
        assert _moved(after, "sent") - _moved(before, "sent") > 0
        # every byte one process sent, another received
        assert _moved(after, "sent") == _moved(after, "received")
        for process in after.transport.values():
            assert process["ipc"]["sent"] > 0 and process["ipc"]["received"] > 0
    else:  # one process: tensors pass by reference
        assert set(after.transport) == {CONDUCTOR_PROCESS} and _moved(after, "sent") == 0


async def test_bad_requests_fail_alone() -> None:
    async with await AsyncEngine.start(ToyModel(seed=SEED)) as engine:
        with pytest.raises(ValueError, match="task must be one of"):
            await engine.run(Request("sing", {"text": "la"}))
        assert len(await engine.run(Request("image", {"text": "ok"}))) == 2


async def test_freeze_gc_freezes_what_lives_once_started() -> None:
    assert gc.get_freeze_count() == 0
    try:
        async with await AsyncEngine.start(
            ToyModel(seed=SEED), config=EngineConfig(freeze_gc=True)
        ) as engine:
            frozen = gc.get_freeze_count()
            assert frozen > 1000  # the model, the engine, the imports
            request = Request("speech", {"text": "still serves"})
            assert_same(await engine.run(request), reference(request))
    finally:
        gc.unfreeze()
    async with await AsyncEngine.start(ToyModel(seed=SEED)):
        assert gc.get_freeze_count() == 0  # off by default


async def test_a_failing_node_fails_its_request_and_names_it() -> None:
    model = ToyModel(seed=SEED)
    model._nodes["vae"] = lambda inputs: (_ for _ in ()).throw(RuntimeError("decoder exploded"))
    async with await AsyncEngine.start(model) as engine:
        with pytest.raises(
            WalkExecutionError,
            match=r"RuntimeError: decoder exploded \(node 'vae', walk 'image_gen'",
        ):
            await engine.run(Request("image", {"text": "boom"}))
        assert_same(
            await engine.run(Request("speech", {"text": "fine"})),
            reference(Request("speech", {"text": "fine"})),
        )


async def test_placement_errors_are_clear() -> None:
    with pytest.raises(PlacementError, match="unknown node 'gpu_vae'"):
        await AsyncEngine.start(
            ToyModel(),
            Placement.from_yaml("node_groups:\n  - {node_names: [gpu_vae], ranks: [0]}\n"),
        )
    with pytest.raises(PlacementError, match="has no placement"):
        await AsyncEngine.start(
            ToyModel(), Placement.from_yaml("node_groups:\n  - {node_names: [lm], ranks: [0]}\n")
        )


async def test_ranks_in_one_process_share_the_cores_per_step_thread() -> None:
    """Two ranks in this process: each step thread gets its share; this thread is untouched."""
    from mstar.runtime.worker_core import WorkerConfig, WorkerCore

    assert EngineConfig().worker_config(0, 1).num_threads is None  # one rank: torch's own setting
    assert EngineConfig().worker_config(0, 2).num_threads == max(1, (os.cpu_count() or 1) // 2)
    assert EngineConfig(cpu_threads=3).worker_config(0, 2).num_threads == 3
    model = ToyModel()
    graph = model.graph()
    resolved = Placement.colocated(graph).resolve(graph)
    before = torch.get_num_threads()
    core = WorkerCore(0, model, graph, resolved, None, WorkerConfig(num_threads=1))  # type: ignore[arg-type]
    await core.start()
    try:
        assert core._executor is not None
        assert core._executor.submit(torch.get_num_threads).result() == 1
        assert torch.get_num_threads() == before
    finally:
        await core.aclose()
