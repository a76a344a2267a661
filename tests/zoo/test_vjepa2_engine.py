"""The predictor's frame-block KV engine: cached steps equal the native recompute under any
schedule, the pool is accounted exactly, and the async engine batches, defers and fails alone."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mstar.engines.attention import TorchPagedAttention
from mstar.engines.attention.base import AttentionMetadata
from mstar.errors import (
    EngineClosedError,
    KVCacheCapacityError,
    RequestAbortedError,
    RolloutStateError,
)
from mstar.zoo.vjepa2 import (
    ACPredictor,
    BlockJob,
    FrameBlockAttention,
    FrameKVConfig,
    FrameRolloutRunner,
    PredictorNode,
    get_vjepa2_config,
    load_predictor,
    make_random_checkpoint,
    native_rollout,
)

CFG = get_vjepa2_config("vjepa2-tiny")
N, D = CFG.predictor.num_patches, CFG.predictor.embed_dim


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_random_checkpoint(CFG, tmp_path_factory.mktemp("vjepa2") / "tiny.pt", seed=2)


@pytest.fixture(scope="module")
def predictor(checkpoint: Path) -> ACPredictor:
    return load_predictor(checkpoint, CFG)


def inputs(seed: int, rows: int, horizon: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    z0 = F.layer_norm(torch.randn(rows, N, D, generator=g), (D,))
    return z0, torch.rand(rows, 7, generator=g) * 0.2, torch.randn(rows, horizon, 7, generator=g) * 0.05


def first_job(rid: str, seed: int, rows: int, horizon: int) -> BlockJob:
    z, pose, actions = inputs(seed, rows, horizon)
    return BlockJob(rid, z, pose, actions[:, 0], 0, horizon)


class Rollout:
    """One request driven by hand: its inputs, next step, and what came back."""

    def __init__(self, rid: str, seed: int, rows: int, horizon: int, start: int) -> None:
        self.rid, self.horizon, self.start = rid, horizon, start
        self.z0, self.pose0, self.actions = inputs(seed, rows, horizon)
        self.latent, self.pose, self.step = self.z0, self.pose0, 0
        self.result: tuple[torch.Tensor, torch.Tensor] | None = None

    def job(self) -> BlockJob:
        return BlockJob(self.rid, self.latent, self.pose, self.actions[:, self.step], self.step, self.horizon, keep=True)


def drive(runner: FrameRolloutRunner, rollouts: list[Rollout], aborted: dict[str, int]) -> None:
    """Tick until every rollout finished: each tick runs one step of every started rollout."""
    tick = 0
    live = list(rollouts)
    while live:
        jobs, owners = [], []
        for r in live:
            if r.start > tick:
                continue
            if aborted.get(r.rid) == r.step:
                runner.release(r.rid)
                r.step = -1
                continue
            job = r.job()
            if job.step == 0:
                assert runner.can_admit(job)
                runner.admit(job)
            else:
                runner.check(job)
            jobs.append(job)
            owners.append(r)
        for r, res in zip(owners, runner.step(jobs) if jobs else [], strict=True):
            r.latent, r.pose, r.step = res.latent, res.pose, r.step + 1
            if res.is_done:
                assert res.latents is not None and res.poses is not None
                r.result = (res.latents, res.poses)
        live = [r for r in live if r.result is None and r.step >= 0]
        tick += 1


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    plan=st.lists(
        st.tuples(st.integers(1, 31), st.integers(1, 3), st.integers(0, 12), st.integers(-1, 30)), min_size=1, max_size=5
    ),
    backend=st.sampled_from(["frame", "paged"]),
)
def test_any_schedule_equals_the_native_recompute(predictor: ACPredictor, plan: list[tuple[int, int, int, int]], backend: str) -> None:
    need = sum(rows * horizon for horizon, rows, _, _ in plan)
    runner = FrameRolloutRunner(predictor, FrameKVConfig(num_blocks=need, attention_backend=backend))
    rollouts = [Rollout(f"r{i}", i, rows, h, start) for i, (h, rows, start, _) in enumerate(plan)]
    aborted = {f"r{i}": at for i, (h, _, _, at) in enumerate(plan) if 0 < at < h}
    drive(runner, rollouts, aborted)
    for r in rollouts:
        if r.rid in aborted:
            assert r.result is None
            continue
        assert r.result is not None
        ref_latents, ref_poses = native_rollout(predictor, r.z0, r.pose0, r.actions)
        torch.testing.assert_close(r.result[0], ref_latents, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(r.result[1], ref_poses)
    assert runner.num_requests == 0 and runner.pool.num_free_blocks == need
    runner.pool.blocks.check_invariants([])


def test_lockstep_requests_share_one_forward_per_step(predictor: ACPredictor) -> None:
    runner = FrameRolloutRunner(predictor, FrameKVConfig(num_blocks=64))
    rollouts = [Rollout(f"r{i}", i, 1, 7, 0) for i in range(3)] + [Rollout("late", 9, 2, 5, 2)]
    drive(runner, rollouts, {})
    assert runner.num_steps == 7
    assert list(runner.rows_per_step) == [3, 3, 5, 5, 5, 5, 5]


def test_admission_reserves_whole_rollouts_and_waits_for_room(predictor: ACPredictor) -> None:
    runner = FrameRolloutRunner(predictor, FrameKVConfig(num_blocks=10))
    first = first_job("a", 0, 2, 4)
    assert runner.can_admit(first)
    runner.admit(first)
    assert runner.num_reserved_blocks == 8
    second = first_job("b", 1, 1, 3)
    assert not runner.can_admit(second)  # 2 blocks left unreserved, it needs 3
    runner.step([first])
    assert runner.pool.num_free_blocks == 8 and runner.num_reserved_blocks == 6
    assert not runner.can_admit(second)
    runner.release("a")
    assert runner.can_admit(second) and runner.pool.num_free_blocks == 10
    with pytest.raises(KVCacheCapacityError, match="needs 11 frame blocks; the pool has 10"):
        runner.can_admit(first_job("c", 2, 1, 11))


def test_steps_must_continue_the_cached_rollout(predictor: ACPredictor) -> None:
    runner = FrameRolloutRunner(predictor, FrameKVConfig(num_blocks=16))
    z, pose, actions = inputs(0, 1, 4)
    with pytest.raises(RolloutStateError, match="no rollout is cached"):
        runner.check(BlockJob("a", z, pose, actions[:, 1], 1, 4))
    runner.admit(BlockJob("a", z, pose, actions[:, 0], 0, 4))
    with pytest.raises(RolloutStateError, match="does not continue its cached rollout"):
        runner.check(BlockJob("a", z, pose, actions[:, 2], 2, 4))


def test_frame_attention_equals_the_paged_reference() -> None:
    torch.manual_seed(0)
    f, heads, hd, blocks = 3, 2, 8, 12
    tables = [[4, 1], [7, 2, 9], [0]]
    lens = np.array([len(t) * f for t in tables])
    new_slots = np.concatenate([np.arange(f) + t[-1] * f for t in tables])
    meta = AttentionMetadata(
        num_tokens=3 * f,
        slot_mapping=torch.from_numpy(new_slots),
        query_start_loc=np.arange(4) * f,
        seq_lens=lens,
        block_tables=tables,
        kv_limits=np.repeat(lens, f),
        block_size=f,
    )
    q, k, v = (torch.randn(3 * f, heads, hd) for _ in range(3))
    cache = torch.randn(2, blocks + 1, f, heads, hd)
    outs = []
    for backend in (FrameBlockAttention(), TorchPagedAttention(decode_staging=False)):
        layer = (cache[0].clone(), cache[1].clone())
        backend.plan(meta)
        outs.append(backend.forward(q, k, v, layer, hd**-0.5))
        torch.testing.assert_close(layer[0][9], k[f : 2 * f])  # row 1 wrote its new block 9
    torch.testing.assert_close(outs[0], outs[1])
    with pytest.raises(ValueError, match="whole frame blocks"):
        FrameBlockAttention().plan(AttentionMetadata(1, torch.zeros(1), np.array([0, 1]), np.array([1]), [[0]], None, f))


# --- the async engine ----------------------------------------------------------------------------


def firing(seed: int, horizon: int, step: int = 0, emit: str = "none") -> dict[str, object]:
    z, pose, actions = inputs(seed, 1, horizon)
    return {"latent": z[0], "pose": pose[0], "step": step, "job": {"actions": actions[0], "emit": emit}}


async def test_engine_batches_pending_firings_and_fails_only_the_bad_one(predictor: ACPredictor) -> None:
    engine = PredictorNode(predictor, FrameKVConfig(num_blocks=32)).make_engine("predictor", None, "cpu")
    engine.start()
    try:
        good = [asyncio.ensure_future(engine.submit(f"r{i}", firing(i, 3), "rollout")) for i in range(3)]
        bad = asyncio.ensure_future(engine.submit("bad", {**firing(9, 3), "latent": torch.zeros(5, 5)}))
        late = asyncio.ensure_future(engine.submit("late", firing(7, 2, step=1)))
        outs = await asyncio.gather(*good)
        with pytest.raises(ValueError, match=r"'latent' must have shape \[\.\.\., 16, 64\]"):
            await bad
        with pytest.raises(RolloutStateError):
            await late
        assert list(engine.runner.rows_per_step) == [3]
        assert [o["step"] for o in outs] == [1, 1, 1] and not any(o["done"] for o in outs)
        assert outs[0]["latent"].shape == (16, 64) and "frame" not in outs[0]
        engine.abort("r0")
        nxt = await engine.submit("r1", {**firing(1, 3), "latent": outs[1]["latent"], "pose": outs[1]["pose"], "step": 1}, "rollout")
        assert nxt["step"] == 2 and engine.runner.num_requests == 2  # r0 released, r1 and r2 held
        # two steps served the rollout walk (3 firings, then 1); the bad firings came with no walk
        rollout = engine.walk_times.by_walk["rollout"]
        assert (rollout.steps, rollout.inputs) == (2, 4) and set(engine.walk_times.by_walk) == {"rollout", ""}
        stats = engine.stats()
        assert stats["steps"] == 2 and stats["batched"] == 6 and 0 < stats["kv_blocks_used"] <= stats["kv_blocks_total"]
    finally:
        await engine.aclose()


async def test_engine_defers_a_rollout_until_blocks_are_released(predictor: ACPredictor) -> None:
    engine = PredictorNode(predictor, FrameKVConfig(num_blocks=4)).make_engine("predictor", None, "cpu")
    engine.start()
    try:
        out = await engine.submit("a", firing(0, 3))  # holds 1 block, reserves 2 more
        waiting = asyncio.ensure_future(engine.submit("b", firing(1, 3)))  # needs 3: must wait
        aborted = asyncio.ensure_future(engine.submit("c", firing(2, 1)))  # fits, but waits its turn
        await engine.submit("a", {**firing(0, 3), "latent": out["latent"], "pose": out["pose"], "step": 1})
        assert engine.num_pending == 2 and list(engine.runner.rows_per_step) == [1, 1]
        engine.abort("c")
        with pytest.raises(RequestAbortedError):
            await aborted
        assert not waiting.done() and engine.num_pending == 1
        engine.abort("a")
        out = await waiting
        assert out["step"] == 1 and engine.runner.num_requests == 1
    finally:
        await engine.aclose()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("backend", ["frame", "paged", "flashinfer"])
def test_cuda_rollouts_equal_the_native_recompute(checkpoint: Path, backend: str) -> None:
    if backend == "flashinfer":
        pytest.importorskip("flashinfer")
    cuda = load_predictor(checkpoint, CFG, device="cuda")
    runner = FrameRolloutRunner(cuda, FrameKVConfig(num_blocks=256, attention_backend=backend), device="cuda")
    rollouts = [Rollout(f"r{i}", i, rows, h, start) for i, (rows, h, start) in enumerate([(1, 31, 0), (3, 7, 2), (2, 12, 5)])]
    drive(runner, rollouts, {})
    for r in rollouts:
        assert r.result is not None
        ref_latents, ref_poses = native_rollout(cuda, r.z0.cuda(), r.pose0.cuda(), r.actions.cuda())
        torch.testing.assert_close(r.result[0], ref_latents, rtol=1e-3, atol=1e-3)
        torch.testing.assert_close(r.result[1], ref_poses)


async def test_a_failing_forward_fails_only_its_request(predictor: ACPredictor, monkeypatch: pytest.MonkeyPatch) -> None:
    engine = PredictorNode(predictor, FrameKVConfig(num_blocks=16)).make_engine("predictor", None, "cpu")
    step = engine.runner.step

    def flaky(jobs: list[BlockJob]) -> list[object]:
        if any(j.request_id == "boom" for j in jobs):
            raise RuntimeError("device fault")
        return step(jobs)  # type: ignore[return-value]

    monkeypatch.setattr(engine.runner, "step", flaky)
    engine.start()
    try:
        ok = asyncio.ensure_future(engine.submit("ok", firing(0, 2)))
        boom = asyncio.ensure_future(engine.submit("boom", firing(1, 2)))
        assert (await ok)["step"] == 1
        with pytest.raises(RuntimeError, match="device fault"):
            await boom
        assert engine.runner.num_requests == 1 and engine.runner.pool.num_free_blocks == 15
    finally:
        await engine.aclose()
    late = asyncio.ensure_future(engine.submit("late", firing(2, 2)))
    with pytest.raises(EngineClosedError):
        await late
