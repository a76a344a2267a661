"""End-effector pose integration: the world model's proprioceptive state update.

A pose and an action are 7-vectors ``[x, y, z, roll, pitch, yaw, gripper]``; angles are
extrinsic x-y-z Euler angles (``R = Rz(yaw) @ Ry(pitch) @ Rx(roll)``). One step moves the
position by the action's delta, applies the action's rotation after the pose's
(``R_new = R_action @ R_pose``) and adds the gripper delta, clipped to [0, 1]. Angles come
back canonical: roll and yaw in (-pi, pi], pitch in [-pi/2, pi/2]. The work is done in
float64, as the upstream helper (NumPy) does.
"""

from __future__ import annotations

import torch

__all__ = ["POSE_DIM", "euler_to_matrix", "integrate_pose", "matrix_to_euler"]

POSE_DIM = 7
"""Entries of a pose and of an action: ``[x, y, z, roll, pitch, yaw, gripper]``."""


def euler_to_matrix(angles: torch.Tensor) -> torch.Tensor:
    """Return ``[..., 3, 3]`` rotations for extrinsic x-y-z Euler ``angles`` ``[..., 3]``."""
    cx, cy, cz = angles.cos().unbind(-1)
    sx, sy, sz = angles.sin().unbind(-1)
    rows = [
        [cz * cy, cz * sy * sx - sz * cx, cz * sy * cx + sz * sx],
        [sz * cy, sz * sy * sx + cz * cx, sz * sy * cx - cz * sx],
        [-sy, cy * sx, cy * cx],
    ]
    return torch.stack([torch.stack(row, dim=-1) for row in rows], dim=-2)


def matrix_to_euler(matrix: torch.Tensor) -> torch.Tensor:
    """Return extrinsic x-y-z Euler angles ``[..., 3]`` of rotations ``[..., 3, 3]``.

    At gimbal lock (pitch = +-pi/2) roll and yaw are not separable; yaw is then set to 0.
    """
    r20 = matrix[..., 2, 0].clamp(-1.0, 1.0)
    pitch = torch.asin(-r20)
    roll = torch.atan2(matrix[..., 2, 1], matrix[..., 2, 2])
    yaw = torch.atan2(matrix[..., 1, 0], matrix[..., 0, 0])
    locked = (1.0 - r20.abs()) < 1e-12
    if bool(locked.any()):
        # R = Rz(yaw) Ry(+-pi/2) Rx(roll) depends only on roll -+ yaw: put it all in roll.
        sign = -torch.sign(r20)
        locked_roll = torch.atan2(sign * matrix[..., 0, 1], matrix[..., 1, 1])
        roll = torch.where(locked, locked_roll, roll)
        yaw = torch.where(locked, torch.zeros_like(yaw), yaw)
    return torch.stack([roll, pitch, yaw], dim=-1)


def integrate_pose(pose: torch.Tensor, action: torch.Tensor) -> torch.Tensor:
    """Return the pose after ``action``: ``[..., 7]`` from ``[..., 7]`` pose and action."""
    p, a = pose.double(), action.double()
    xyz = p[..., :3] + a[..., :3]
    rotation = euler_to_matrix(a[..., 3:6]) @ euler_to_matrix(p[..., 3:6])
    gripper = (p[..., 6:] + a[..., 6:]).clamp(0.0, 1.0)
    return torch.cat([xyz, matrix_to_euler(rotation), gripper], dim=-1).to(pose.dtype)
