"""pi0.5 served end to end: DROID observations in, un-normalized (horizon, 8) actions out, equal to
the naive recompute of the same preprocessed request; many robots at once; bad input fails alone."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest
import torch

from mstar.baselines.pi05 import naive_sample_actions
from mstar.errors import MStarError
from mstar.runtime import AsyncEngine, EngineConfig, Placement, Request
from mstar.zoo import resolve_model
from mstar.zoo.pi05.model import Pi05Model
from mstar.zoo.pi05.modules import Pi05Weights, PrefixInput
from mstar.zoo.pi05.nodes import VisionNode
from mstar.zoo.pi05.policy import droid_actions
from tests.helpers import wait_until_idle

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def observation(seed: int, size: int = 48) -> dict[str, Any]:
    g = np.random.default_rng(seed)
    return {
        "observation/exterior_image_1_left": g.integers(
            0, 256, (size, size + 16, 3), dtype=np.uint8
        ),
        "observation/wrist_image_left": g.integers(0, 256, (size, size, 3), dtype=np.uint8),
        "observation/joint_position": g.uniform(-1.5, 1.5, 7),
        "observation/gripper_position": g.uniform(0, 1, 1),
        "prompt": ["pick up the cup", "open the drawer", "put the marker in the bowl"][seed % 3],
        "seed": seed,
    }


@pytest.fixture(scope="module")
def model() -> Pi05Model:
    return Pi05Model("pi05-tiny")


@pytest.fixture(scope="module")
def reference_weights() -> Pi05Weights:
    """The same checkpoint loaded again, unfused (the engine fuses its own copy's products)."""
    weights: Pi05Weights = Pi05Model("pi05-tiny").load_weights(torch.device("cpu"))
    return weights


def reference_actions(model: Pi05Model, weights: Pi05Weights, data: dict[str, Any]) -> np.ndarray:
    """The same request through preprocessing, the naive sampler and postprocessing."""
    prepared = model.preprocess(Request("act", data))
    prefix = VisionNode(weights)([prepared.inputs["vision"]])[0]["prefix"]
    noise = prepared.inputs["llm"]["flow"]["x"]
    actions = naive_sample_actions(
        weights, PrefixInput(prefix["image_embeds"], prefix["token_ids"]), noise
    )
    return droid_actions(actions, model.norm_stats, model.config.robot_dof).astype(np.float32)


async def test_robots_get_unnormalized_actions_equal_to_the_naive_loop(
    model: Pi05Model, reference_weights: Pi05Weights
) -> None:
    async with await AsyncEngine.start(model) as engine:
        data = [observation(i) for i in range(6)]
        results = await asyncio.gather(*(engine.run(Request("act", d)) for d in data))
        await wait_until_idle(engine)  # every prefix is released with its request
        stats = await engine.stats()
    for d, outputs in zip(data, results, strict=True):
        (out,) = [o for o in outputs if o.name == "actions"]
        assert out.modality == "action" and out.data.shape == (model.config.action_horizon, 8)
        np.testing.assert_allclose(
            out.data, reference_actions(model, reference_weights, d), rtol=1e-4, atol=1e-4
        )
    llm = stats[0]["llm"]
    # robots shared steps
    assert llm["batched"] == 6 * (1 + model.config.num_steps) and llm["steps"] < llm["batched"]
    assert llm["kv_blocks_used"] == 0


async def test_the_seed_fixes_the_noise_and_bad_observations_fail_alone(model: Pi05Model) -> None:
    async with await AsyncEngine.start(model) as engine:
        bad = {**observation(1), "observation/joint_position": np.zeros(5)}
        good = engine.run(Request("act", observation(2)))
        with pytest.raises((ValueError, MStarError), match="joint_position"):
            await engine.run(Request("act", bad))
        first = next(o for o in await good if o.name == "actions").data
        again = next(
            o for o in await engine.run(Request("act", observation(2))) if o.name == "actions"
        ).data
        np.testing.assert_array_equal(first, again)


@pytest.mark.slow
async def test_vision_and_llm_on_separate_worker_processes(
    model: Pi05Model, reference_weights: Pi05Weights
) -> None:
    placement = Placement.from_yaml(
        "node_groups:\n  - {node_names: [vision], ranks: [0]}\n  - {node_names: [llm], "
        "ranks: [1]}\n"
    )
    spec = resolve_model("pi05-tiny")
    async with await AsyncEngine.start(
        spec, placement, EngineConfig(worker_processes=True)
    ) as engine:
        data = observation(4)
        outputs = await engine.run(Request("act", data))
    (out,) = [o for o in outputs if o.name == "actions"]
    np.testing.assert_allclose(
        out.data, reference_actions(model, reference_weights, data), rtol=1e-4, atol=1e-4
    )
