"""The V-JEPA 2 ViT encoder: tubelet patch embedding, RoPE attention blocks, final norm.

Parameter names follow the published checkpoints (``patch_embed.proj``, ``blocks.{i}.norm1``,
``blocks.{i}.attn.qkv``, ``blocks.{i}.attn.proj``, ``blocks.{i}.norm2``,
``blocks.{i}.mlp.fc1``/``fc2``, ``norm``). Positions come from 3D RoPE only (no learned
position embedding).

A single image is encoded as one tubelet: the frame is repeated ``tubelet_size`` times along
time, giving ``grid**2`` tokens; `encode_frames` then layer-normalises them (no affine), as the
world model does before planning.

Once the weights are loaded, `VJepa2Encoder.fuse_for_inference` stores each block's linears
in the layout that multiplies fastest for one image's tokens (see `mstar.engines.layers`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mstar.engines.layers import FusableLinear
from mstar.zoo.vjepa2.config import EncoderConfig
from mstar.zoo.vjepa2.rope import apply_rope, token_tables

__all__ = ["Attention", "Block", "MLP", "VJepa2Encoder", "fuse_blocks"]


class MLP(nn.Module):
    """Two linear layers around a GELU."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.fc1 = FusableLinear(dim, hidden)
        self.act = nn.GELU()
        self.fc2 = FusableLinear(hidden, dim)

    def fuse_for_inference(self, rows: tuple[int, ...]) -> None:
        """Store both weights in the layout fastest at ``rows`` tokens (after loading them)."""
        self.fc1.fuse_for_inference(rows)
        self.fc2.fuse_for_inference(rows)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the MLP."""
        return self.fc2(self.act(self.fc1(x)))


class Attention(nn.Module):
    """Multi-head self-attention with RoPE on queries and keys."""

    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.qkv = FusableLinear(dim, 3 * dim)
        self.proj = FusableLinear(dim, dim)

    def fuse_for_inference(self, rows: tuple[int, ...]) -> None:
        """Store both weights in the layout fastest at ``rows`` tokens (after loading them)."""
        self.qkv.fuse_for_inference(rows)
        self.proj.fuse_for_inference(rows)

    def qkv_heads(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Return rotated q, k and v as ``[B, M, heads, head_dim]`` for ``x`` ``[B, M, dim]``."""
        qkv = self.qkv(x).unflatten(-1, (3, self.num_heads, self.head_dim))
        q, k, v = qkv.unbind(dim=2)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Attend over all tokens (bidirectional)."""
        q, k, v = self.qkv_heads(x, cos, sin)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        )
        return self.proj(out.transpose(1, 2).flatten(2))


def fuse_blocks(blocks: nn.Module, rows: tuple[int, ...]) -> None:
    """Fuse every `Attention` and `MLP` under `blocks` for batches of `rows` tokens (see
    `FusedLinear`)."""
    for module in blocks.modules():
        if isinstance(module, Attention | MLP):
            module.fuse_for_inference(rows)


class Block(nn.Module):
    """Pre-norm transformer block."""

    def __init__(self, dim: int, num_heads: int, mlp_hidden: int, eps: float) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=eps)
        self.attn = Attention(dim, num_heads)
        self.norm2 = nn.LayerNorm(dim, eps=eps)
        self.mlp = MLP(dim, mlp_hidden)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Apply attention then the MLP, each with a residual."""
        x = x + self.attn(self.norm1(x), cos, sin)
        return x + self.mlp(self.norm2(x))


class PatchEmbed3D(nn.Module):
    """Cut a clip into tubelet x patch x patch cubes and project each to a token."""

    def __init__(self, cfg: EncoderConfig) -> None:
        super().__init__()
        kernel = (cfg.tubelet_size, cfg.patch_size, cfg.patch_size)
        self.proj = nn.Conv3d(cfg.in_chans, cfg.embed_dim, kernel_size=kernel, stride=kernel)

    def forward(self, clip: torch.Tensor) -> torch.Tensor:
        """Return ``[B, T' * H' * W', dim]`` tokens (time, row, column order) for ``[B, C, T, H,
        W]``."""
        return self.proj(clip).flatten(2).transpose(1, 2)


class VJepa2Encoder(nn.Module):
    """The V-JEPA 2 video ViT with 3D RoPE."""

    def __init__(self, cfg: EncoderConfig) -> None:
        super().__init__()
        self.config = cfg
        self.patch_embed = PatchEmbed3D(cfg)
        self.blocks = nn.ModuleList(
            Block(cfg.embed_dim, cfg.num_heads, cfg.mlp_hidden, cfg.norm_eps)
            for _ in range(cfg.depth)
        )
        self.norm = nn.LayerNorm(cfg.embed_dim, eps=cfg.norm_eps)
        self._tables: dict[tuple[int, int, int], tuple[torch.Tensor, torch.Tensor]] = {}

    def _rope(
        self, t: int, h: int, w: int, like: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        key = (t, h, w)
        if key not in self._tables:
            ids = torch.arange(t * h * w)
            frame, rest = ids // (h * w), ids % (h * w)
            cos, sin = token_tables(frame, rest // w, rest % w, self.config.head_dim)
            self._tables[key] = (cos[:, None, :], sin[:, None, :])  # broadcast over heads
        cos, sin = self._tables[key]
        return cos.to(like.device, like.dtype), sin.to(like.device, like.dtype)

    def fuse_for_inference(self) -> None:
        """Store every block's linears in the layout fastest for one image's tokens.

        Call this once the weights are loaded and the module is on its device and in its dtype
        (`load_encoder` does). In oneDNN's packed layout the linears give up their weights,
        so the encoder can only run inference afterwards (see `FusedLinear`).
        """
        fuse_blocks(self.blocks, (self.config.num_patches,))

    def forward(self, clip: torch.Tensor) -> torch.Tensor:
        """Encode ``[B, C, T, H, W]`` clips to normed ``[B, (T / tubelet) * H' * W', dim]``
        tokens."""
        cfg = self.config
        _, _, t, h, w = clip.shape
        x = self.patch_embed(clip)
        cos, sin = self._rope(t // cfg.tubelet_size, h // cfg.patch_size, w // cfg.patch_size, x)
        for block in self.blocks:
            x = block(x, cos, sin)
        return self.norm(x)

    def encode_frames(self, frames: torch.Tensor, *, normalize: bool = True) -> torch.Tensor:
        """Encode ``[B, C, H, W]`` normalised images to ``[B, grid**2, dim]`` latents.

        Each image fills one tubelet (repeated along time); ``normalize`` applies the
        world model's parameter-free layer norm.
        """
        clip = frames.unsqueeze(2).expand(-1, -1, self.config.tubelet_size, -1, -1)
        latents = self(clip)
        if normalize:
            latents = F.layer_norm(latents, (latents.shape[-1],))
        return latents
