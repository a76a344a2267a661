"""pi0.5 without mstar: the dense-KV sampler is exact; openpi's server serves one at a time and
accounts measured requests only."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest
import torch

from mstar.baselines.pi05 import (
    DenseKVSampler,
    OpenpiServer,
    chunk_flops,
    naive_sample_actions,
)
from mstar.runtime import Request
from mstar.zoo.pi05.model import Pi05Model
from mstar.zoo.pi05.modules import Pi05Weights, PrefixInput
from mstar.zoo.pi05.policy import (
    EXTERIOR_IMAGE_KEY,
    GRIPPER_POSITION_KEY,
    JOINT_POSITION_KEY,
    PROMPT_KEY,
    WRIST_IMAGE_KEY,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def model() -> Pi05Model:
    return Pi05Model("pi05-tiny")


def weights_of(model: Pi05Model) -> Pi05Weights:
    return model.load_weights(torch.device("cpu"))


def observation(seed: int, size: int) -> dict[str, Any]:
    g = np.random.default_rng(seed)
    return {
        EXTERIOR_IMAGE_KEY: g.integers(0, 256, (size, size, 3), dtype=np.uint8),
        WRIST_IMAGE_KEY: g.integers(0, 256, (size, size, 3), dtype=np.uint8),
        JOINT_POSITION_KEY: g.uniform(-1.5, 1.5, 7),
        GRIPPER_POSITION_KEY: g.uniform(0.0, 1.0, 1),
        PROMPT_KEY: "pick up the cup",
        "seed": seed,
    }


def test_dense_kv_sampler_equals_the_naive_recompute(model: Pi05Model) -> None:
    weights = weights_of(model)
    sampler = DenseKVSampler(weights)
    prepared = model.preprocess(Request("act", observation(7, model.config.vision.image_size)))
    vision, noise = prepared.inputs["vision"], prepared.inputs["llm"]["flow"]["x"]
    prefix = PrefixInput(
        sampler.embed_images(vision["images"], vision["image_mask"]), vision["token_ids"]
    )
    cached = sampler.flow(sampler.prefill(prefix), noise)
    torch.testing.assert_close(
        cached, naive_sample_actions(weights, prefix, noise), rtol=1e-4, atol=1e-5
    )


def test_openpi_server_answers_each_robot_and_meters_measured_requests_only(
    model: Pi05Model,
) -> None:
    server = OpenpiServer(model, weights_of(model))
    size = model.config.vision.image_size

    async def serve() -> list[np.ndarray]:
        return list(
            await asyncio.gather(
                server.act("warmup-2-0", observation(1, size)),
                server.act("concurrency-2-0", observation(1, size)),
                server.act("concurrency-2-1", observation(2, size)),
            )
        )

    try:
        warm, first, second = asyncio.run(serve())
    finally:
        server.close()
    assert first.shape == (model.config.action_horizon, model.config.robot_dof)
    np.testing.assert_array_equal(warm, first)  # the same observation and noise seed
    assert not np.array_equal(first, second)
    parts = ("preprocess", "vision", "prefix", "flow", "postprocess")
    assert set(server.meter.counts) == set(parts)
    assert all(server.meter.counts[part] == 2 for part in parts)  # the warm-up not counted


def test_chunk_flops_counts_matmuls_without_metering(model: Pi05Model) -> None:
    server = OpenpiServer(model, weights_of(model))
    size = model.config.vision.image_size
    try:
        one = chunk_flops(server, [observation(3, size)])
        mean = chunk_flops(server, [observation(3, size), observation(4, size)])
    finally:
        server.close()
    assert one > 0 and mean == pytest.approx(one, rel=0.2)
    assert server.meter.counts == {}
