"""The predictor node on the paged-KV engine: cached steps equal the native recompute under any
schedule, frames of concurrent rollouts share steps, admission reserves whole rollouts, and a bad
or failing firing fails alone."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mstar.baselines.vjepa2 import native_rollout
from mstar.engines.kv_node import KVNodeEngine
from mstar.errors import (
    EngineClosedError,
    KVCacheCapacityError,
    RequestAbortedError,
    RolloutStateError,
)
from mstar.zoo.vjepa2 import (
    ACPredictor,
    FrameKVConfig,
    PagedACPredictor,
    PredictorNode,
    get_vjepa2_config,
    load_predictor,
    make_random_checkpoint,
)

CFG = get_vjepa2_config("vjepa2-tiny")
N, D = CFG.predictor.num_patches, CFG.predictor.embed_dim
FRAME = CFG.predictor.frame_tokens


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
    return (
        z0,
        torch.rand(rows, 7, generator=g) * 0.2,
        torch.randn(rows, horizon, 7, generator=g) * 0.05,
    )


def firing(
    seed: int, horizon: int, step: int = 0, emit: str = "none", rows: int = 0
) -> dict[str, Any]:
    z, pose, actions = inputs(seed, max(rows, 1), horizon)
    if rows:
        return {"latent": z, "pose": pose, "step": step, "job": {"actions": actions, "emit": emit}}
    return {
        "latent": z[0],
        "pose": pose[0],
        "step": step,
        "job": {"actions": actions[0], "emit": emit},
    }


def make_engine(predictor: ACPredictor, num_blocks: int, backend: str = "torch") -> KVNodeEngine:
    node = PredictorNode(predictor, FrameKVConfig(num_blocks=num_blocks, attention_backend=backend))
    return KVNodeEngine("predictor", node, None, "cpu")


async def roll(
    engine: KVNodeEngine, rid: str, data: Mapping[str, Any], abort_at: int = -1
) -> Mapping[str, Any] | None:
    """Fire the predictor once per frame, feeding each output back (the rollout loop)."""
    x = dict(data)
    horizon = x["job"]["actions"].shape[-2]
    for step in range(horizon):
        if step == abort_at:
            engine.abort(rid)
            return None
        out = await engine.submit(rid, {**x, "step": step}, "rollout")
        x["latent"], x["pose"] = out["latent"], out["pose"]
        if out["done"]:
            return out
    raise AssertionError("the rollout never ended")


@settings(
    max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    plan=st.lists(
        st.tuples(st.integers(1, 31), st.integers(0, 3), st.integers(0, 6), st.integers(-1, 30)),
        min_size=1,
        max_size=5,
    )
)
def test_any_schedule_equals_the_native_recompute(
    predictor: ACPredictor, plan: list[tuple[int, int, int, int]]
) -> None:
    """Rollouts of any horizon and row count, started and aborted at any step, batched in any
    mix, give the upstream loop's latents and poses; every block comes back."""
    need = sum(max(rows, 1) * horizon for horizon, rows, _, _ in plan)

    async def main() -> list[Mapping[str, Any] | None]:
        engine = make_engine(predictor, need)
        engine.start()
        try:
            first_done = asyncio.Event()

            async def one(
                i: int, horizon: int, rows: int, start: int, abort_at: int
            ) -> Mapping[str, Any] | None:
                if i and start % 2:
                    await first_done.wait()  # some start only once the first rollout ended
                out = await roll(
                    engine,
                    f"r{i}",
                    firing(i, horizon, emit="final", rows=rows),
                    abort_at if 0 < abort_at < horizon else -1,
                )
                if i == 0:
                    first_done.set()
                return out

            outs = await asyncio.gather(*(one(i, *p) for i, p in enumerate(plan)))
            await roll(engine, "flush", firing(99, 1))  # engine calls apply in order: aborts are in
            stats = engine.stats()
            assert stats["kv_blocks_used"] == 0 and engine.num_requests == 0
            engine.engine.block_manager.check_invariants([])
            return outs
        finally:
            await engine.aclose()

    outs = asyncio.run(main())
    for i, ((horizon, rows, _, abort_at), out) in enumerate(zip(plan, outs, strict=True)):
        if 0 < abort_at < horizon:
            assert out is None
            continue
        assert out is not None
        z0, pose0, actions = inputs(i, max(rows, 1), horizon)
        ref_latents, ref_poses = native_rollout(predictor, z0, pose0, actions)
        got_latents, got_poses = (
            (out["latents"], out["poses"]) if rows else (out["latents"][None], out["poses"][None])
        )
        torch.testing.assert_close(got_latents, ref_latents, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(got_poses, ref_poses)


async def test_lockstep_requests_share_one_forward_per_step(predictor: ACPredictor) -> None:
    """Three rollouts in lockstep run one step per frame, each with all three frame blocks."""
    engine = make_engine(predictor, 64)
    engine.start()
    try:
        await asyncio.gather(*(roll(engine, f"r{i}", firing(i, 7)) for i in range(3)))
        stats = engine.stats()
        assert (stats["steps"], stats["batched"]) == (7, 21)
        assert engine.walk_times.by_walk["rollout"].inputs == 21
        assert stats["phase_forward_seconds"] > 0 and stats["phase_schedule_seconds"] > 0
    finally:
        await engine.aclose()


async def test_admission_reserves_whole_rollouts_and_waits_for_room(predictor: ACPredictor) -> None:
    """A rollout starts only once blocks for its whole horizon are held for it; it waits (first
    come, first served) while others hold them, and one that could never fit fails at once."""
    engine = make_engine(predictor, 4)
    engine.start()
    try:
        out = await engine.submit("a", firing(0, 3))  # holds 1 block, reserves 2 more
        waiting = asyncio.ensure_future(engine.submit("b", firing(1, 3)))  # needs 3: must wait
        later = asyncio.ensure_future(engine.submit("c", firing(2, 1)))  # fits, but waits its turn
        await engine.submit(
            "a", {**firing(0, 3), "latent": out["latent"], "pose": out["pose"], "step": 1}
        )
        assert not waiting.done() and not later.done()
        engine.abort("c")
        with pytest.raises(RequestAbortedError):
            await later
        assert not waiting.done()
        engine.abort("a")
        assert (await waiting)["step"] == 1
        with pytest.raises(KVCacheCapacityError, match="reserves 5 blocks"):
            await engine.submit("d", firing(3, 5))
        with pytest.raises(KVCacheCapacityError, match="reserves 6 blocks"):
            # rows of one firing are reserved together
            await engine.submit("e", firing(3, 3, rows=2))
    finally:
        await engine.aclose()


async def test_bad_firings_fail_alone(predictor: ACPredictor) -> None:
    """Malformed inputs and steps that do not continue a rollout fail their firing only."""
    engine = make_engine(predictor, 32)
    engine.start()
    try:
        good = [
            asyncio.ensure_future(engine.submit(f"r{i}", firing(i, 3), "rollout")) for i in range(3)
        ]
        bad = asyncio.ensure_future(
            engine.submit("bad", {**firing(9, 3), "latent": torch.zeros(5, 5)})
        )
        late = asyncio.ensure_future(engine.submit("late", firing(7, 2, step=1)))
        outs = await asyncio.gather(*good)
        with pytest.raises(ValueError, match=r"'latent' must have shape \[\.\.\., 16, 64\]"):
            await bad
        with pytest.raises(RolloutStateError, match="no rollout is cached"):
            await late
        with pytest.raises(RolloutStateError, match="does not continue"):
            await engine.submit("r0", {**firing(0, 3), "step": 2})
        assert [o["step"] for o in outs] == [1, 1, 1] and not any(o["done"] for o in outs)
        assert outs[0]["latent"].shape == (16, 64) and "frame" not in outs[0]
        engine.abort("r0")
        nxt = await engine.submit(
            "r1",
            {**firing(1, 3), "latent": outs[1]["latent"], "pose": outs[1]["pose"], "step": 1},
            "rollout",
        )
        assert nxt["step"] == 2
        assert engine.num_requests == 2  # r1 and r2 hold their rows; r0 was released
    finally:
        await engine.aclose()


async def test_a_failing_forward_fails_only_its_request(
    predictor: ACPredictor, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A device fault in one request's frame fails that request; the step's others go on."""
    engine = make_engine(predictor, 16)
    paged = engine.kv_node.model
    assert isinstance(paged, PagedACPredictor)
    forward = PagedACPredictor.forward

    def flaky(
        self: PagedACPredictor, input_ids: torch.Tensor, positions: torch.Tensor, ctx: Any
    ) -> torch.Tensor:
        if any(bool((c.payload.latent == 0).all()) for c in ctx.step.chunks):
            raise RuntimeError("device fault")
        return forward(self, input_ids, positions, ctx)

    monkeypatch.setattr(PagedACPredictor, "forward", flaky)
    engine.start()
    try:
        ok = asyncio.ensure_future(engine.submit("ok", firing(0, 2)))
        boom = asyncio.ensure_future(
            engine.submit("boom", {**firing(1, 2), "latent": torch.zeros(N, D)})
        )
        assert (await ok)["step"] == 1
        with pytest.raises(RuntimeError, match="device fault"):
            await boom
        assert engine.stats()["kv_blocks_used"] == 1  # only "ok" holds its frame
    finally:
        await engine.aclose()
    with pytest.raises(EngineClosedError):
        await engine.submit("late", firing(2, 2))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("backend", ["torch", "flashinfer"])
def test_cuda_rollouts_equal_the_native_recompute(checkpoint: Path, backend: str) -> None:
    if backend == "flashinfer":
        pytest.importorskip("flashinfer")
    cuda = load_predictor(checkpoint, CFG, device="cuda")

    async def main() -> list[Mapping[str, Any] | None]:
        node = PredictorNode(cuda, FrameKVConfig(num_blocks=256, attention_backend=backend))
        engine = KVNodeEngine("predictor", node, None, "cuda")
        engine.start()
        try:
            plans = [(0, 31, 0), (1, 7, 3), (2, 12, 2)]
            return await asyncio.gather(
                *(
                    roll(
                        engine,
                        f"r{i}",
                        {k: _cuda(v) for k, v in firing(seed, h, emit="final", rows=rows).items()},
                    )
                    for i, (seed, h, rows) in enumerate(plans)
                )
            )
        finally:
            await engine.aclose()

    outs = asyncio.run(main())
    for (seed, h, rows), out in zip([(0, 31, 0), (1, 7, 3), (2, 12, 2)], outs, strict=True):
        assert out is not None
        z0, pose0, actions = inputs(seed, max(rows, 1), h)
        ref_latents, ref_poses = native_rollout(cuda, z0.cuda(), pose0.cuda(), actions.cuda())
        got = out["latents"] if rows else out["latents"][None]
        torch.testing.assert_close(got, ref_latents.cpu(), rtol=1e-3, atol=1e-3)
        torch.testing.assert_close(out["poses"] if rows else out["poses"][None], ref_poses.cpu())


def _cuda(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.cuda()
    if isinstance(value, dict):
        return {k: _cuda(v) for k, v in value.items()}
    return value
