"""The predictor's device work: frame-block rollouts of many requests over one paged cache.

`FrameRolloutRunner` is synchronous and holds all device state: the `FrameKVPool`, the
rollouts it caches (one row per rollout sample, one block per cached frame) and the
attention backend. `admit` starts a rollout and reserves every block it will take, so an
admitted rollout never stalls for memory; `step` runs one frame block of every row of a
batch of `BlockJob`s in one forward and integrates their poses. A finished rollout's blocks
are freed at once: its frames are never attended again.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from mstar.engines.kv_cache import KVCacheSpec, num_blocks_for_budget
from mstar.engines.sequence import Sequence
from mstar.errors import KVCacheCapacityError, RolloutStateError
from mstar.zoo.vjepa2.frame_cache import FrameKVPool, frame_metadata, make_attention_backend
from mstar.zoo.vjepa2.pose import integrate_pose
from mstar.zoo.vjepa2.predictor import ACPredictor

__all__ = ["BlockJob", "BlockResult", "FrameKVConfig", "FrameRolloutRunner"]


@dataclass(frozen=True)
class FrameKVConfig:
    """Sizing and attention backend of the predictor's frame-block cache.

    Attributes:
        num_blocks: Blocks in the pool (one per rollout row per cached frame); None sizes
            the pool from ``kv_budget``.
        kv_budget: Bytes (int), or a fraction in (0, 1] of the device's free memory.
        attention_backend: "auto", "frame", "paged" or "flashinfer" (see
            `make_attention_backend`).
    """

    num_blocks: int | None = None
    kv_budget: int | float = 1 << 30
    attention_backend: str = "auto"

    def __post_init__(self) -> None:
        if self.num_blocks is not None and self.num_blocks < 1:
            raise KVCacheCapacityError(f"num_blocks must be >= 1, got {self.num_blocks}")
        if self.attention_backend not in ("auto", "frame", "paged", "flashinfer"):
            raise ValueError(f"attention_backend must be auto, frame, paged or flashinfer, got {self.attention_backend!r}")


@dataclass(frozen=True)
class BlockJob:
    """One request's rollout step: ``S`` rows each append frame ``step``.

    Attributes:
        request_id: The request.
        latent: ``[S, N, D]`` latent of frame ``step`` (normalised).
        pose: ``[S, 7]`` pose at frame ``step``.
        action: ``[S, 7]`` action taken at frame ``step``.
        step: Frame index (0 starts a new rollout, dropping what the request held).
        horizon: Frames the rollout predicts in all.
        keep: Keep every prediction, to return the whole trajectory after the last step.
    """

    request_id: str
    latent: torch.Tensor
    pose: torch.Tensor
    action: torch.Tensor
    step: int
    horizon: int
    keep: bool = False

    @property
    def num_rows(self) -> int:
        """Rows (rollouts) in the job."""
        return int(self.latent.shape[0])


@dataclass(frozen=True)
class BlockResult:
    """A job's outcome: the next latent and pose, and the trajectory after the last step."""

    latent: torch.Tensor
    pose: torch.Tensor
    is_done: bool
    latents: torch.Tensor | None = None  # [S, H, N, D] on the last step of a kept rollout
    poses: torch.Tensor | None = None  # [S, H, 7]


@dataclass
class _Rollout:
    rows: list[Sequence]
    horizon: int
    keep: bool
    num_frames: int = 0
    latents: list[torch.Tensor] = field(default_factory=list)
    poses: list[torch.Tensor] = field(default_factory=list)

    @property
    def blocks_to_come(self) -> int:
        return len(self.rows) * (self.horizon - self.num_frames)


class FrameRolloutRunner:
    """Run rollout steps of many requests over one paged frame-block cache (synchronous).

    Args:
        predictor: The loaded predictor (its dtype is the cache's).
        config: Pool size and attention backend.
        device: Where the predictor and the pool live.
    """

    def __init__(self, predictor: ACPredictor, config: FrameKVConfig | None = None, device: torch.device | str = "cpu") -> None:
        self.predictor = predictor
        self.config = config or FrameKVConfig()
        self.device = torch.device(device)
        cfg = predictor.config
        self.dtype = next(predictor.parameters()).dtype
        spec = KVCacheSpec(cfg.depth, cfg.num_heads, cfg.head_dim, self.dtype)
        num_blocks = self.config.num_blocks or num_blocks_for_budget(spec, cfg.frame_tokens, self.config.kv_budget, self.device)
        self.pool = FrameKVPool(spec, cfg.frame_tokens, num_blocks, self.device)
        self.backend = make_attention_backend(self.config.attention_backend, self.device)
        self.scale = cfg.head_dim**-0.5
        self.rollouts: dict[str, _Rollout] = {}
        self.num_steps = 0
        self.rows_per_step: deque[int] = deque(maxlen=4096)  # recent batch sizes, for tests and metrics

    @property
    def num_requests(self) -> int:
        """Count the requests holding a rollout here."""
        return len(self.rollouts)

    @property
    def num_reserved_blocks(self) -> int:
        """Count the blocks admitted rollouts will still take."""
        return sum(r.blocks_to_come for r in self.rollouts.values())

    def release(self, request_id: str) -> None:
        """Drop a request's rollout and free its blocks (no-op if it holds none)."""
        rollout = self.rollouts.pop(request_id, None)
        if rollout is not None:
            for row in rollout.rows:
                self.pool.free(row)

    def can_admit(self, job: BlockJob) -> bool:
        """Whether a new rollout's blocks fit now, next to those reserved by the others.

        Raises:
            KVCacheCapacityError: It could never fit, even in an empty pool.
        """
        need = job.num_rows * job.horizon
        if need > self.pool.num_blocks:
            raise KVCacheCapacityError(
                f"a rollout of {job.num_rows} rows x {job.horizon} frames needs {need} frame blocks; the "
                f"pool has {self.pool.num_blocks} (raise num_blocks or kv_budget, or roll out fewer rows)"
            )
        held = self.rollouts.get(job.request_id)
        reserved = self.num_reserved_blocks - (held.blocks_to_come if held is not None else 0)
        freed = sum(len(r.block_table) for r in held.rows) if held is not None else 0
        return need <= self.pool.num_free_blocks + freed - reserved

    def admit(self, job: BlockJob) -> None:
        """Start the rollout of a ``step == 0`` job, dropping one the request held.

        Call after `can_admit` returned True.
        """
        self.release(job.request_id)
        rows = [self.pool.new_row(job.request_id) for _ in range(job.num_rows)]
        self.rollouts[job.request_id] = _Rollout(rows, job.horizon, job.keep)

    def check(self, job: BlockJob) -> None:
        """Check that a ``step > 0`` job continues the rollout held for its request.

        Raises:
            RolloutStateError: No rollout is held, or it is at another frame or row count.
        """
        held = self.rollouts.get(job.request_id)
        if held is None:
            raise RolloutStateError(
                f"step {job.step} of request {job.request_id!r} arrived, but no rollout is cached for it "
                "(a rollout starts at step 0 and continues on the engine that holds it)"
            )
        if held.num_frames != job.step or len(held.rows) != job.num_rows or held.horizon != job.horizon:
            raise RolloutStateError(
                f"step {job.step} ({job.num_rows} rows, horizon {job.horizon}) of request {job.request_id!r} does "
                f"not continue its cached rollout ({held.num_frames} frames, {len(held.rows)} rows, horizon {held.horizon})"
            )

    @torch.inference_mode()
    def step(self, jobs: list[BlockJob]) -> list[BlockResult]:
        """Run one frame block for every row of ``jobs`` (all admitted or checked) in one forward."""
        rollouts = [self.rollouts[j.request_id] for j in jobs]
        rows = [row for r in rollouts for row in r.rows]
        for row in rows:
            self.pool.append_frame(row)
        frame_index = torch.tensor([j.step for j in jobs for _ in range(j.num_rows)], device=self.device)
        z = torch.cat([j.latent for j in jobs]).to(self.device, self.dtype)
        poses = torch.cat([j.pose for j in jobs]).to(self.device)
        actions = torch.cat([j.action for j in jobs]).to(self.device)
        self.backend.plan(frame_metadata(rows, self.pool.frame_tokens, self.device))
        layers = self.pool.layers

        def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            b, m, heads, head_dim = q.shape
            flat = (b * m, heads, head_dim)
            out = self.backend.forward(q.reshape(flat), k.reshape(flat), v.reshape(flat), layers[layer], self.scale)
            return out.view(b, m, heads, head_dim)

        pred = self.predictor.forward_frames(
            z[:, None], actions[:, None].to(self.dtype), poses[:, None].to(self.dtype), frame_index, attend
        )[:, 0]
        latent_next = F.layer_norm(pred, (pred.shape[-1],))
        pose_next = integrate_pose(poses, actions)
        # Only now is the frame's K/V complete in every layer: count it as cached.
        for row in rows:
            row.num_computed_tokens += self.pool.frame_tokens
        self.num_steps += 1
        self.rows_per_step.append(len(rows))
        results = []
        start = 0
        for job, rollout in zip(jobs, rollouts, strict=True):
            end = start + job.num_rows
            latent, pose = latent_next[start:end], pose_next[start:end]
            start = end
            rollout.num_frames += 1
            if rollout.keep:
                rollout.latents.append(latent)
                rollout.poses.append(pose)
            is_done = rollout.num_frames == rollout.horizon
            if not is_done:
                results.append(BlockResult(latent, pose, False))
                continue
            latents = torch.stack(rollout.latents, dim=1) if rollout.keep else None
            trajectory = torch.stack(rollout.poses, dim=1) if rollout.keep else None
            self.release(job.request_id)  # a finished rollout's frames are never attended again
            results.append(BlockResult(latent, pose, True, latents, trajectory))
        return results
