"""Forward-fired KV nodes: several sequences per request, resets, forks at a mark, read-only
queries, and several KV nodes of different geometries sharing one rank's memory budget."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

import pytest
import torch

from mstar.engines import AttentionMask, KVCacheEngineConfig, SamplingParams
from mstar.engines.interfaces import (
    FiringRows,
    KVChunk,
    KVForward,
    KVTurn,
    supports_forward_walks,
    supports_token_walks,
)
from mstar.engines.kv_cache import KVCacheSpec
from mstar.engines.kv_node import KVNodeEngine
from mstar.errors import KVCacheCapacityError
from mstar.runtime.worker_core import WorkerConfig, kv_cache_budgets
from mstar.zoo.llama import LlamaCausalLM

from .conftest import make_tiny_llama


class ChunkNode:
    """A forward node whose firing inputs are its chunks; it returns each chunk's rows."""

    forward_walks = True

    def __init__(self, model: LlamaCausalLM, num_blocks: int = 64) -> None:
        self.model = model
        self.engine_config = KVCacheEngineConfig(block_size=4, num_blocks=num_blocks)
        self.released: list[str] = []

    def forward(self, request_id: str, inputs: Mapping[str, Any]) -> KVForward:
        return KVForward(list(inputs["chunks"]))

    def forward_outputs(self, firings: list[FiringRows]) -> list[Mapping[str, Any] | BaseException]:
        return [{"rows": f.rows} for f in firings]

    def release(self, request_id: str) -> None:
        self.released.append(request_id)


def dense_rows(model: LlamaCausalLM, tokens: list[int], num_new: int) -> torch.Tensor:
    """The model's rows of the last ``num_new`` tokens, recomputed from scratch (causal)."""
    engine_node = ChunkNode(model)
    engine = KVNodeEngine("ref", engine_node, None, "cpu")
    eng = engine.engine
    eng.add_request("x", tokens, output_mode="hidden")
    out = [o for o in eng.step() if o.hidden is not None]
    return out[0].hidden[-num_new:]


@pytest.fixture(scope="module")
def model() -> LlamaCausalLM:
    return make_tiny_llama()


async def fire(engine: KVNodeEngine, rid: str, *chunks: KVChunk) -> list[torch.Tensor | None]:
    out = await engine.submit(rid, {"chunks": chunks}, "w")
    return list(out["rows"])


async def test_reset_rebuilds_a_sequence_each_firing(model: LlamaCausalLM) -> None:
    """A per-request, per-walk cache reset (Qwen3-Omni's code predictor): the second firing
    sees none of the first's tokens, and the dropped blocks come back."""
    engine = KVNodeEngine("n", ChunkNode(model), None, "cpu")
    engine.start()
    try:
        await fire(engine, "r", KVChunk(token_ids=[5, 6, 7, 8, 9]))
        assert engine.stats()["kv_blocks_used"] == 2
        kept = (await fire(engine, "r", KVChunk(token_ids=[1, 2])))[0]
        reset = (await fire(engine, "r", KVChunk(token_ids=[1, 2], reset=True)))[0]
        assert reset is not None and kept is not None
        torch.testing.assert_close(reset, dense_rows(model, [1, 2], 2))
        torch.testing.assert_close(kept, dense_rows(model, [5, 6, 7, 8, 9, 1, 2], 2))
        assert engine.stats()["kv_blocks_used"] == 1
    finally:
        await engine.aclose()


async def test_branches_fork_at_a_mark_and_queries_write_nothing(model: LlamaCausalLM) -> None:
    """CFG-style: a context, a branch forked before its last segment, and read-only queries over
    both in one step; the queries see their context and each other, and leave no trace."""
    engine = KVNodeEngine("n", ChunkNode(model), None, "cpu")
    engine.start()
    try:
        context, latest = [3, 1, 4, 1, 5, 9], [2, 6, 5]
        await fire(engine, "r", KVChunk(token_ids=context, output="none"))
        await fire(engine, "r", KVChunk(token_ids=latest, output="none"))
        used = engine.stats()["kv_blocks_used"]
        query = [7, 7, 8]
        full, no_text = await fire(
            engine,
            "r",
            KVChunk(token_ids=query, read_only=True),
            KVChunk(
                seq="uncond",
                token_ids=query,
                read_only=True,
                fork_from="",
                fork_tokens=len(context),
            ),
        )
        assert full is not None and no_text is not None
        torch.testing.assert_close(full, dense_rows(model, context + latest + query, 3))
        torch.testing.assert_close(no_text, dense_rows(model, context + query, 3))
        assert engine.num_requests == 2  # the context and its branch; the queries are gone
        assert engine.stats()["steps"] >= 3
        assert engine.stats()["kv_blocks_used"] >= used  # queries hold nothing after their step
        again = (await fire(engine, "r", KVChunk(token_ids=query, read_only=True)))[0]
        torch.testing.assert_close(again, full)  # the first query wrote nothing
    finally:
        await engine.aclose()


async def test_fork_chunks_continue_from_the_mark(model: LlamaCausalLM) -> None:
    """A sequence forked at a mark and extended equals the prefix plus its own tokens."""
    engine = KVNodeEngine("n", ChunkNode(model), None, "cpu")
    engine.start()
    try:
        await fire(engine, "r", KVChunk(token_ids=[3, 1, 4, 1, 5, 9, 2, 6], output="none"))
        main, branch = await fire(
            engine,
            "r",
            KVChunk(token_ids=[8, 8], mask=AttentionMask.full()),
            KVChunk(seq="b", token_ids=[7], fork_from="", fork_tokens=5),
        )
        assert main is not None and branch is not None
        torch.testing.assert_close(branch, dense_rows(model, [3, 1, 4, 1, 5, 7], 1))
        engine.release("r")
        await asyncio.sleep(0)
        assert "r" in engine.kv_node.released  # type: ignore[attr-defined]
    finally:
        await engine.aclose()


async def test_chunks_of_one_sequence_run_in_order(model: LlamaCausalLM) -> None:
    """A context of parts with masks of their own, built in one firing (a CFG branch rebuilt on
    another rank): the parts run in order and the sequence's rows come under its last chunk."""
    engine = KVNodeEngine("n", ChunkNode(model), None, "cpu")
    engine.start()
    try:
        full = AttentionMask.full()
        rows = await fire(
            engine,
            "r",
            KVChunk(seq="b", token_ids=[3, 1, 4], output="none", reset=True),
            KVChunk(seq="b", token_ids=[1, 5], mask=full, output="none"),
            KVChunk(seq="b", token_ids=[9, 2]),
        )
        assert rows[:2] == [None, None] and rows[2] is not None
        ref = ChunkNode(model)
        dense = KVNodeEngine("ref", ref, None, "cpu").engine
        dense.add_request("x", [3, 1, 4], output_mode="none", keep_alive=True)
        dense.step()
        dense.resume("x", [1, 5], mask=full, output_mode="none")
        dense.step()
        dense.resume("x", [9, 2], output_mode="hidden")
        want = next(o.hidden for o in dense.step() if o.hidden is not None)
        torch.testing.assert_close(rows[2], want)
        with pytest.raises(ValueError, match="cannot reset"):
            await fire(
                engine,
                "r",
                KVChunk(seq="c", token_ids=[1]),
                KVChunk(seq="c", token_ids=[2], reset=True),
            )
    finally:
        await engine.aclose()


async def test_truncate_rolls_a_sequence_back_to_a_mark(model: LlamaCausalLM) -> None:
    """Tokens past a mark are dropped and the next inputs follow the mark."""
    engine = KVNodeEngine("n", ChunkNode(model), None, "cpu")
    engine.start()
    try:
        await fire(engine, "r", KVChunk(token_ids=[3, 1, 4, 1, 5], output="none"))
        await fire(engine, "r", KVChunk(token_ids=[9, 9, 9], output="none"))
        rows = (await fire(engine, "r", KVChunk(token_ids=[2, 6], truncate=5)))[0]
        torch.testing.assert_close(rows, dense_rows(model, [3, 1, 4, 1, 5, 2, 6], 2))
    finally:
        await engine.aclose()


def test_forward_nodes_declare_themselves(model: LlamaCausalLM) -> None:
    node = ChunkNode(model)
    assert supports_forward_walks(node) and not supports_token_walks(node)
    assert not KVNodeEngine("n", node, None, "cpu").has_native_loop


def test_kv_budgets_split_a_rank_by_share() -> None:
    cpu = torch.device("cpu")
    config = WorkerConfig(kv_cache_memory=1000, kv_cache_shares={"thinker": 0.5})
    assert kv_cache_budgets(["thinker", "talker", "code"], config, cpu) == {
        "thinker": 500,
        "talker": 250,
        "code": 250,
    }
    assert kv_cache_budgets(["a"], WorkerConfig(), cpu) == {"a": None}  # a lone node sizes itself
    two = kv_cache_budgets(["a", "b"], WorkerConfig(), cpu)  # several split the device default
    assert two["a"] == two["b"] and two["a"] is not None and two["a"] <= (1 << 29)
    with pytest.raises(KVCacheCapacityError, match=r"add up to 1\.2"):
        kv_cache_budgets(
            ["a", "b"],
            WorkerConfig(kv_cache_memory=1000, kv_cache_shares={"a": 0.6, "b": 0.6}),
            cpu,
        )
    with pytest.raises(KVCacheCapacityError, match="not KV-cache nodes"):
        kv_cache_budgets(["a"], WorkerConfig(kv_cache_shares={"codec": 0.5}), cpu)
    with pytest.raises(KVCacheCapacityError, match=r"must be in \(0, 1\]"):
        kv_cache_budgets(["a"], WorkerConfig(kv_cache_shares={"a": 0.0}), cpu)


async def test_kv_nodes_of_different_geometries_share_a_budget() -> None:
    """Two KV nodes (different layers, heads, dtype, block size) each get their share's blocks;
    a share too small for one block is a clear error naming the node."""
    big = make_tiny_llama(num_layers=3, hidden_size=64, num_heads=8, num_kv_heads=4)
    small = make_tiny_llama(num_layers=1, dtype=torch.float64)
    budget = 200_000
    config = WorkerConfig(kv_cache_memory=budget, kv_cache_shares={"big": 0.6})
    budgets = kv_cache_budgets(["big", "small"], config, torch.device("cpu"))
    nodes = {"big": ChunkNode(big), "small": ChunkNode(small)}
    for node in nodes.values():
        node.engine_config = KVCacheEngineConfig(block_size=8)
    engines = {
        name: KVNodeEngine(name, node, None, "cpu", kv_cache_memory=budgets[name])
        for name, node in nodes.items()
    }
    for name, engine in engines.items():
        spec: KVCacheSpec = nodes[name].model.kv_cache_spec
        assert engine.engine.num_blocks == budgets[name] // spec.bytes_per_block(8) - 1
    assert engines["big"].engine.num_blocks != engines["small"].engine.num_blocks
    starved = ChunkNode(big)
    starved.engine_config = KVCacheEngineConfig(block_size=8)
    with pytest.raises(KVCacheCapacityError, match="holds no block"):
        KVNodeEngine("tiny", starved, None, "cpu", kv_cache_memory=100)


async def test_firings_answered_together_fire_together_again(model: LlamaCausalLM) -> None:
    """Requests a step answered share the next step, whether their walk fires again at once or
    a few loop turns later (a new walk started through the conductor): one step per round."""
    from mstar.engines.step_loop import StepExecutor

    executor = StepExecutor()  # the step thread workers run
    engine = KVNodeEngine("n", ChunkNode(model), executor, "cpu")
    engine.start()
    rounds = 8

    async def walk(rid: str, hops: int) -> None:
        for _ in range(rounds):
            for _ in range(hops):  # the conductor's turns between this request's walks
                await asyncio.sleep(0)
            await fire(engine, rid, KVChunk(token_ids=[3]))

    try:
        await asyncio.gather(walk("looping", 0), walk("via-conductor", 4))
        stats = engine.stats()
        assert stats["batched"] == 2 * rounds
        assert stats["steps"] <= rounds + 1  # the first round may split: nothing was answered yet
    finally:
        await engine.aclose()
        executor.shutdown()


class PromptThenAnswer(ChunkNode):
    """Forward firings append a prompt; a token walk then answers, asking for its inputs' rows."""

    token_walks = True

    def __init__(self, model: LlamaCausalLM) -> None:
        super().__init__(model)
        self.engine_config = KVCacheEngineConfig(
            block_size=4, num_blocks=64, max_num_batched_tokens=3
        )
        self.calls: list[tuple[int, bool, Any]] = []

    def turn(self, request_id: str, inputs: Mapping[str, Any], *, is_first: bool) -> KVTurn:
        return KVTurn(list(inputs["tail"]), SamplingParams.greedy(4), return_rows=inputs["rows"])

    def outputs(
        self, request_id: str, token_id: int, history: list[int] | None, **extra: Any
    ) -> Mapping[str, Any]:
        self.calls.append((token_id, history is not None, extra.get("rows")))
        return {"token": token_id, "stop": history is not None}


async def test_a_token_walk_hands_its_inputs_rows_to_its_first_token(model: LlamaCausalLM) -> None:
    """After a forward-fired prefix, a token walk's new tokens (more than a step's token
    budget, yet computed in one chunk) come back as rows with the first sampled token only;
    the answer equals a plain walk's."""
    head, tail = [5, 6, 7, 8, 9], [10, 11, 12, 13, 14, 15, 16]
    node = PromptThenAnswer(model)
    engine = KVNodeEngine("llm", node, None, "cpu")
    engine.start()
    try:
        await engine.submit("r", {"chunks": [KVChunk(token_ids=head, output="none")]})
        tokens: list[int] = []
        await engine.run(
            "r", {"tail": tail, "rows": True}, None, lambda out: tokens.append(out["token"])
        )
        plain = PromptThenAnswer(model)
        other = KVNodeEngine("plain", plain, None, "cpu")
        other.start()
        try:
            want: list[int] = []
            await other.run(
                "p",
                {"tail": head + tail, "rows": False},
                None,
                lambda out: want.append(out["token"]),
            )
        finally:
            await other.aclose()
    finally:
        await engine.aclose()
    assert tokens == want and len(tokens) == 4
    rows = [r for _, _, r in node.calls]
    assert rows[0] is not None and all(r is None for r in rows[1:])
    torch.testing.assert_close(
        rows[0], dense_rows(model, head + tail, len(tail)), rtol=1e-5, atol=1e-5
    )
    assert [last for _, last, _ in node.calls] == [False, False, False, True]
    assert all(r is None for _, _, r in plain.calls)
