"""V-JEPA 2-AC served by the runtime: cached rollouts equal the native recompute, plans equal
the in-process CEM, requests batch across horizons, and nothing is left behind."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from mstar.baselines.vjepa2 import native_rollout
from mstar.errors import WalkExecutionError
from mstar.runtime import AsyncEngine, EngineConfig, ModelSpec, Output, Placement, Request
from mstar.runtime.conductor_core import Command, Deliver
from mstar.zoo.vjepa2 import (
    CEMParams,
    VJepa2Model,
    get_vjepa2_config,
    load_encoder,
    load_predictor,
    make_random_checkpoint,
    plan_with,
)
from mstar.zoo.vjepa2.inputs import prepare_image
from tests.helpers import Direct, wait_until_idle

CFG = get_vjepa2_config("vjepa2-tiny")
N, D = CFG.predictor.num_patches, CFG.predictor.embed_dim


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(make_random_checkpoint(CFG, tmp_path_factory.mktemp("vjepa2") / "tiny.pt", seed=3))


def rollout_data(seed: int, horizon: int, **extra: Any) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {
        "latent": F.layer_norm(torch.randn(N, D, generator=g), (D,)),
        "pose": torch.rand(7, generator=g) * 0.2,
        "actions": torch.randn(horizon, 7, generator=g) * 0.05,
        **extra,
    }


class Watched(Direct):
    """`Direct`, with an event set when any output is delivered."""

    def __init__(self, model: VJepa2Model) -> None:
        super().__init__(model, {n: [0] for n in model.graph().nodes})
        self.delivered = asyncio.Event()

    def execute(self, commands: list[Command]) -> None:
        super().execute(commands)
        if any(isinstance(c, Deliver) for c in commands):
            self.delivered.set()


def by_name(outputs: list[Output]) -> dict[str, Any]:
    return {o.name: o.data for o in outputs}


def expected_rollouts(
    checkpoint: str, data: list[dict[str, Any]]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The native recompute of equal-horizon requests, as one batch."""
    predictor = load_predictor(checkpoint, CFG)
    stack = {k: torch.stack([d[k] for d in data]) for k in ("latent", "pose", "actions")}
    return native_rollout(predictor, stack["latent"], stack["pose"], stack["actions"])


@pytest.mark.parametrize("horizon", [1, 2, 7, 31])
async def test_cached_rollouts_equal_the_native_recompute(checkpoint: str, horizon: int) -> None:
    model = VJepa2Model("vjepa2-tiny", checkpoint=checkpoint, kv={"num_blocks": 8 * 31})
    async with await AsyncEngine.start(model) as engine:
        for batch in (1, 3, 8):
            data = [rollout_data(100 * horizon + 10 * batch + i, horizon) for i in range(batch)]
            results = await asyncio.gather(*(engine.run(Request("rollout", d)) for d in data))
            latents, poses = expected_rollouts(checkpoint, data)
            for i, outputs in enumerate(results):
                got = by_name(outputs)
                assert {o.modality for o in outputs} == {"latent"} and {
                    o.walk for o in outputs
                } == {"rollout_latent"}
                torch.testing.assert_close(got["latents"], latents[i], rtol=1e-4, atol=1e-4)
                torch.testing.assert_close(got["poses"], poses[i])
        await wait_until_idle(engine)


async def test_different_horizons_share_steps_and_release_their_blocks(checkpoint: str) -> None:
    horizons = [3, 9, 17, 5]
    model = VJepa2Model("vjepa2-tiny", checkpoint=checkpoint, kv={"num_blocks": 64})
    async with Direct(model, {n: [0] for n in model.graph().nodes}) as d:
        data = [rollout_data(i, h) for i, h in enumerate(horizons)]
        results = await asyncio.gather(*(d.run(Request("rollout", x)) for x in data))
        engine = d.workers[0].engines["predictor"]
        stats = engine.stats()
        assert stats["batched"] == sum(horizons)  # every frame block computed once
        assert stats["steps"] < sum(horizons)  # requests in lockstep share steps
        assert engine.num_requests == 0 and stats["kv_blocks_used"] == 0
        d.assert_empty()
    predictor = load_predictor(checkpoint, CFG)
    for x, outputs in zip(data, results, strict=True):
        latents, poses = native_rollout(
            predictor, x["latent"][None], x["pose"][None], x["actions"][None]
        )
        torch.testing.assert_close(by_name(outputs)["latents"], latents[0], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(by_name(outputs)["poses"], poses[0])


async def test_streamed_frames_equal_the_final_trajectory_and_abort_frees_the_cache(
    checkpoint: str,
) -> None:
    model = VJepa2Model("vjepa2-tiny", checkpoint=checkpoint, kv={"num_blocks": 64})
    async with Watched(model) as d:
        final = by_name(await d.run(Request("rollout", rollout_data(5, 6))))
        streamed = await d.run(Request("rollout", rollout_data(5, 6, stream=True)))
        assert [o.name for o in streamed] == ["frame", "frame_pose"] * 6
        torch.testing.assert_close(
            torch.stack([o.data for o in streamed if o.name == "frame"]), final["latents"]
        )
        torch.testing.assert_close(
            torch.stack([o.data for o in streamed if o.name == "frame_pose"]), final["poses"]
        )
        engine = d.workers[0].engines["predictor"]
        request = Request("rollout", rollout_data(6, 31, stream=True))
        d.results[request.request_id] = asyncio.get_running_loop().create_future()
        d.delivered.clear()
        d.execute(d.core.submit(request))
        await d.delivered.wait()  # the first streamed frame arrived
        assert d.outputs[request.request_id] and engine.num_requests == 1
        d.execute(d.core.abort(request.request_id))
        with pytest.raises(Exception, match="aborted"):
            await d.results[request.request_id]
        await d.run(Request("rollout", rollout_data(7, 1)))  # a step boundary applies the release
        assert engine.num_requests == 0 and engine.stats()["kv_blocks_used"] == 0


async def test_rollout_from_an_image_encodes_first(checkpoint: str) -> None:
    image = (torch.rand(40, 56, 3, generator=torch.Generator().manual_seed(0)) * 255).to(
        torch.uint8
    )
    actions = torch.randn(4, 7, generator=torch.Generator().manual_seed(1)) * 0.05
    async with await AsyncEngine.start(VJepa2Model("vjepa2-tiny", checkpoint=checkpoint)) as engine:
        encoded = by_name(await engine.run(Request("encode", {"images": [image, image]})))
        got = by_name(await engine.run(Request("rollout", {"image": image, "actions": actions})))
    frames = prepare_image(image, CFG)[None]
    latent = load_encoder(checkpoint, CFG).encode_frames(frames)
    torch.testing.assert_close(encoded["latents"], latent.expand(2, -1, -1))
    latents, poses = native_rollout(
        load_predictor(checkpoint, CFG), latent, torch.zeros(1, 7), actions[None]
    )
    torch.testing.assert_close(got["latents"], latents[0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got["poses"], poses[0])


def reference_plan(
    checkpoint: str, context: torch.Tensor, goal: torch.Tensor, pose: torch.Tensor, **overrides: Any
) -> torch.Tensor:
    predictor = load_predictor(checkpoint, CFG)
    params = CEMParams.make(CFG.cem, overrides)
    return plan_with(
        lambda z, s, a: native_rollout(predictor, z, s, a)[0][:, -1], context, pose, goal, params
    )


async def test_plans_equal_the_in_process_cem_and_batch_together(checkpoint: str) -> None:
    g = torch.Generator().manual_seed(4)
    context, goal = (F.layer_norm(torch.randn(N, D, generator=g), (D,)) for _ in range(2))
    pose = torch.rand(7, generator=g) * 0.2
    settings = [
        {"seed": 1},
        {"seed": 2, "rollout": 3, "samples": 12, "topk": 3},
        {"seed": 3, "cem_steps": 2},
    ]
    async with await AsyncEngine.start(VJepa2Model("vjepa2-tiny", checkpoint=checkpoint)) as engine:
        requests = [
            Request("plan", {"latent": context, "goal_latent": goal, "pose": pose, **s})
            for s in settings
        ]
        results = await asyncio.gather(*(engine.run(r) for r in requests))
        await wait_until_idle(engine)
    for s, outputs in zip(settings, results, strict=True):
        assert [(o.name, o.modality, o.walk) for o in outputs] == [
            ("action", "action", "plan_latent")
        ]
        expected = reference_plan(checkpoint, context, goal, pose, **s)
        torch.testing.assert_close(outputs[0].data, expected[0], rtol=1e-4, atol=1e-5)
        assert (
            outputs[0].data[3:6].abs().sum() == 0
            and outputs[0].data[:3].abs().max() <= CFG.cem.maxnorm
        )


PLAN_SPLIT = (
    "node_groups:\n  - {node_names: [encoder, cem_sample, cem_update], ranks: "
    "[0]}\n  - {node_names: [predictor], ranks: [1]}\n"
)


async def test_plan_from_images_across_processes(checkpoint: str) -> None:
    g = torch.Generator().manual_seed(5)
    image, goal_image = (
        (torch.rand(32, 32, 3, generator=g) * 255).to(torch.uint8) for _ in range(2)
    )
    spec = ModelSpec(
        "mstar.zoo.vjepa2.model:VJepa2Model", {"config": "vjepa2-tiny", "checkpoint": checkpoint}
    )
    config = EngineConfig(worker_processes=True)
    async with await AsyncEngine.start(spec, Placement.from_yaml(PLAN_SPLIT), config) as engine:
        outputs = await engine.run(
            Request("plan", {"image": image, "goal_image": goal_image, "seed": 7})
        )
        await wait_until_idle(engine)
    encoder = load_encoder(checkpoint, CFG)
    latents = encoder.encode_frames(
        torch.stack([prepare_image(image, CFG), prepare_image(goal_image, CFG)])
    )
    expected = reference_plan(checkpoint, latents[0], latents[1], torch.zeros(7), seed=7)
    assert [o.name for o in outputs] == ["action"]
    torch.testing.assert_close(outputs[0].data, expected[0], rtol=1e-4, atol=1e-5)


async def test_bad_requests_fail_clearly(checkpoint: str) -> None:
    model = VJepa2Model("vjepa2-tiny", checkpoint=checkpoint, kv={"num_blocks": 8})
    async with await AsyncEngine.start(model) as engine:
        cases: list[tuple[Request, str]] = [
            (Request("rollout", {"latent": torch.zeros(N, D)}), "actions is required"),
            (Request("rollout", rollout_data(0, 32)), "1 to 31 frames"),
            (Request("rollout", {"actions": torch.zeros(2, 7)}), "needs the context frame"),
            (Request("plan", {"latent": torch.zeros(N, D)}), "goal_latent"),
            (
                Request(
                    "plan",
                    {
                        "image": torch.zeros(3, 32, 32),
                        "goal_image": torch.zeros(3, 32, 32),
                        "topk": 99,
                    },
                ),
                "topk must be in",
            ),
            (
                Request(
                    "plan",
                    {"latent": torch.zeros(N, D), "goal_latent": torch.zeros(N, D), "iters": 2},
                ),
                "unknown plan fields",
            ),
            (Request("dream", {}), "task must be one of"),
        ]
        for request, message in cases:
            with pytest.raises(ValueError, match=message):
                await engine.run(request)
        with pytest.raises(
            WalkExecutionError,
            match=r"reserves 9 blocks for its sequences but the KV cache of node 'predictor' has 8",
        ) as info:
            await engine.run(Request("rollout", rollout_data(1, 9)))
        assert info.value.node == "predictor"
        # the engine still serves
        ok = by_name(await engine.run(Request("rollout", rollout_data(2, 8))))
        assert ok["latents"].shape == (8, N, D)
        await wait_until_idle(engine)


def test_model_contract(checkpoint: str, tmp_path: Path) -> None:
    model = VJepa2Model("vjepa2-tiny", checkpoint=checkpoint)
    assert model.tasks() == ("encode", "rollout", "plan")
    assert model.engine_types()["predictor"].value == "kv_cache"
    text = str(model.graph())
    assert (
        "DynamicLoop(max_iters=31, stop=done)" in text
        and "DynamicLoop(max_iters=100, stop=planned)" in text
    )
    with pytest.raises(Exception, match="needs checkpoint="):
        VJepa2Model("vjepa2-ac-vitg")
    with pytest.raises(Exception, match="does not exist"):
        VJepa2Model("vjepa2-tiny", checkpoint=str(tmp_path / "missing.pt"))
