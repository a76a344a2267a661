"""pi0.5 on the paged-KV engine: a written bidirectional prefix, then ten read-only Euler steps of
the action expert; equal to the naive recompute of prefix and suffix at every step, batched."""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Mapping
from typing import Any

import pytest
import torch

from mstar.baselines.pi05 import naive_sample_actions
from mstar.engines.kv_node import KVNodeEngine
from mstar.zoo.pi05.config import get_pi05_config
from mstar.zoo.pi05.modules import Pi05Weights, PrefixInput
from mstar.zoo.pi05.nodes import CACHED, LLMNode, VisionNode

CFG = get_pi05_config("pi05-tiny")

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def weights() -> Pi05Weights:
    torch.manual_seed(0)
    model = Pi05Weights(CFG)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("layernorm.weight") or (
                name.endswith("norm.weight") and "vision" not in name
            ):
                param.normal_(0.0, 0.1)  # Gemma norms are zero-centred: move them off zero
    return model.eval()


def request_inputs(weights: Pi05Weights, seed: int) -> tuple[dict[str, Any], torch.Tensor]:
    """A request's vision inputs (1-3 cameras present, prompt of varying length) and noise."""
    g = torch.Generator().manual_seed(seed)
    cams = len(CFG.cameras)
    mask = torch.zeros(cams, dtype=torch.bool)
    mask[: 1 + seed % cams] = True
    size = CFG.vision.image_size
    images = torch.rand(cams, 3, size, size, generator=g) * 2 - 1
    tokens = torch.randint(4, CFG.vocab_size, (5 + seed % 7,), generator=g)
    noise = torch.randn(CFG.action_horizon, CFG.action_dim, generator=g)
    return {"images": images, "image_mask": mask, "token_ids": tokens}, noise


async def serve(
    engine: KVNodeEngine, rid: str, prefix: Mapping[str, Any], noise: torch.Tensor
) -> torch.Tensor:
    """The walks: prefill once, then num_steps firings feeding the flow back (the Loop)."""
    out = await engine.submit(rid, {"prefix": prefix, "flow": {"x": noise, "step": 0}}, "prefill")
    flow = out["flow"]
    for _ in range(CFG.num_steps):
        out = await engine.submit(rid, {"prefix": CACHED, "flow": flow}, "action_gen")
        flow = out["flow"]
    engine.release(rid)
    return out["actions"]


@pytest.mark.parametrize("fused", [False, True], ids=["checkpoint-layout", "fused"])
@pytest.mark.parametrize("batch", [1, 4, 16])
def test_cached_flow_equals_the_naive_recompute(
    weights: Pi05Weights, batch: int, fused: bool
) -> None:
    vision = VisionNode(weights)
    requests = [request_inputs(weights, seed) for seed in range(batch)]
    prefixes = [p["prefix"] for p in vision([r for r, _ in requests])]
    served = weights
    if fused:  # the engine's products fused and re-laid out, the reference's as loaded
        served = copy.deepcopy(weights)
        served.fuse_for_inference(
            prefix_rows=(CFG.prefix_len, 4 * CFG.prefix_len),
            action_rows=(CFG.action_horizon, 16 * CFG.action_horizon),
        )
        assert (
            served.modulation is not None
            and served.gemma_expert.blocks[0].self_attn.qkv is not None
        )

    async def main() -> list[torch.Tensor]:
        engine = KVNodeEngine("llm", LLMNode(served), None, "cpu")
        engine.start()
        try:
            outs = await asyncio.gather(
                *(serve(engine, f"r{i}", prefixes[i], requests[i][1]) for i in range(batch))
            )
            stats = engine.stats()
            # every robot's prefill, then each Euler step, batched
            assert stats["steps"] == 1 + CFG.num_steps
            assert stats["batched"] == batch * (1 + CFG.num_steps)
            return outs
        finally:
            await engine.aclose()

    outs = asyncio.run(main())
    for (_inputs, noise), prefix, got in zip(requests, prefixes, outs, strict=True):
        ref = naive_sample_actions(
            weights, PrefixInput(prefix["image_embeds"], prefix["token_ids"]), noise
        )
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-5)
        assert not torch.allclose(got, noise)


def test_prefix_attention_is_bidirectional_and_the_cache_is_read_only(weights: Pi05Weights) -> None:
    """Changing the last prompt token changes what image tokens see (bidirectional prefix), and
    running the flow twice over one prefix gives the same actions (the steps write nothing)."""
    vision = VisionNode(weights)
    inputs, noise = request_inputs(weights, 3)
    prefix = vision([inputs])[0]["prefix"]

    async def twice() -> tuple[torch.Tensor, torch.Tensor, int]:
        engine = KVNodeEngine("llm", LLMNode(weights), None, "cpu")
        engine.start()
        try:
            out = await engine.submit("r", {"prefix": prefix, "flow": {"x": noise, "step": 0}})
            results = []
            for _ in range(2):
                flow = out["flow"]
                for _ in range(CFG.num_steps):
                    step_out = await engine.submit("r", {"prefix": CACHED, "flow": flow})
                    flow = step_out["flow"]
                results.append(step_out["actions"])
            used = int(engine.stats()["kv_blocks_used"])
            return results[0], results[1], used
        finally:
            await engine.aclose()

    first, second, used = asyncio.run(twice())
    torch.testing.assert_close(first, second, rtol=0, atol=0)
    num_prefix = PrefixInput(prefix["image_embeds"], prefix["token_ids"]).num_tokens
    assert used == -(-num_prefix // 16)  # only the prefix's blocks
    changed = dict(
        prefix, token_ids=torch.cat([prefix["token_ids"][:-1], prefix["token_ids"][-1:] + 1])
    )
    a = naive_sample_actions(
        weights, PrefixInput(prefix["image_embeds"], prefix["token_ids"]), noise
    )
    b = naive_sample_actions(
        weights, PrefixInput(changed["image_embeds"], changed["token_ids"]), noise
    )
    assert not torch.allclose(a, b)


def test_bad_flow_inputs_fail_clearly(weights: Pi05Weights) -> None:
    node = LLMNode(weights)
    with pytest.raises(ValueError, match="flow 'x' must have shape"):
        node.forward("r", {"prefix": CACHED, "flow": {"x": torch.zeros(3, 3), "step": 0}})
    with pytest.raises(ValueError, match="flow 'step' must be in"):
        node.forward(
            "r",
            {
                "prefix": CACHED,
                "flow": {"x": torch.zeros(CFG.action_horizon, CFG.action_dim), "step": 10},
            },
        )


def test_bfloat16_runs_openpi_mixed_precision(weights: Pi05Weights) -> None:
    """In bfloat16 the blocks run in bfloat16 with openpi's float32 islands (SigLIP's embeddings,
    every norm, the time MLP, the action projections); the engine's actions equal the naive
    recompute at that precision and the float32 actions within bfloat16's tolerance."""
    mixed = copy.deepcopy(weights).to_precision(torch.bfloat16)
    islands = {n for n, p in mixed.named_parameters() if p.dtype == torch.float32}
    assert islands == {
        n
        for n, _ in weights.named_parameters()
        if n.startswith(
            (
                "vision_tower.embeddings.",
                "action_",
                "time_mlp_",
                "language_model.norm.",
                "gemma_expert.norm.",
            )
        )
        or (".input_layernorm." in n or ".post_attention_layernorm." in n)
    }
    assert "gemma_expert.layers.0.input_layernorm.dense.weight" in islands
    assert {p.dtype for n, p in mixed.named_parameters() if n not in islands} == {torch.bfloat16}
    assert mixed.kv_cache_spec.dtype == torch.bfloat16
    requests = [request_inputs(weights, seed) for seed in range(3)]

    async def main() -> list[torch.Tensor]:
        engine = KVNodeEngine("llm", LLMNode(mixed), None, "cpu")
        engine.start()
        try:
            prefixes = [p["prefix"] for p in VisionNode(mixed)([r for r, _ in requests])]
            assert {p["image_embeds"].dtype for p in prefixes} == {torch.bfloat16}
            return await asyncio.gather(
                *(serve(engine, f"r{i}", prefixes[i], requests[i][1]) for i in range(3))
            )
        finally:
            await engine.aclose()

    outs = asyncio.run(main())
    for (inputs, noise), got in zip(requests, outs, strict=True):
        assert got.dtype == torch.float32
        prefix32 = VisionNode(weights)([inputs])[0]["prefix"]
        prefix16 = VisionNode(mixed)([inputs])[0]["prefix"]
        same = naive_sample_actions(
            mixed, PrefixInput(prefix16["image_embeds"], prefix16["token_ids"]), noise
        )
        scale = float(same.abs().max())
        # bfloat16 products, other batching
        torch.testing.assert_close(got, same, rtol=0, atol=5e-3 * scale)
        full = naive_sample_actions(
            weights, PrefixInput(prefix32["image_embeds"], prefix32["token_ids"]), noise
        )
        # measured: 1.1e-3 to 1.5e-3
        assert float((got - full).abs().max()) < 1e-2 * float(full.abs().max())
        assert not torch.equal(got, full)
