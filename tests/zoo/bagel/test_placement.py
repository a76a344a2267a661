"""BAGEL's CFG branches on ranks of their own give the outputs of the co-located walks.

A branch placed away from ``llm`` runs on an engine of its own, which rebuilds the branch's
context from the inputs the prefills persist at the request's first query and then queries
a fork of it: text-to-image (an empty text-free context, an image-free one of text), editing
(a text-free context of the image's VAE and ViT tokens) and think mode, batched; in-process
ranks, and worker processes.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import torch

from mstar.runtime import AsyncEngine, EngineConfig, ModelSpec, Output, Request
from mstar.runtime.placement import Placement
from mstar.zoo.bagel.model import BagelModel
from tests.zoo.bagel.test_engine import by_name, edit, t2i

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CFG_PARALLEL = Path(__file__).parents[3] / "examples" / "bagel_cfg_parallel.yaml"
# Both branches on one rank of their own (fewer processes to start).
TWO_RANKS = """
node_groups:
  - {node_names: [llm, llm_vit, llm_vae, vit, vae_encoder, denoise, cfg_combine, vae_decoder], ranks: [0]}
  - {node_names: [denoise_cfg_text, denoise_cfg_img], ranks: [1]}
"""  # noqa: E501 (a table or diagram)


def requests() -> list[Request]:
    return [
        t2i(0, cfg_img_scale=2.0),
        edit(1),
        edit(2, think=True, max_think_tokens=3),
        t2i(3, think=True, max_think_tokens=4),
    ]


async def serve(
    model: Any, placement: Placement | str | Path | None, config: EngineConfig | None = None
) -> tuple[list[list[Output]], Any]:
    async with await AsyncEngine.start(model, placement=placement, config=config) as engine:
        outs = await asyncio.gather(*(engine.run(r) for r in requests()))
        stats = await engine.stats()
    return list(outs), stats


def assert_same(got: list[list[Output]], want: list[list[Output]]) -> None:
    for a, b in zip(got, want, strict=True):
        assert torch.equal(by_name(a, "latents")[0], by_name(b, "latents")[0])
        assert by_name(a, "image") == by_name(b, "image")
        assert by_name(a, "token") == by_name(b, "token")


@pytest.fixture(scope="module")
def colocated() -> list[list[Output]]:
    return asyncio.run(serve(BagelModel("bagel-tiny", dtype="float64"), None))[0]


async def test_branches_on_ranks_of_their_own_equal_colocated(
    colocated: list[list[Output]],
) -> None:
    model = BagelModel("bagel-tiny", dtype="float64")
    outs, stats = await serve(model, CFG_PARALLEL)
    assert_same(outs, colocated)
    # each branch ran on its own rank's engine, and rank 0's engine ran none of their queries
    assert (
        stats[1]["denoise_cfg_text"]["batched"] > 0 and stats[2]["denoise_cfg_img"]["batched"] > 0
    )
    assert set(stats[1]) == {"denoise_cfg_text"} and set(stats[2]) == {"denoise_cfg_img"}


@pytest.mark.slow
async def test_branches_in_worker_processes_equal_colocated(colocated: list[list[Output]]) -> None:
    spec = ModelSpec(
        "mstar.zoo.bagel.model:BagelModel", {"config": "bagel-tiny", "dtype": "float64"}
    )
    outs, _ = await serve(spec, Placement.from_yaml(TWO_RANKS), EngineConfig(worker_processes=True))
    assert_same(outs, colocated)
