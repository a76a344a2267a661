"""A Llama node sharded over two ranks (``tensor_parallel: 2``) through the runtime: in one
process and in worker processes it answers what one rank answers; a rank that dies fails the
group's requests and the group comes back as a unit; layouts that cannot shard are refused."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import transformers

from mstar.engines.native import cpu_kernels
from mstar.errors import PlacementError, WorkerUnavailableError
from mstar.runtime import AsyncEngine, EngineConfig, ModelSpec, Placement, Request
from mstar.zoo import resolve_model

pytestmark = pytest.mark.skipif(cpu_kernels() is None, reason="needs the native kernels")

TP2 = "node_groups:\n  - {node_names: [llm], ranks: [0, 1], tensor_parallel: 2}\n"
PROMPTS = [[1, 5, 9, 22, 40], [1, 7], [1, 60, 61, 62, 63, 64, 65, 66, 67, 68, 69], [2, 3, 4]]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=97,  # odd: the second rank's vocabulary rows are padded
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=True,
    )
    path = tmp_path_factory.mktemp("tiny-llama-tp")
    transformers.LlamaForCausalLM(config).save_pretrained(path, safe_serialization=True)
    return path


def _spec(checkpoint: Path) -> ModelSpec:
    engine_config = {"num_blocks": 64, "block_size": 8}
    return ModelSpec(
        "mstar.zoo.llm:TextLLM", {"checkpoint": str(checkpoint), "engine_config": engine_config}
    )


def _request(prompt: list[int], **extra: Any) -> Request:
    data = {"prompt_token_ids": prompt, "max_tokens": 16, "ignore_eos": True, "temperature": 0.0}
    return Request("generate", {**data, **extra})


async def _tokens(engine: AsyncEngine, requests: list[Request]) -> list[list[int]]:
    results = await asyncio.gather(*(engine.run(r) for r in requests))
    return [[int(o.data) for o in outs] for outs in results]


def _requests() -> list[Request]:
    greedy = [_request(p) for p in PROMPTS]
    return [*greedy, _request(PROMPTS[0], temperature=1.0, top_p=0.9, seed=3)]


@pytest.fixture(scope="module")
def expected(checkpoint: Path) -> list[list[int]]:
    async def serve() -> list[list[int]]:
        async with await AsyncEngine.start(_spec(checkpoint)) as engine:
            return await _tokens(engine, _requests())

    return asyncio.run(serve())


@pytest.mark.timeout(300)
@pytest.mark.parametrize("processes", [False, True], ids=["in-process", "worker-processes"])
async def test_two_ranks_answer_what_one_answers(
    checkpoint: Path, expected: list[list[int]], processes: bool
) -> None:
    config = EngineConfig(worker_processes=processes, cpu_threads=1)
    async with await AsyncEngine.start(
        _spec(checkpoint), Placement.from_yaml(TP2), config
    ) as engine:
        assert await _tokens(engine, _requests()) == expected
        # one at a time, then all at once again: the cache and both shards stay in step
        for request, want in zip(_requests(), expected, strict=True):
            assert await _tokens(engine, [request]) == [want]
        assert await _tokens(engine, _requests()) == expected


TWO_REPLICAS = "node_groups:\n  - {node_names: [llm], ranks: [0, 1, 2, 3], tensor_parallel: 2}\n"


@pytest.mark.slow
@pytest.mark.timeout(300)
async def test_a_dead_rank_fails_its_groups_requests_and_the_group_restarts(
    checkpoint: Path, expected: list[list[int]]
) -> None:
    """Two sharded replicas (ranks 0 + 1 and 2 + 3): rank 1 killed mid-request fails the request
    its group serves, the other replica's goes on; both ranks of the group come back."""
    config = EngineConfig(worker_processes=True, cpu_threads=1)
    async with await AsyncEngine.start(
        _spec(checkpoint), Placement.from_yaml(TWO_REPLICAS), config
    ) as engine:
        alone = await _tokens(engine, [_request(PROMPTS[0], max_tokens=120)])
        running = [
            asyncio.ensure_future(engine.run(_request(PROMPTS[0], max_tokens=120)))
            for _ in range(2)
        ]
        leader, follower = engine.processes[0], engine.processes[1]
        assert leader.pid is not None and follower.pid is not None
        while True:  # one request on each replica
            held = await engine.held_state()
            if all(held[f"rank{r}"]["runners"] > 0 for r in (0, 2)):
                break
            await asyncio.sleep(0.01)
        os.kill(follower.pid, signal.SIGKILL)
        done = await asyncio.gather(*running, return_exceptions=True)
        failed = [r for r in done if isinstance(r, BaseException)]
        assert len(failed) == 1 and isinstance(failed[0], WorkerUnavailableError), done
        served = [r for r in done if not isinstance(r, BaseException)]
        assert [[int(o.data) for o in served[0]]] == alone
        # Both ranks of the group restart (the leader's shard cannot go on without the other).
        async with asyncio.timeout(120):
            while engine.num_restarts < 2 or not all(engine.ranks.up().values()):
                await asyncio.sleep(0.05)
        assert engine.processes[0].pid != leader.pid and engine.processes[1].pid != follower.pid
        assert engine.processes[2].pid is not None
        assert await _tokens(engine, _requests()) == expected


async def test_layouts_that_cannot_shard_are_refused(checkpoint: Path) -> None:
    three = "node_groups:\n  - {node_names: [llm], ranks: [0, 1, 2], tensor_parallel: 3}\n"
    with pytest.raises(PlacementError, match=r"node_groups\[0\]: 4 query heads over 2 KV heads"):
        await AsyncEngine.start(_spec(checkpoint), Placement.from_yaml(three))
    cuda = EngineConfig(devices={0: "cuda:0", 1: "cuda:1"})  # NCCL: a process per rank
    with pytest.raises(PlacementError, match="over CUDA ranks takes a process per rank"):
        await AsyncEngine.start(_spec(checkpoint), Placement.from_yaml(TP2), cuda)
    odd = "node_groups:\n  - {node_names: [llm], ranks: [0, 1, 2], tensor_parallel: 2}\n"
    with pytest.raises(PlacementError, match="tensor_parallel 2 needs a multiple of 2 ranks"):
        await AsyncEngine.start(_spec(checkpoint), Placement.from_yaml(odd))


@pytest.mark.timeout(300)
async def test_a_sharded_speech_lm_beside_an_unsharded_codec_speaks_the_same_audio() -> None:
    """Orpheus: its LM sharded over two ranks (constrained audio-code logits gathered over
    them), SNAC whole on the first: the audio of seeded sampled requests, batched, as on one
    rank."""
    sharded_lm = (
        "node_groups:\n  - {node_names: [LLM], ranks: [0, 1], tensor_parallel: 2}\n"
        "  - {node_names: [snac_decoder], ranks: [0]}\n"
    )
    texts = ["hello there", "a b c", "tensor parallel"]

    async def speak(placement: Placement | None) -> list[np.ndarray]:
        async with await AsyncEngine.start(
            resolve_model("orpheus-tiny"), placement, EngineConfig(cpu_threads=1)
        ) as engine:
            requests = [
                Request("speech", {"text": t, "max_tokens": 56, "seed": i, "ignore_eos": True})
                for i, t in enumerate(texts)
            ]
            outs = await asyncio.gather(*(engine.run(r) for r in requests))
        return [
            np.concatenate([np.asarray(o.data) for o in out if o.modality == "audio"])
            for out in outs
        ]

    for got, want in zip(
        await speak(Placement.from_yaml(sharded_lm)), await speak(None), strict=True
    ):
        assert got.shape == want.shape and got.size > 0
        np.testing.assert_allclose(got, want, atol=1e-5)
