"""Qwen3-Omni with its thinker sharded over two ranks (``tensor_parallel: 2``: heads, each
expert's columns, the head's vocabulary rows) beside an unsharded talker and Code2Wav, and with
the talker sharded too (its head whole: the leader draws the frames): the answers, talker codes
and audio of the one-rank model, for text and audio prompts."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from mstar.engines.native import cpu_kernels
from mstar.engines.parallel import TensorShard, sharded
from mstar.runtime import AsyncEngine, EngineConfig, Placement, Request
from mstar.zoo.qwen3_omni.checkpoint import load_qwen3_omni, make_random_checkpoint
from mstar.zoo.qwen3_omni.config import get_qwen3_omni_config
from mstar.zoo.qwen3_omni.model import Qwen3OmniModel
from tests.zoo.qwen3_omni.test_model import CONFIG, REQUESTS, split

pytestmark = [
    pytest.mark.skipif(cpu_kernels() is None, reason="needs the native kernels"),
    pytest.mark.usefixtures("one_torch_thread"),
]

TP_THINKER = """
node_groups:
  - {node_names: [thinker], ranks: [0, 1], tensor_parallel: 2}
  - {node_names: [audio_encoder, vision_encoder, talker, code2wav], ranks: [0]}
"""
# the talker sharded too: its leader draws the frames (codebook 0 from its whole head, the code
# predictor's codebooks), both ranks run its decoder
TP_BOTH = """
node_groups:
  - {node_names: [thinker], ranks: [0, 1], tensor_parallel: 2}
  - {node_names: [talker], ranks: [2, 3], tensor_parallel: 2}
  - {node_names: [audio_encoder, vision_encoder, code2wav], ranks: [0]}
"""


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_random_checkpoint(
        get_qwen3_omni_config(CONFIG), tmp_path_factory.mktemp("qwen3_omni_tp") / "tiny", seed=0
    )


async def _answers(
    checkpoint: Path, placement: Placement | None
) -> list[tuple[list[int], torch.Tensor, torch.Tensor]]:
    model = Qwen3OmniModel(CONFIG, checkpoint=str(checkpoint), colocated=True, codec_batch_size=1)
    async with await AsyncEngine.start(model, placement, EngineConfig(cpu_threads=1)) as engine:
        results = []
        for data in REQUESTS:  # one at a time: the same steps on either placement
            out = await engine.run(
                Request("generate", {"max_audio_frames": 40, **data, "return_codes": True})
            )
            results.append(split(out))
        if placement is not None:  # the followers ran the steps on their shards
            stats = await engine.stats()
            assert stats[1]["thinker"]["steps"] > 10
            assert "talker" not in stats.get(3, {}) or stats[3]["talker"]["steps"] > 10
    return results


@pytest.fixture(scope="module")
def one_rank(checkpoint: Path) -> list[tuple[list[int], torch.Tensor, torch.Tensor]]:
    return asyncio.run(_answers(checkpoint, None))


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout", [TP_THINKER, TP_BOTH], ids=["thinker", "thinker-and-talker"])
async def test_sharded_decoders_answer_and_speak_as_one_rank(
    checkpoint: Path, one_rank: list[tuple[list[int], torch.Tensor, torch.Tensor]], layout: str
) -> None:
    want = one_rank
    got = await _answers(checkpoint, Placement.from_yaml(layout))
    for (text, codes, audio), (want_text, want_codes, want_audio) in zip(got, want, strict=True):
        assert text == want_text and len(text) > 0
        assert torch.equal(codes, want_codes) and codes.shape[1] > 0
        torch.testing.assert_close(audio, want_audio, rtol=0, atol=1e-4)


def test_each_rank_reads_its_share_of_every_expert(checkpoint: Path) -> None:
    config = get_qwen3_omni_config(CONFIG)
    whole = load_qwen3_omni(checkpoint, config, nodes=["thinker"]).thinker_text
    with sharded(TensorShard(1, 2)):
        shard = load_qwen3_omni(checkpoint, config, nodes=["thinker"]).thinker_text
    mlp, full = shard.model.layers[0].mlp, whole.model.layers[0].mlp
    inner = full.experts.down_proj.shape[2]
    half = inner // 2
    # rank 1: the second half of each expert's gate rows, then of its up rows; down's columns
    torch.testing.assert_close(
        mlp.experts.gate_up_proj,
        torch.cat(
            [
                full.experts.gate_up_proj[:, half:inner],
                full.experts.gate_up_proj[:, inner + half :],
            ],
            dim=1,
        ),
    )
    torch.testing.assert_close(mlp.experts.down_proj, full.experts.down_proj[:, :, half:])
    torch.testing.assert_close(mlp.gate.weight, full.gate.weight)  # the router stays whole
    assert shard.embedding.weight.shape == whole.embedding.weight.shape  # the embedding too
    assert shard.head.weight.shape[0] == config.thinker_text.vocab_size // 2
    assert shard.kv_cache_spec.num_kv_heads == whole.kv_cache_spec.num_kv_heads // 2
