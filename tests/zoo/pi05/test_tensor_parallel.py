"""pi0.5 with its ``llm`` node (both Gemma experts) sharded over two ranks (``tensor_parallel:
2``: each expert's query heads with the one KV head replicated, its MLP columns, the token
embedding's vocabulary rows) beside an unsharded ``vision`` node: the actions of one rank; each
rank loads only its slice of the checkpoint."""

from __future__ import annotations

import asyncio
import copy
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from mstar.baselines.pi05 import naive_sample_actions
from mstar.engines.kv_node import KVNodeEngine
from mstar.engines.native import cpu_kernels
from mstar.engines.parallel import (
    ShmGroup,
    TensorParallelError,
    TensorParallelFollower,
    TensorShard,
    sharded,
)
from mstar.runtime import AsyncEngine, EngineConfig, Placement, Request
from mstar.zoo import resolve_model
from mstar.zoo.pi05.checkpoint import load_pi05
from mstar.zoo.pi05.model import Pi05Model
from mstar.zoo.pi05.modules import ActionInput, Pi05Weights, PrefixInput
from mstar.zoo.pi05.nodes import CACHED, LLMNode, VisionNode
from tests.zoo.pi05.test_engine import CFG, request_inputs, serve
from tests.zoo.pi05.test_serving import observation

pytestmark = [
    pytest.mark.skipif(cpu_kernels() is None, reason="needs the native kernels"),
    pytest.mark.usefixtures("one_torch_thread"),
]

TP_LLM = """
node_groups:
  - {node_names: [llm], ranks: [0, 1], tensor_parallel: 2}
  - {node_names: [vision], ranks: [0]}
"""


async def _actions(placement: Placement | None) -> list[np.ndarray]:
    spec = resolve_model("pi05-tiny")
    async with await AsyncEngine.start(spec, placement, EngineConfig(cpu_threads=1)) as engine:
        outputs = await asyncio.gather(
            *(engine.run(Request("act", observation(i))) for i in range(3))
        )
        if placement is not None:  # rank 1 ran the llm's steps on its shard
            assert (await engine.stats())[1]["llm"]["steps"] > 0
    return [next(o for o in out if o.name == "actions").data for out in outputs]


@pytest.mark.slow
@pytest.mark.timeout(300)
async def test_a_sharded_llm_acts_as_one_rank() -> None:
    want = await _actions(None)
    got = await _actions(Placement.from_yaml(TP_LLM))
    for actions, expected in zip(got, want, strict=True):
        assert actions.shape == expected.shape
        # float32 partial sums added in another order
        np.testing.assert_allclose(actions, expected, rtol=1e-4, atol=1e-4)


def test_each_rank_loads_its_slice_of_the_whole_model() -> None:
    model = Pi05Model("pi05-tiny")
    config = model.config
    whole = load_pi05(model.checkpoint, config, nodes=["llm"])
    assert all(p.is_meta for p in whole.vision_tower.parameters())  # the vision node's
    names = [n for n, p in whole.named_parameters() if not p.is_meta]
    for rank in (0, 1):
        shard = TensorShard(rank, 2)
        with sharded(shard):
            part = load_pi05(model.checkpoint, config, nodes=["llm"])
        want = copy.deepcopy(whole)
        want.shard_(shard)
        assert part.tensor_shard == shard
        got_params, want_params = dict(part.named_parameters()), dict(want.named_parameters())
        for name in names:
            assert torch.equal(got_params[name], want_params[name]), name
        # 4 of the 8 query heads of each expert, the one KV head kept; half of each MLP
        heads, kv_heads, head_dim = (
            config.vlm.num_heads,
            config.vlm.num_kv_heads,
            config.vlm.head_dim,
        )
        for stack in (part.language_model, part.gemma_expert):
            attn = stack.blocks[0].self_attn
            assert attn.shape == (heads // 2, kv_heads, head_dim)
            assert attn.q_proj.weight.shape[0] == heads // 2 * head_dim
            assert stack.blocks[0].mlp.gate_proj.out_features == config.vlm.mlp_dim // 2
        assert part.kv_cache_spec.num_kv_heads == kv_heads
        assert part.vocab_start == rank * config.vocab_size // 2
        # the adaptive norms' conditioning maps stay whole
        torch.testing.assert_close(
            part.gemma_expert.norm.dense.weight, whole.gemma_expert.norm.dense.weight
        )


async def _flow(engine: KVNodeEngine, rid: str, flow: Any) -> torch.Tensor:
    """A request's Euler steps over its cached prefix; return its actions."""
    for _ in range(CFG.num_steps):
        out = await engine.submit(rid, {"prefix": CACHED, "flow": flow}, "action_gen")
        flow = out["flow"]
    engine.release(rid)
    return torch.as_tensor(out["actions"])


@pytest.fixture
def shm_path() -> Iterator[Path]:
    path = Path("/dev/shm") / f"mstar-test-pi05-tp-{secrets.token_hex(6)}"
    yield path
    path.unlink(missing_ok=True)


def test_two_shards_run_prefix_and_action_rows_in_one_step(shm_path: Path) -> None:
    """The leader's engine and a follower thread: a step holding one robot's prefix and
    another's actions (both experts, each reduced on its own) gives the naive recompute's
    actions."""
    model = Pi05Model("pi05-tiny")
    whole = model.load_weights(torch.device("cpu"))
    shards = []
    for rank in (0, 1):
        part = copy.deepcopy(whole)
        part.shard_(TensorShard(rank, 2, ShmGroup(shm_path, rank, 2)))
        part.fuse_for_inference(prefix_rows=(64,), action_rows=(10, 20))
        shards.append(part)
    experts: list[set[type]] = []  # the payload types of each of the leader's steps
    forward = shards[0].forward

    def recording(input_ids: torch.Tensor, positions: torch.Tensor, ctx: Any) -> torch.Tensor:
        experts.append({type(c.payload) for c in ctx.step.chunks})
        return forward(input_ids, positions, ctx)

    shards[0].forward = recording  # type: ignore[method-assign]
    requests = [request_inputs(whole, seed) for seed in range(2)]
    prefixes = [p["prefix"] for p in VisionNode(whole)([r for r, _ in requests])]

    async def main() -> list[torch.Tensor]:
        group = shards[0].shard.group if shards[0].shard is not None else None
        engine = KVNodeEngine("llm", LLMNode(shards[0]), None, "cpu", tensor_parallel=group)
        assert shards[1].shard is not None and shards[1].shard.group is not None
        follower = TensorParallelFollower("llm", shards[1], shards[1].shard.group, "cpu")
        follower.start()
        engine.start()
        try:
            first = await engine.submit(
                "r0", {"prefix": prefixes[0], "flow": {"x": requests[0][1], "step": 0}}, "prefill"
            )
            # r0's Euler steps beside r1's prefix and steps
            return list(
                await asyncio.gather(
                    _flow(engine, "r0", first["flow"]),
                    serve(engine, "r1", prefixes[1], requests[1][1]),
                )
            )
        finally:
            await engine.aclose()
            follower.close()
            assert follower.num_steps > 0
            assert follower.error is None or "stopped" in str(follower.error)  # closed

    outs = asyncio.run(main())
    assert {PrefixInput, ActionInput} in experts
    for (_inputs, noise), prefix, got in zip(requests, prefixes, outs, strict=True):
        want = naive_sample_actions(
            whole, PrefixInput(prefix["image_embeds"], prefix["token_ids"]), noise
        )
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_heads_that_cannot_split_are_refused() -> None:
    with torch.device("meta"):
        weights = Pi05Weights(Pi05Model("pi05-tiny").config)
    with pytest.raises(TensorParallelError, match="8 query heads over 1 KV heads"):
        weights.shard_(TensorShard(0, 3))
