"""3D rotary position embeddings as V-JEPA 2 applies them (checkpoint-compatible).

Each attention head's channels are split into a depth (frame), a height and a width part of
``r = 2 * ((head_dim // 3) // 2)`` channels each; what is left stays unrotated::

    head channels  [ frame t (r) | row h (r) | column w (r) | unrotated (head_dim - 3r) ]

Within a part of ``r`` channels, channel ``j`` uses the angle ``pos * omega[j mod r/2]`` with
``omega[i] = 10000 ** (-i / (r/2))``, and channel pairs ``(2i, 2i+1)`` turn as
``(x0, x1) -> (x0 cos - x1 sin, x1 cos + x0 sin)``. Indexing the angles by ``j mod r/2``
(rather than ``j // 2``) is how the published weights were trained, so it is kept.

Action and state tokens carry only the frame position (their height and width parts stay
unrotated). Tables are built once per position as ``[..., head_dim]`` cosines and sines
(cos 1, sin 0 where a channel is not rotated), so applying them is two multiplies.
"""

from __future__ import annotations

import torch

__all__ = ["apply_rope", "axis_angles", "rope_dim", "token_tables"]


def rope_dim(head_dim: int) -> int:
    """Return the channels per rotated axis."""
    return 2 * ((head_dim // 3) // 2)


def axis_angles(pos: torch.Tensor, dim: int) -> torch.Tensor:
    """Return ``[..., dim]`` angles of one axis for float positions ``pos`` (upstream layout)."""
    half = dim // 2
    omega = 1.0 / 10000 ** (torch.arange(half, dtype=torch.float64) / (dim / 2.0))
    angles = pos.to(torch.float64)[..., None] * omega
    return torch.cat([angles, angles], dim=-1)


def token_tables(
    frame: torch.Tensor, row: torch.Tensor | None, col: torch.Tensor | None, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return ``(cos, sin)``, each ``[..., head_dim]`` float32, for tokens at these positions.

    Args:
        frame: Frame index of each token.
        row: Patch row of each token, or None for tokens without one (action, state).
        col: Patch column, like ``row``.
        head_dim: Channels per head.
    """
    r = rope_dim(head_dim)
    angles = torch.zeros(*frame.shape, head_dim, dtype=torch.float64)
    angles[..., :r] = axis_angles(frame, r)
    if row is not None and col is not None:
        angles[..., r : 2 * r] = axis_angles(row, r)
        angles[..., 2 * r : 3 * r] = axis_angles(col, r)
    # cos(0) = 1 and sin(0) = 0 leave the zero-angle channels unrotated.
    return angles.cos().float(), angles.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[..., head_dim]`` by tables broadcastable to it."""
    pairs = x.unflatten(-1, (-1, 2))
    turned = torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1).flatten(-2)
    return x * cos + turned * sin
