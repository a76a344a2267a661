"""BAGEL with its MoT LLM sharded over two ranks (``tensor_parallel: 2``: both experts' heads and
MLP columns, the embedding's and the head's vocabulary rows) beside the ViT, the VAE and the
flow's combine on rank 0: the images, latents and answers of the one-rank LLM, for every task
(text-to-image, editing, understanding, a chat, think mode); and each rank loads its slices of
the checkpoint, which equal the whole model's weights sharded in memory.
"""

from __future__ import annotations

import asyncio
import copy
from typing import Any, cast

import numpy as np
import pytest
import torch

from mstar.engines.native import cpu_kernels
from mstar.engines.parallel import TensorShard, sharded
from mstar.runtime import AsyncEngine, EngineConfig, Output, Placement, Request
from mstar.zoo.bagel.checkpoint import LLM_PARTS, load_bagel
from mstar.zoo.bagel.llm_node import LLMNode
from mstar.zoo.bagel.model import BagelModel
from tests.zoo.bagel.test_engine import by_name, edit, png_pixels, t2i, understand

pytestmark = [
    pytest.mark.skipif(cpu_kernels() is None, reason="needs the native kernels"),
    pytest.mark.usefixtures("one_torch_thread"),
]

# Every LLM node runs on the ``llm`` node's engine where they share a rank: on rank 0, the
# group's leader, they all step on the sharded engine, whether placed beside it or in its group
# (where they take no shard of their own).
TP_LLM = """
node_groups:
  - {node_names: [llm], ranks: [0, 1], tensor_parallel: 2}
  - {node_names: [llm_vit, llm_vae, denoise, denoise_cfg_text, denoise_cfg_img, vit, vae_encoder, cfg_combine, vae_decoder], ranks: [0]}
"""  # noqa: E501 (a table or diagram)
TP_LLM_NODES = """
node_groups:
  - {node_names: [llm, llm_vit, llm_vae, denoise, denoise_cfg_text, denoise_cfg_img], ranks: [0, 1], tensor_parallel: 2}
  - {node_names: [vit, vae_encoder, cfg_combine, vae_decoder], ranks: [0]}
"""  # noqa: E501 (a table or diagram)


def requests() -> list[Request]:
    return [
        t2i(0, cfg_img_scale=2.0),
        edit(1),
        understand(2),
        Request("generate", {"prompt": "hello there", "max_tokens": 5}),
        t2i(3, think=True, max_think_tokens=3, num_timesteps=3),
    ]


async def _serve(placement: Placement | None) -> tuple[list[list[Output]], dict[int, dict]]:
    # float32: the shared-memory collectives sum float32 or bfloat16
    model = BagelModel("bagel-tiny")
    async with await AsyncEngine.start(model, placement, EngineConfig(cpu_threads=1)) as engine:
        outs = await asyncio.gather(*(engine.run(r) for r in requests()))
        stats = await engine.stats()
    return list(outs), stats


@pytest.fixture(scope="module")
def one_rank() -> list[list[Output]]:
    return asyncio.run(_serve(None))[0]


@pytest.mark.parametrize("placement", [TP_LLM, TP_LLM_NODES])
async def test_a_sharded_llm_draws_edits_and_answers_as_one_rank(
    one_rank: list[list[Output]], placement: str
) -> None:
    want = one_rank
    got, stats = await _serve(Placement.from_yaml(placement))
    # rank 1 ran every step of the leader's engine (each LLM node's) on its shard, and follows
    # no other node
    assert stats[1]["llm"]["steps"] == stats[0]["llm"]["steps"] > 0
    assert set(stats[1]) == {"llm"}
    for request, a, b in zip(requests(), got, want, strict=True):
        assert by_name(a, "token") == by_name(b, "token")
        if request.task in ("understand", "generate"):
            assert len(by_name(a, "token")) > 0
            continue
        # the dense parity tests' float32 tolerance (the sums run in another order)
        torch.testing.assert_close(
            by_name(a, "latents")[0], by_name(b, "latents")[0], rtol=1e-4, atol=1e-4
        )
        pixels = [png_pixels(by_name(out, "image")[0]).astype(np.int16) for out in (a, b)]
        assert pixels[0].shape == pixels[1].shape
        assert np.abs(pixels[0] - pixels[1]).max() <= 1


@pytest.mark.parametrize("rank", [0, 1])
def test_each_rank_loads_the_whole_models_shard(rank: int) -> None:
    model = BagelModel("bagel-tiny", dtype="float64")
    cfg, shard = model.config, TensorShard(rank, 2)
    whole, _ = load_bagel(model.checkpoint, cfg, dtype=torch.float64, parts=LLM_PARTS)
    want = copy.deepcopy(whole.language_model)
    want.shard_(shard)
    with sharded(shard):
        weights, _ = load_bagel(model.checkpoint, cfg, dtype=torch.float64, parts=LLM_PARTS)
    got = weights.language_model
    assert got.tensor_shard == shard
    expected = want.state_dict()
    assert got.state_dict().keys() == expected.keys()
    for name, tensor in got.state_dict().items():
        assert torch.equal(tensor, expected[name]), name
    # half the heads of both experts, half of each MLP, half the vocabulary (rows padded)
    attn, full = got.model.layers[0].self_attn, whole.language_model.model.layers[0].self_attn
    assert attn.num_heads == cfg.llm.num_heads // 2 and attn.num_kv_heads == 1
    assert attn.q_proj_moe_gen.weight.shape[0] == full.q_proj_moe_gen.weight.shape[0] // 2
    assert weights.kv_cache_spec.num_kv_heads == cfg.llm.num_kv_heads // 2
    mlp = got.model.layers[0].mlp_moe_gen
    assert mlp.down_proj.weight.shape[1] == cfg.llm.intermediate_size // 2
    rows = -(-cfg.llm.vocab_size // 2)
    assert got.lm_head.weight.shape[0] == got.model.embed_tokens.weight.shape[0] == rows
    # the norms, and what the LLM's nodes read around it, stay whole
    torch.testing.assert_close(attn.q_norm_moe_gen.weight, full.q_norm_moe_gen.weight)
    torch.testing.assert_close(weights.llm2vae.weight, whole.llm2vae.weight)


def test_a_rank_keeps_its_own_weights() -> None:
    model = BagelModel("bagel-tiny", dtype="float64")
    cpu = torch.device("cpu")
    whole, _ = model.load(cpu, ["llm"])
    with sharded(TensorShard(1, 2)):
        shard, _ = model.load(cpu, ["llm"])
    assert whole.language_model.tensor_shard is None and shard is not whole
    assert shard.language_model.tensor_shard == TensorShard(1, 2)
    assert model.load(cpu, ["llm"])[0] is whole


class _Leader:
    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple[Any, ...]]] = []

    def call(self, method: str, args: tuple[Any, ...]) -> None:
        self.calls.append((method, args))


class _Group:
    rank, world = 0, 2

    def __init__(self) -> None:
        self.leader = _Leader()


def test_a_released_request_is_forgotten_on_every_rank() -> None:
    # the leader's view tells the followers' (the RoPE offsets each notes from the steps)
    model = BagelModel("bagel-tiny")
    group = _Group()
    with sharded(TensorShard(0, 2, cast(Any, group))):
        weights, _ = load_bagel(model.checkpoint, model.config, parts=LLM_PARTS)
    node = LLMNode(weights)
    node.model.rope_offsets.update({"r1": 3, "r1/cfg_img": 4, "r2": 5})
    node.release("r1")
    assert group.leader.calls == [("forget", ("r1",))]
    assert node.model.rope_offsets == {"r2": 5}
