"""The upstream rollout loop, kept as the baseline: every step re-runs all frames so far.

This is the loop of the V-JEPA 2-AC planning notebook and ``WorldModel``: at step ``n`` the
predictor runs over frames ``0..n`` (block-causal), the last frame's prediction is
layer-normalised and appended, and the pose is integrated. For a horizon ``H`` it pushes
``F * H (H + 1) / 2`` tokens through the predictor, where the KV-cached rollout pushes
``F * H``; both give the same latents.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mstar.zoo.vjepa2.pose import integrate_pose
from mstar.zoo.vjepa2.predictor import ACPredictor

__all__ = ["native_rollout", "native_step"]


@torch.inference_mode()
def native_step(
    predictor: ACPredictor, z: torch.Tensor, actions: torch.Tensor, poses: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Predict the next frame from all frames so far (the upstream ``step_predictor``).

    Args:
        predictor: The action-conditioned predictor.
        z: ``[B, T, N, D]`` latents of frames ``0..T-1``.
        actions: ``[B, T, 7]`` action taken at each frame.
        poses: ``[B, T, 7]`` pose at each frame.

    Returns:
        The layer-normalised next latent ``[B, N, D]`` and the next pose ``[B, 7]``.
    """
    b, t, n, d = z.shape
    nxt = predictor(z.reshape(b, t * n, d), actions, poses)[:, -n:]
    return F.layer_norm(nxt, (d,)), integrate_pose(poses[:, -1], actions[:, -1])


@torch.inference_mode()
def native_rollout(
    predictor: ACPredictor, z0: torch.Tensor, pose0: torch.Tensor, actions: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Roll out ``H`` frames from one context frame by recomputing every frame each step.

    Args:
        predictor: The action-conditioned predictor.
        z0: ``[B, N, D]`` normalised latent of the context frame.
        pose0: ``[B, 7]`` pose at the context frame.
        actions: ``[B, H, 7]``; action ``n`` is taken at frame ``n``.

    Returns:
        Predicted latents ``[B, H, N, D]`` (frames 1..H) and poses ``[B, H, 7]``.

    Raises:
        ValueError: ``H`` is 0 or exceeds the predictor's longest rollout.
    """
    horizon = actions.shape[1]
    limit = predictor.config.max_horizon
    if not 1 <= horizon <= limit:
        raise ValueError(f"horizon must be in 1..{limit}, got {horizon}")
    z = z0[:, None]
    poses = pose0[:, None]
    for n in range(horizon):
        z_next, pose_next = native_step(predictor, z, actions[:, : n + 1], poses)
        z = torch.cat([z, z_next[:, None]], dim=1)
        poses = torch.cat([poses, pose_next[:, None]], dim=1)
    return z[:, 1:], poses[:, 1:]
