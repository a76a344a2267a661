"""Tensor parallelism: the shared-memory group's collectives, and a Llama sharded over two ranks
(the leader's engine and a follower thread) against the same model unsharded."""

from __future__ import annotations

import multiprocessing
import os
import secrets
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from mstar.engines import KVCacheEngine, KVCacheEngineConfig, SamplingParams
from mstar.engines.native import cpu_kernels
from mstar.engines.parallel import (
    ShmGroup,
    TensorParallelError,
    TensorParallelFollower,
    TensorParallelRankLostError,
    TensorShard,
    sharded,
)
from mstar.zoo.hf_checkpoint import load_hf_config, load_into_module, save_state_dict
from mstar.zoo.llama import LlamaCausalLM, LlamaConfig, load_llama
from tests.engines.conftest import make_tiny_llama

pytestmark = pytest.mark.skipif(cpu_kernels() is None, reason="needs the native kernels")


@pytest.fixture
def shm_path() -> Iterator[Path]:
    path = Path("/dev/shm") / f"mstar-test-tp-{secrets.token_hex(6)}"
    yield path
    path.unlink(missing_ok=True)


def _on_ranks(world: int, path: Path, fn: Callable[[ShmGroup], Any], **kw: Any) -> list[Any]:
    """Run ``fn(group)`` on ``world`` threads, one rank each; return each rank's result."""
    results: list[Any] = [None] * world
    errors: list[BaseException] = []

    def run(rank: int) -> None:
        try:
            results[rank] = fn(ShmGroup(path, rank, world, **kw))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    if errors:
        raise errors[0]
    return results


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64, torch.float16])
@pytest.mark.parametrize("world", [2, 3])
def test_all_reduce_sums_in_rank_order_on_every_rank(
    shm_path: Path, dtype: torch.dtype, world: int
) -> None:
    # 1,000 floats through 1 KiB slots: several rounds per call, and calls back to back.
    parts = [torch.randn(10, 100, generator=torch.Generator().manual_seed(r)) for r in range(world)]

    def fn(group: ShmGroup) -> list[torch.Tensor]:
        out = []
        for i in range(5):
            x = (parts[group.rank] * (i + 1)).to(dtype)
            group.all_reduce_(x)
            out.append(x)
        return out

    results = _on_ranks(world, shm_path, fn, slot_bytes=1024)
    for i in range(5):
        acc = torch.float64 if dtype == torch.float64 else torch.float32  # halves: in float32
        expected = sum((p * (i + 1)).to(dtype).to(acc) for p in parts).to(dtype)
        for rank in range(world):
            assert torch.equal(results[rank][i], expected)  # the same bits everywhere


def test_all_gather_and_commands(shm_path: Path) -> None:
    big = bytes(range(256)) * 1000  # 256 kB through a 4 kB command area: many parts

    def fn(group: ShmGroup) -> tuple[torch.Tensor, list[bytes]]:
        gathered = group.all_gather(torch.full((3, 2), float(group.rank)))
        if group.rank == 0:
            for message in (b"one", big, b""):
                group.send(message)
            return gathered, []
        return gathered, [group.receive() for _ in range(3)]

    results = _on_ranks(2, shm_path, fn, command_bytes=4096, slot_bytes=64)
    for gathered, _ in results:
        assert torch.equal(gathered, torch.stack([torch.zeros(3, 2), torch.ones(3, 2)]))
    assert results[1][1] == [b"one", big, b""]


def test_a_stopped_group_fails_the_waits_of_every_rank(shm_path: Path) -> None:
    leader = ShmGroup(shm_path, 0, 2)
    follower = ShmGroup(shm_path, 1, 2)
    failure: list[BaseException] = []

    def wait() -> None:
        try:
            follower.receive()
        except TensorParallelError as exc:
            failure.append(exc)

    waiter = threading.Thread(target=wait)
    waiter.start()
    leader.close()
    waiter.join(30)
    assert not waiter.is_alive()
    assert "stopped" in str(failure[0])
    assert not isinstance(failure[0], TensorParallelRankLostError)  # no rank is gone
    assert follower.rank_lost(failure[0]) is None
    with pytest.raises(TensorParallelError, match="stopped"):
        follower.all_reduce_(torch.ones(4))


def _join_and_die(path: str) -> None:
    group = ShmGroup(path, 1, 2)
    group.all_reduce_(torch.ones(4))  # one round with the leader, then exit mid-protocol


def test_a_rank_whose_process_died_fails_the_collective(shm_path: Path) -> None:
    leader = ShmGroup(shm_path, 0, 2, ranks=(4, 7), timeout_s=120)
    child = multiprocessing.get_context("spawn").Process(
        target=_join_and_die, args=(str(shm_path),)
    )
    child.start()
    x = torch.ones(4)
    leader.all_reduce_(x)
    assert torch.equal(x, torch.full((4,), 2.0))
    child.join(60)
    with pytest.raises(TensorParallelRankLostError, match=r"rank 1 .* is gone") as lost:
        leader.all_reduce_(torch.ones(4))
    assert lost.value.rank == 7  # the worker rank of the group's rank 1
    # What a native call that sums over the group itself (a decode step) raised, as the loss.
    gone = "ShmGroup: rank 1 (pid 1) is gone"
    again = leader.rank_lost(RuntimeError(gone + "\nException raised from check_alive"))
    assert again is not None and again.rank == 7 and str(again) == gone


# -- a sharded Llama ---------------------------------------------------------------------------


@pytest.fixture(
    scope="module", params=[(4, 2, 32), (4, 1, 32), (6, 3, 96)], ids=["kv2", "kv1", "kv3"]
)
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama checkpoint: two KV heads split evenly; one kept by both ranks (replicated);
    three split 2 + 1 with their query heads (as SmolLM2-135M's)."""
    heads, kv_heads, hidden = request.param
    model = make_tiny_llama(
        vocab_size=67,  # 67: the second rank's rows are padded
        hidden_size=hidden,
        num_heads=heads,
        num_kv_heads=kv_heads,
        num_layers=3,
    )
    directory = tmp_path_factory.mktemp(f"tiny-llama-kv{kv_heads}")
    state = {k: v for k, v in model.state_dict().items() if "rope" not in k}
    config = {
        "model_type": "llama",
        "vocab_size": 67,
        "hidden_size": hidden,
        "intermediate_size": 2 * hidden,
        "num_hidden_layers": 3,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "max_position_embeddings": 256,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
    }
    save_state_dict(state, directory, config)
    return directory


PROMPTS = [[(7 * i + 3 * j) % 67 for j in range(4 + 3 * i)] for i in range(5)]


def _run(
    engine: KVCacheEngine, params: SamplingParams, prompts: list[list[int]] = PROMPTS
) -> tuple[dict[str, list[int]], dict[str, list[torch.Tensor]]]:
    tokens: dict[str, list[int]] = {}
    logits: dict[str, list[torch.Tensor]] = {}
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
    while engine.has_unfinished():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.logits is not None:
                logits.setdefault(out.request_id, []).append(out.logits)
    return tokens, logits


def _tp_engine(
    checkpoint: Path, shm_path: Path, config: KVCacheEngineConfig, *, native: bool = True
) -> tuple[KVCacheEngine, TensorParallelFollower]:
    """The leader's engine over rank 0's shard, and a follower thread serving rank 1's."""
    groups = [ShmGroup(shm_path, r, 2) for r in range(2)]
    models: list[LlamaCausalLM] = []
    for rank, group in enumerate(groups):
        with sharded(TensorShard(rank, 2, group)):
            models.append(load_llama(checkpoint))
    if not native:
        for model in models:
            model._native_stack = False  # the layer-by-layer torch path
    follower = TensorParallelFollower("llm", models[1], groups[1], "cpu")
    follower.start()
    return KVCacheEngine(models[0], config, tensor_parallel=groups[0]), follower


@pytest.mark.parametrize("native", [True, False], ids=["native-decode", "torch-layers"])
def test_two_ranks_equal_one_greedy_and_logits(
    checkpoint: Path, shm_path: Path, native: bool
) -> None:
    config = KVCacheEngineConfig(num_blocks=64, block_size=4, max_num_batched_tokens=16)
    reference = KVCacheEngine(load_llama(checkpoint), config)
    if not native:
        reference.runner.model._native_stack = False  # type: ignore[attr-defined]
    reference.return_logits = True
    want_tokens, want_logits = _run(reference, SamplingParams.greedy(12))
    engine, follower = _tp_engine(checkpoint, shm_path, config, native=native)
    try:
        engine.return_logits = True
        tokens, logits = _run(engine, SamplingParams.greedy(12))
        assert tokens == want_tokens
        for key in want_logits:
            for got, want in zip(logits[key], want_logits[key], strict=True):
                # float32 sums in another order (each rank's half, then the two): 1e-5 of the
                # logits' scale (this peaky random model's reach tens)
                scale = want.abs().max().item()
                assert (got - want).abs().max().item() <= 1e-5 * scale, scale
        # The greedy head without logits: each rank's best, compared over the group.
        engine.return_logits = False
        assert _run(engine, SamplingParams.greedy(12))[0] == want_tokens
    finally:
        engine.runner.tensor_parallel.stop()  # type: ignore[union-attr]
        follower.close()
    assert follower.error is None


def test_two_ranks_under_preemption_prefix_hits_and_sampling(
    checkpoint: Path, shm_path: Path
) -> None:
    # 20 blocks of 4 for five prompts of up to 16 tokens and 20 new ones: preemption and
    # recompute; the shared prefix hits the cache.
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12, *p] for p in PROMPTS]
    config = KVCacheEngineConfig(num_blocks=20, block_size=4, max_num_batched_tokens=12)
    params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=20, seed=7)
    want, _ = _run(KVCacheEngine(load_llama(checkpoint), config), params, prompts)
    engine, follower = _tp_engine(checkpoint, shm_path, config)
    try:
        got, _ = _run(engine, params, prompts)
        assert engine.block_manager.prefix_hit_tokens > 0
        assert engine.scheduler.num_preemptions > 0
    finally:
        engine.runner.tensor_parallel.stop()  # type: ignore[union-attr]
        follower.close()
    assert got == want
    assert follower.error is None


def _unfused(checkpoint: Path, shard: TensorShard | None) -> LlamaCausalLM:
    config = LlamaConfig.from_hf(load_hf_config(checkpoint))
    with torch.device("meta"):
        model = LlamaCausalLM(config)
    slices = None
    if shard is not None:
        slices = model.shard_slices(shard)
        model.shard_(shard)
    model = model.to_empty(device="cpu")
    load_into_module(model, checkpoint, slices=slices)
    return model


def test_each_rank_reads_its_slices_of_the_checkpoint(checkpoint: Path) -> None:
    full = _unfused(checkpoint, None)
    shard = _unfused(checkpoint, TensorShard(1, 2))
    attn = shard.decoder_layers[0].self_attn
    heads, kv_heads = full.config.num_attention_heads, full.config.num_key_value_heads
    # rank 1's: the second half of the KV heads (or the only one) with their query heads
    assert (attn.num_heads, attn.num_kv_heads) == {(4, 2): (2, 1), (4, 1): (2, 1), (6, 3): (4, 2)}[
        (heads, kv_heads)
    ]
    # The loader's slices are the in-memory split's, tensor by tensor.
    full.shard_(TensorShard(1, 2))
    expected = full.state_dict()
    for name, tensor in shard.state_dict().items():
        assert torch.equal(tensor, expected[name]), name
    # ids 34..66 on rank 1; its 34th row is padding
    head = shard.lm_head.weight  # type: ignore[union-attr]
    hidden = full.config.hidden_size
    assert head.shape == (34, hidden) and not head[33].any()
    assert shard.decoder_layers[0].mlp.down_proj.weight.shape == (hidden, hidden)


def test_a_layout_that_cannot_split_is_refused(tmp_path: Path) -> None:
    model = make_tiny_llama(num_heads=4, num_kv_heads=2)
    with pytest.raises(TensorParallelError, match="4 query heads over 2 KV heads cannot be split"):
        model.shard_(TensorShard(0, 3))


def test_a_step_that_fails_on_the_leader_fails_the_group_not_silently(
    checkpoint: Path, shm_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A leader's step that raises closes the group (the ranks may be out of step): the step's
    requests fail, the follower ends and reports the failure (a worker process exits then)."""
    failures: list[BaseException] = []
    groups = [ShmGroup(shm_path, r, 2) for r in range(2)]
    models = []
    for rank, group in enumerate(groups):
        with sharded(TensorShard(rank, 2, group)):
            models.append(load_llama(checkpoint))
    follower = TensorParallelFollower(
        "llm", models[1], groups[1], "cpu", on_failure=failures.append
    )
    follower.start()
    engine = KVCacheEngine(
        models[0], KVCacheEngineConfig(num_blocks=32, block_size=4), tensor_parallel=groups[0]
    )
    engine.add_request("ok", PROMPTS[1], SamplingParams.greedy(3))
    assert len(_run(engine, SamplingParams.greedy(3), [PROMPTS[0]])[0]["r0"]) == 3

    def broken(*args: object) -> torch.Tensor:
        raise RuntimeError("a fault in the leader's forward pass")

    monkeypatch.setattr(models[0], "forward", broken)
    engine.add_request("bad", PROMPTS[2], SamplingParams.greedy(3))
    with pytest.raises(RuntimeError, match="fault in the leader"):
        engine.step()
    follower._thread.join(30)  # type: ignore[union-attr]
    assert not follower.is_running and len(failures) == 1
    assert "stopped" in str(failures[0])


def _follow_then_die_in_decode(path: str, checkpoint: str) -> None:
    """Rank 1 of a group: follows the leader's steps, and its process exits inside its second
    step, the first decode step (the step's command taken, its sums not reached)."""
    group = ShmGroup(path, 1, 2)
    with sharded(TensorShard(1, 2, group)):
        model = load_llama(Path(checkpoint))
    forward = model.forward
    steps: list[int] = []

    def dying(input_ids: torch.Tensor, positions: torch.Tensor, ctx: Any) -> torch.Tensor:
        steps.append(input_ids.shape[0])
        if len(steps) == 2:  # the prompt's step, then the first decode step's
            os._exit(0)
        return forward(input_ids, positions, ctx)

    model.forward = dying  # type: ignore[method-assign]
    follower = TensorParallelFollower("llm", model, group, "cpu")
    follower.start()
    follower._thread.join()  # type: ignore[union-attr]


def test_a_rank_that_dies_inside_a_decode_step_is_named(checkpoint: Path, shm_path: Path) -> None:
    """A rank's process gone in the middle of a decode step: the leader's step fails as that
    rank's loss (its worker rank), whether a collective called from Python noticed (head size
    8: the layers one by one) or the native decode step's own sums (head size 16)."""
    child = multiprocessing.get_context("spawn").Process(
        target=_follow_then_die_in_decode, args=(str(shm_path), str(checkpoint))
    )
    child.start()
    reaper = threading.Thread(target=child.join)  # reaps it once it exits, as a supervisor does
    reaper.start()
    group = ShmGroup(shm_path, 0, 2, ranks=(2, 5), timeout_s=120)
    with sharded(TensorShard(0, 2, group)):
        model = load_llama(checkpoint)
    engine = KVCacheEngine(
        model, KVCacheEngineConfig(num_blocks=32, block_size=4), tensor_parallel=group
    )
    engine.add_request("r", PROMPTS[0], SamplingParams.greedy(4))
    engine.step()  # the prompt: both ranks
    with pytest.raises(TensorParallelRankLostError, match=r"rank 1 .* is gone") as lost:
        engine.step()
    assert lost.value.rank == 5
    native = model.decoder_layers[0].self_attn.head_dim >= 16  # the native step's head sizes
    assert isinstance(lost.value.__cause__, RuntimeError) == native  # the native call's error
    reaper.join(60)
    assert child.exitcode == 0
