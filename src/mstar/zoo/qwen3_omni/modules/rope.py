"""Interleaved multimodal rotary embedding (MRoPE) of Qwen3-Omni's thinker and talker.

Every position has three coordinates (time, height, width). Text rows have all three equal
(so MRoPE is plain RoPE there); image and video rows get their grid's coordinates. Each of the
``head_dim / 2`` rotary channels reads one coordinate, interleaved::

    channel   0  1  2  3  4  5  6  7  ...      (mrope_section [t, h, w])
    axis      T  H  W  T  H  W  T  H  ...      H while i % 3 == 1 and i < 3h; W while i % 3 == 2 and
    i < 3w; else T

so ``angle[i] = position[axis[i]] * inv_freq[i]``, computed in float32 as transformers does,
and the two halves of a head repeat the angles (half-split pairs, `apply_rotary`).
"""

from __future__ import annotations

import torch

__all__ = ["MRoPE", "mrope_axes"]


def mrope_axes(head_dim: int, section: tuple[int, int, int]) -> torch.Tensor:
    """Return which coordinate (0 T, 1 H, 2 W) each of the ``head_dim / 2`` channels reads."""
    half = head_dim // 2
    axes = torch.zeros(half, dtype=torch.long)
    for axis, offset in ((1, 1), (2, 2)):
        axes[offset : section[axis] * 3 : 3] = axis
    return axes


class MRoPE:
    """Rotary tables: cached for 1-D positions, computed per row for 3-D ones."""

    def __init__(
        self, head_dim: int, theta: float, section: tuple[int, int, int], max_position: int
    ) -> None:
        self.inv_freq = 1.0 / (
            theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim)
        )
        self.axes = mrope_axes(head_dim, section)
        angles = torch.outer(torch.arange(max_position, dtype=torch.float32), self.inv_freq)
        angles = torch.cat((angles, angles), dim=-1)
        self.cos_table = angles.cos()
        self.sin_table = angles.sin()

    def to(self, device: torch.device) -> MRoPE:
        """Move the tables to ``device`` (in place); return self."""
        self.inv_freq = self.inv_freq.to(device)
        self.axes = self.axes.to(device)
        self.cos_table = self.cos_table.to(device)
        self.sin_table = self.sin_table.to(device)
        return self

    def tables(
        self, positions: torch.Tensor, positions3: torch.Tensor | None, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Return ``cos, sin`` ``[rows, 1, head_dim]`` for 1-D ``positions`` or 3-D ``positions3``
        ``[3, rows]``."""
        if positions3 is None:
            cos = self.cos_table.index_select(0, positions)
            sin = self.sin_table.index_select(0, positions)
        else:
            coords = positions3.to(torch.float32).index_select(0, self.axes)  # [half, rows]
            angles = coords.t() * self.inv_freq
            angles = torch.cat((angles, angles), dim=-1)
            cos, sin = angles.cos(), angles.sin()
        return cos.unsqueeze(1).to(dtype), sin.unsqueeze(1).to(dtype)
