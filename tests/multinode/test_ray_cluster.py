"""Workers on a (local) Ray cluster: loops and streams across nodes, and a node that goes away.

The cluster (see conftest) has one node with ``node_a`` and two with ``node_b``; placements
pin ranks to them with ``ray_resources`` / ``rank_resources``. Outputs must equal those of the
co-located engine (or the graph's reference interpreter), byte for byte.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time
from collections import defaultdict
from typing import Any

import numpy as np
import pytest
import torch

from mstar.errors import PlacementError, WorkerLostError
from mstar.graph import Emission, run_reference
from mstar.runtime import AsyncEngine, EngineConfig, ModelSpec, Placement, Request
from mstar.runtime.model import Output
from mstar.zoo import resolve_model
from mstar.zoo.toy import ToyModel, ToyPlan, make_toy_inputs, prepare_toy_images
from tests.multinode.conftest import LocalCluster, ray

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240), pytest.mark.xdist_group("ray")]

SEED = 3
# The LM partition on node A streams its tokens to the vocoder on a node_b node; the image
# loop's CFG branches run on both.
TOY_ACROSS = """
model: toy-composite
node_groups:
  - {node_names: [encoder, lm, init, image_encoder, cond], ranks: [0], ray_resources: {node_a: 1}}
  - {node_names: [vocoder, uncond, combine, vae], ranks: [1], ray_resources: {node_b: 1}}
"""
# Every step of the DynamicLoop goes from node A (a) to a node_b node (b) and back.
LOOP_ACROSS = """
model: noop-loop
node_groups:
  - {node_names: [a, done], ranks: [0], ray_resources: {node_a: 1}}
  - {node_names: [b], ranks: [1], ray_resources: {node_b: 1}}
"""
# Two replicas of the whole loop, one per node: requests alternate between them.
REPLICAS = """
model: noop-loop
node_groups:
  - {node_names: [a, b, done], ranks: [0, 1]}
rank_resources: {0: {node_a: 1}, 1: {node_b: 1}}
"""


# Ray switched on by the placement file itself (the test's Ray is already initialised).
LOOP_BACKEND_RAY = "backend: ray\nray_address: auto\n" + LOOP_ACROSS


def placement_groups(state: str) -> list[dict[str, Any]]:
    return [g for g in ray.util.placement_group_table().values() if g["state"] == state]


def ray_config(**kwargs: Any) -> EngineConfig:
    return EngineConfig(ray_address="auto", ray_num_cpus=0.5, **kwargs)


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


def by_output(outputs: list[Output] | list[Emission]) -> dict[tuple[str, str], list[Any]]:
    got: dict[tuple[str, str], list[Any]] = defaultdict(list)
    for o in outputs:
        got[(o.node, o.name)].append(o.data if isinstance(o, Output) else o.value)
    return got


def assert_same(outputs: list[Output], emissions: list[Emission]) -> None:
    got, want = by_output(outputs), by_output(emissions)
    assert got.keys() == want.keys()
    for key in want:
        assert len(got[key]) == len(want[key]), key
        for a, b in zip(got[key], want[key], strict=True):
            assert torch.equal(torch.as_tensor(a), torch.as_tensor(b)), key


def toy_requests(n: int) -> list[Request]:
    rng = random.Random(5)
    out = []
    for i in range(n):
        task = ["speech", "image", "image_edit"][i % 3]
        data: dict[str, Any] = {
            "text": rng.choice(["hello", "mstar serves graphs", "models walk"]),
            "seed": i,
        }
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


def node_of(engine: AsyncEngine, rank: int) -> str:
    return engine.rank_info[rank].node_id


async def test_a_stream_and_a_cfg_loop_across_nodes_equal_the_reference(
    ray_cluster: LocalCluster,
) -> None:
    spec = ModelSpec("mstar.zoo.toy:ToyModel", {"seed": SEED})
    async with await AsyncEngine.start(
        spec, Placement.from_yaml(TOY_ACROSS), ray_config()
    ) as engine:
        assert node_of(engine, 0) == ray_cluster.cluster.head_node.node_id
        assert node_of(engine, 1) in {n.node_id for n in ray_cluster.b_nodes}
        reqs = toy_requests(6)
        results = await asyncio.gather(*(engine.run(r) for r in reqs))
        for r, outputs in zip(reqs, results, strict=True):
            assert_same(outputs, reference(r))
        # The tokens crossed between the nodes as tcp frames, not through shared memory.
        stats = await engine.engine_stats()
        assert stats.transport["rank1"]["tcp"]["received"] > 0
        assert stats.transport["rank1"].get("shm", {}).get("received", 0) == 0


async def test_a_dynamic_loop_spanning_two_nodes_equals_co_located(
    ray_cluster: LocalCluster,
) -> None:
    spec = ModelSpec("mstar.zoo.noop:NoopLoopModel", {"steps": 200})
    async with await AsyncEngine.start(spec) as local:
        want = [await local.run(Request("loop", {}, request_id=f"r{i}")) for i in range(3)]
    async with await AsyncEngine.start(
        spec, Placement.from_yaml(LOOP_ACROSS), ray_config()
    ) as engine:
        assert node_of(engine, 0) != node_of(engine, 1)
        got = await asyncio.gather(
            *(engine.run(Request("loop", {}, request_id=f"r{i}")) for i in range(3))
        )
    assert [[(o.name, o.data) for o in out] for out in got] == [
        [(o.name, o.data) for o in out] for out in want
    ]
    assert got[0][0].data == 200


async def test_losing_a_node_fails_its_requests_and_the_worker_comes_back(
    ray_cluster: LocalCluster,
) -> None:
    # ~3 s a request
    spec = ModelSpec("mstar.zoo.noop:NoopLoopModel", {"steps": 60, "delay_s": 0.05})
    config = ray_config(restart_wait_s=60.0)
    async with await AsyncEngine.start(spec, Placement.from_yaml(REPLICAS), config) as engine:
        lost_node = node_of(engine, 1)
        tasks = [
            asyncio.ensure_future(engine.run(Request("loop", {}, request_id=f"r{i}")))
            for i in range(4)
        ]
        # Requests alternate between the replicas: r0, r2 on rank 0; r1, r3 on rank 1.
        while True:
            held = await engine.held_state()
            if held["rank0"]["runners"] == 2 and held["rank1"]["runners"] == 2:
                break
            await asyncio.sleep(0.05)
        node = next(n for n in ray_cluster.b_nodes if n.node_id == lost_node)
        removed = time.monotonic()
        ray_cluster.cluster.remove_node(node, allow_graceful=False)
        ray_cluster.b_nodes.remove(node)
        failed_at: dict[int, float] = {}
        for i, task in enumerate(tasks):
            if i % 2 == 1:
                with pytest.raises(WorkerLostError):
                    await task
                failed_at[i] = time.monotonic() - removed
        # They fail as the node's connections close, not after waiting restart_wait_s for the
        # rank (the bound is half of it, so that a busy machine's slowness cannot fail this).
        assert max(failed_at.values()) < config.restart_wait_s / 2, failed_at
        print(f"requests of the lost node failed after {failed_at} s")
        for i in (0, 2):
            outputs = await tasks[i]
            assert [o.data for o in outputs] == [60]
        # Ray restarts rank 1 on the node_b node that is left; new requests then succeed.
        while not engine.ranks_up()[1]:
            await asyncio.sleep(0.1)
        assert node_of(engine, 1) != lost_node
        assert node_of(engine, 1) in {n.node_id for n in ray_cluster.b_nodes}
        again = await asyncio.gather(
            *(engine.run(Request("loop", {}, request_id=f"n{i}")) for i in range(2))
        )
        assert [[o.data for o in out] for out in again] == [[60], [60]]
    ray_cluster.add_b_node()  # for later tests


async def test_the_first_request_after_ray_restarted_a_killed_rank_succeeds(
    ray_cluster: LocalCluster,
) -> None:
    spec = ModelSpec("mstar.zoo.noop:NoopLoopModel", {"steps": 5})
    # Ray's restart takes seconds, longer than the rank may be away before walks that need it
    # fail: the conductor has given the rank up by the time it is back.
    config = ray_config(restart_wait_s=0.5)
    async with await AsyncEngine.start(spec, Placement.from_yaml(LOOP_ACROSS), config) as engine:
        assert [o.data for o in await engine.run(Request("loop", {}))] == [5]
        old = engine.rank_info[1]
        os.kill(old.pid, signal.SIGKILL)  # the rank's Ray actor process (Ray restarts it)
        while not (engine.rank_info[1].pid != old.pid and engine.ranks_up()[1]):
            await asyncio.sleep(0.05)
        assert engine.num_restarts == 1
        assert engine.rank_info[1].system_id != old.system_id
        assert [o.data for o in await engine.run(Request("loop", {}))] == [5]


async def test_backend_ray_in_the_placement_file_places_ranks_through_a_placement_group(
    ray_cluster: LocalCluster,
) -> None:
    spec = ModelSpec("mstar.zoo.noop:NoopLoopModel", {"steps": 20})
    before = {g["placement_group_id"] for g in placement_groups("CREATED")}
    config = EngineConfig(ray_num_cpus=0.5)  # no ray_address: the file says where
    async with await AsyncEngine.start(
        spec, Placement.from_yaml(LOOP_BACKEND_RAY), config
    ) as engine:
        assert engine.launcher is not None and engine.config.ray_address == "auto"
        assert node_of(engine, 0) == ray_cluster.cluster.head_node.node_id
        assert node_of(engine, 1) in {n.node_id for n in ray_cluster.b_nodes}
        (group,) = [g for g in placement_groups("CREATED") if g["placement_group_id"] not in before]
        assert group["strategy"] == "PACK"
        assert group["bundles"] == {0: {"CPU": 0.5, "node_a": 1.0}, 1: {"CPU": 0.5, "node_b": 1.0}}
        assert group["bundles_to_node_id"] == {0: node_of(engine, 0), 1: node_of(engine, 1)}
        got = await engine.run(Request("loop", {}))
        assert [o.data for o in got] == [20]
    assert group["placement_group_id"] not in {
        g["placement_group_id"] for g in placement_groups("CREATED")
    }


@pytest.mark.parametrize(
    ("resources", "why"),
    [
        (
            "{0: {node_a: 1}, 1: {node_z: 1}}",
            r"no node of the cluster offers rank 1 \{CPU: 0.5, node_z: 1\}",
        ),
        (
            "{0: {node_a: 1}, 1: {node_b: 5}}",
            r"no node of the cluster offers rank 1 \{CPU: 0.5, node_b: 5\}",
        ),
        (
            "{0: {node_a: 3}, 1: {node_a: 3}}",
            "every rank fits some node, but not all of them at once",
        ),
    ],
)
async def test_a_placement_the_cluster_cannot_satisfy_fails_fast(
    ray_cluster: LocalCluster, resources: str, why: str
) -> None:
    spec = ModelSpec("mstar.zoo.noop:NoopLoopModel", {"steps": 2})
    placement = Placement.from_yaml(
        "node_groups:\n  - {node_names: [a, b, done], ranks: [0, 1]}\nrank_resources: "
        f"{resources}\n"
    )
    with pytest.raises(PlacementError, match=why):
        await AsyncEngine.start(spec, placement, ray_config(ray_placement_timeout_s=1.0))
    assert placement_groups("PENDING") == []  # the reservation was withdrawn, nothing waits for it


def test_ray_is_left_running_for_the_application(ray_cluster: LocalCluster) -> None:
    """An engine that found Ray initialised leaves it so (the application owns it)."""
    assert ray.is_initialized()


# Orpheus' speech LM on node A, SNAC on a node_b node.
ORPHEUS_ACROSS = """
model: orpheus
deterministic: true
node_groups:
  - {node_names: [LLM], ranks: [0], ray_resources: {node_a: 1}}
  - {node_names: [snac_decoder], ranks: [1], ray_resources: {node_b: 1}}
"""
ORPHEUS_SPLIT = (
    "\n".join(line for line in ORPHEUS_ACROSS.splitlines() if "deterministic" not in line)
    .replace(", ray_resources: {node_a: 1}", "")
    .replace(", ray_resources: {node_b: 1}", "")
)


@pytest.mark.timeout(400)
async def test_deterministic_audio_is_the_same_bytes_on_every_placement(
    ray_cluster: LocalCluster,
) -> None:
    """orpheus-small, seeded and sampled, two requests at once: co-located on two threads,
    in two worker processes (one thread each) and over two Ray nodes give the same audio
    bytes, each equal to the request served alone on one thread."""
    spec = resolve_model("orpheus-small")
    requests = [
        Request("speech", {"text": text, "max_tokens": 56, "seed": i, "ignore_eos": True})
        for i, text in enumerate(["hello there", "deterministic bytes"])
    ]

    async def serve(
        placement: Placement | None, config: EngineConfig, together: bool = True
    ) -> list[bytes]:
        async with await AsyncEngine.start(spec, placement, config) as engine:
            if together:
                results = await asyncio.gather(*(engine.run(r) for r in requests))
            else:
                results = [await engine.run(r) for r in requests]
        return [
            b"".join(np.asarray(o.data, dtype=np.float32).tobytes() for o in out) for out in results
        ]

    alone = await serve(
        None, EngineConfig(deterministic=True, cpu_threads=1, offload_steps=False), False
    )
    assert all(len(a) > 0 for a in alone)
    colocated = await serve(None, EngineConfig(deterministic=True, cpu_threads=2))
    processes = await serve(
        Placement.from_yaml(ORPHEUS_SPLIT),
        EngineConfig(deterministic=True, worker_processes=True, cpu_threads=1),
    )
    across = await serve(Placement.from_yaml(ORPHEUS_ACROSS), ray_config())  # the file says so
    assert colocated == alone
    assert processes == alone
    assert across == alone


ORPHEUS_TP = """
model: orpheus
node_groups:
  - {node_names: [LLM], ranks: [0, 1], tensor_parallel: 2, ray_resources: {node_b: 1}}
  - {node_names: [snac_decoder], ranks: [2], ray_resources: {node_a: 1}}
"""
ORPHEUS_TP_ACROSS = """
model: orpheus
node_groups:
  - {node_names: [LLM], ranks: [0, 1], tensor_parallel: 2, allow_cross_node_tp: true}
  - {node_names: [snac_decoder], ranks: [0]}
rank_resources: {0: {node_a: 1}, 1: {node_b: 1}}
"""


@pytest.mark.timeout(400)
async def test_tensor_parallel_groups_on_the_cluster_speak_as_one_rank(
    ray_cluster: LocalCluster,
) -> None:
    """Orpheus' LM sharded over two ranks: reserved as one STRICT_PACK placement group (one
    node_b node, though the ranks' resources fit either) beside SNAC on node A; or, with
    ``allow_cross_node_tp``, spread over node A and a node_b node, summing over gloo (at a store
    the conductor serves). Both speak the co-located engine's audio; without the flag the
    spread ranks cannot be placed (a group's ranks share a node)."""
    spec = resolve_model("orpheus-tiny")
    requests = [
        Request("speech", {"text": text, "max_tokens": 56, "seed": i, "ignore_eos": True})
        for i, text in enumerate(["hello there", "tensor parallel"])
    ]

    async def serve(placement: Placement | None, config: EngineConfig) -> list[np.ndarray]:
        async with await AsyncEngine.start(spec, placement, config) as engine:
            if placement is ORPHEUS_TP_PLACEMENT:
                assert node_of(engine, 0) == node_of(engine, 1) != node_of(engine, 2)
                strict = [g for g in placement_groups("CREATED") if g["strategy"] == "STRICT_PACK"]
                assert [len(g["bundles"]) for g in strict] == [2]
            elif placement is not None:
                assert node_of(engine, 0) != node_of(engine, 1)
            outs = await asyncio.gather(*(engine.run(r) for r in requests))
            if placement is not None:
                assert (await engine.stats())[1]["LLM"]["steps"] > 0
        return [np.concatenate([np.asarray(o.data) for o in out]) for out in outs]

    want = await serve(None, EngineConfig(cpu_threads=1))
    for placement in (ORPHEUS_TP_PLACEMENT, Placement.from_yaml(ORPHEUS_TP_ACROSS)):
        got = await serve(placement, ray_config())
        for a, b in zip(got, want, strict=True):
            assert a.shape == b.shape and a.size > 0
            np.testing.assert_allclose(a, b, atol=1e-5)

    together = Placement.from_yaml(ORPHEUS_TP_ACROSS.replace(", allow_cross_node_tp: true", ""))
    with pytest.raises(PlacementError, match=r"no node offers ranks \[0, 1\] all at once"):
        await AsyncEngine.start(spec, together, ray_config(ray_placement_timeout_s=1.0))


ORPHEUS_TP_PLACEMENT = Placement.from_yaml(ORPHEUS_TP)
