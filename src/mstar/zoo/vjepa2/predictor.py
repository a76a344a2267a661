"""The action-conditioned predictor (V-JEPA 2-AC), runnable whole or one frame block at a time.

Parameter names follow the published checkpoints: ``predictor_embed`` (encoder width to
predictor width), ``action_encoder``, ``state_encoder``, ``extrinsics_encoder`` (present in
the checkpoint, unused without extrinsics), ``predictor_blocks.{i}.*`` (pre-norm blocks with
``attn.qkv``/``attn.proj`` and ``mlp.fc1``/``fc2``), ``predictor_norm`` and ``predictor_proj``.

Frame ``t`` becomes the block ``[action_t, state_t, patches of z_t]``; patch tokens carry
(t, row, column) RoPE positions, the action and state tokens only t. Attention is
block-causal across frames and full within a block, so the keys and values of frames
``0..t-1`` do not depend on frame ``t``: `forward` runs every frame at once (the upstream
computation); `PagedACPredictor` is the same predictor as a `PagedModel` for the KV-cache
engine, where a step appends one frame block per rollout row (a payload chunk of
``frame_tokens`` positions whose mask is full: the block sees itself and every earlier
frame) against the row's cached frames.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from mstar.engines.interfaces import PagedKVContext
from mstar.engines.kv_cache import KVCacheSpec
from mstar.zoo.vjepa2.config import PredictorConfig
from mstar.zoo.vjepa2.encoder import MLP, Attention, fuse_blocks
from mstar.zoo.vjepa2.rope import token_tables

__all__ = [
    "ACBlock",
    "ACPredictor",
    "Attend",
    "FrameInput",
    "PagedACPredictor",
    "block_causal_mask",
]

Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""``attend(layer, q, k, v) -> out``, all ``[B, M, heads, head_dim]`` (q, k rotated)."""


def block_causal_mask(
    num_frames: int, frame_tokens: int, device: torch.device | None = None
) -> torch.Tensor:
    """Return the ``[T*F, T*F]`` boolean mask: a token sees every token of its frame and earlier
    ones."""
    frame = torch.arange(num_frames * frame_tokens, device=device) // frame_tokens
    return frame[None, :] <= frame[:, None]


class ACBlock(nn.Module):
    """Pre-norm block whose attention is delegated (full-sequence SDPA or a paged cache)."""

    def __init__(self, dim: int, num_heads: int, mlp_hidden: int, eps: float) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=eps)
        self.attn = Attention(dim, num_heads)
        self.norm2 = nn.LayerNorm(dim, eps=eps)
        self.mlp = MLP(dim, mlp_hidden)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attend: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
    ) -> torch.Tensor:
        """Apply the block to ``[B, M, dim]`` tokens."""
        q, k, v = self.attn.qkv_heads(self.norm1(x), cos, sin)
        x = x + self.attn.proj(attend(q, k, v).flatten(2))
        return x + self.mlp(self.norm2(x))


class ACPredictor(nn.Module):
    """``VisionTransformerPredictorAC`` without extrinsics."""

    def __init__(self, cfg: PredictorConfig) -> None:
        super().__init__()
        self.config = cfg
        d = cfg.pred_dim
        self.predictor_embed = nn.Linear(cfg.embed_dim, d)
        self.action_encoder = nn.Linear(cfg.action_dim, d)
        self.state_encoder = nn.Linear(cfg.action_dim, d)
        self.extrinsics_encoder = nn.Linear(cfg.action_dim - 1, d)
        self.predictor_blocks = nn.ModuleList(
            ACBlock(d, cfg.num_heads, cfg.mlp_hidden, cfg.norm_eps) for _ in range(cfg.depth)
        )
        self.predictor_norm = nn.LayerNorm(d, eps=cfg.norm_eps)
        self.predictor_proj = nn.Linear(d, cfg.embed_dim)
        # Float32 RoPE tables per device, [max_frames, F, 1, head_dim]; kept out of the state
        # dict and of dtype casts (positions up to 31 need more than bf16's 8 bits).
        self._rope: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def fuse_for_inference(self) -> None:
        """Store every block's linears in the layout fastest for one frame block's tokens.

        Call this once the weights are loaded and the module is on its device and in its dtype
        (`load_predictor` does). In oneDNN's packed layout the linears give up their weights,
        so the predictor can only run inference afterwards (see `FusedLinear`).
        """
        fuse_blocks(self.predictor_blocks, (self.config.frame_tokens,))

    @staticmethod
    def _frame_tables(cfg: PredictorConfig) -> tuple[torch.Tensor, torch.Tensor]:
        """Return RoPE tables of every frame block: ``[max_frames, frame_tokens, 1, head_dim]``."""
        grid, cond = cfg.grid_size, cfg.cond_tokens
        frames = torch.arange(cfg.max_frames, dtype=torch.float64)[:, None].expand(
            -1, cfg.frame_tokens
        )
        patch = torch.arange(cfg.num_patches)
        cos_c, sin_c = token_tables(frames[:, :cond], None, None, cfg.head_dim)
        cos_p, sin_p = token_tables(
            frames[:, cond:], (patch // grid).double(), (patch % grid).double(), cfg.head_dim
        )
        cos = torch.cat([cos_c, cos_p], dim=1)[:, :, None, :]
        sin = torch.cat([sin_c, sin_p], dim=1)[:, :, None, :]
        return cos, sin

    def rope_tables(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Return the ``(cos, sin)`` tables of every frame block on ``device``."""
        tables = self._rope.get(device)
        if tables is None:
            cos, sin = self._frame_tables(self.config)
            tables = self._rope[device] = (cos.to(device), sin.to(device))
        return tables

    def embed(self, z: torch.Tensor, actions: torch.Tensor, states: torch.Tensor) -> torch.Tensor:
        """Return frame blocks ``[B, T, F, d]`` for latents ``[B, T, N, D]`` and ``[B, T, A]``
        conditions."""
        x = self.predictor_embed(z)
        a = self.action_encoder(actions).unsqueeze(2)
        s = self.state_encoder(states).unsqueeze(2)
        return torch.cat([a, s, x], dim=2)

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """Map frame blocks ``[B, T, F, d]`` to predicted latents ``[B, T, N, D]``."""
        patches = x[:, :, self.config.cond_tokens :]
        return self.predictor_proj(self.predictor_norm(patches))

    def forward_frames(
        self,
        z: torch.Tensor,
        actions: torch.Tensor,
        states: torch.Tensor,
        frame_index: torch.Tensor,
        attend: Attend,
    ) -> torch.Tensor:
        """Run ``T`` consecutive frames per row starting at ``frame_index[b]``.

        Args:
            z: ``[B, T, N, D]`` latents.
            actions: ``[B, T, action_dim]``.
            states: ``[B, T, action_dim]``.
            frame_index: ``[B]`` long, the frame position of each row's first frame.
            attend: Attention of each layer over whatever keys the caller holds.

        Returns:
            ``[B, T, N, D]``: each frame's prediction of the next latent (not normalised).
        """
        b, t = z.shape[:2]
        x = self.embed(z, actions, states)
        f = x.shape[2]
        table_cos, table_sin = self.rope_tables(x.device)
        rows = frame_index.to(x.device)[:, None] + torch.arange(t, device=x.device)
        cos = table_cos[rows].to(x.dtype).flatten(1, 2)  # [B, T*F, 1, head_dim]
        sin = table_sin[rows].to(x.dtype).flatten(1, 2)
        x = x.flatten(1, 2)
        for layer, block in enumerate(self.predictor_blocks):
            x = block(x, cos, sin, lambda q, k, v, layer=layer: attend(layer, q, k, v))
        return self.head(x.view(b, t, f, -1))

    def forward(self, z: torch.Tensor, actions: torch.Tensor, states: torch.Tensor) -> torch.Tensor:
        """Run all frames at once (the upstream computation).

        Args:
            z: ``[B, T * N, D]`` latents of ``T`` frames.
            actions: ``[B, T, action_dim]``.
            states: ``[B, T, action_dim]``.

        Returns:
            ``[B, T * N, D]`` predictions (frame t's tokens predict frame t + 1).
        """
        cfg = self.config
        b, t = actions.shape[:2]
        mask = block_causal_mask(t, cfg.frame_tokens, z.device)

        def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            out = F.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask
            )
            return out.transpose(1, 2)

        start = torch.zeros(b, dtype=torch.long, device=z.device)
        out = self.forward_frames(z.view(b, t, cfg.num_patches, -1), actions, states, start, attend)
        return out.flatten(1, 2)


@dataclass(frozen=True, slots=True)
class FrameInput:
    """The payload of one frame block of one rollout row (what a step appends).

    Attributes:
        latent: ``[N, D]`` normalised latent of the frame.
        action: ``[action_dim]`` action taken at the frame.
        state: ``[action_dim]`` pose at the frame.
        frame: The frame's index in the rollout (its RoPE time position).
    """

    latent: torch.Tensor
    action: torch.Tensor
    state: torch.Tensor
    frame: int


class PagedACPredictor(nn.Module):
    """The predictor as a `PagedModel`: every chunk of a step is one `FrameInput` block.

    Returns, per row of the flat batch, the projected prediction ``[T, embed_dim]`` (the
    rows of a block's action and state tokens come along, unused: one product instead of a
    gather per step).
    """

    def __init__(self, predictor: ACPredictor) -> None:
        super().__init__()
        self.predictor = predictor
        cfg = predictor.config
        self.scale = cfg.head_dim**-0.5
        dtype = next((p.dtype for p in predictor.parameters()), torch.float32)
        self._spec = KVCacheSpec(cfg.depth, cfg.num_heads, cfg.head_dim, dtype)

    @property
    def kv_cache_spec(self) -> KVCacheSpec:
        """Return the cache geometry: one K/V head per attention head, the weights' dtype."""
        return self._spec

    @property
    def max_position(self) -> int:
        """Return the longest row: every frame block the RoPE tables cover."""
        cfg = self.predictor.config
        return cfg.max_frames * cfg.frame_tokens

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: PagedKVContext
    ) -> torch.Tensor:
        """Run the step's frame blocks through every layer against the rows' cached frames."""
        p = self.predictor
        frames: list[FrameInput] = [chunk.payload for chunk in ctx.step.chunks]
        dtype = self._spec.dtype
        device = input_ids.device
        z = torch.stack([f.latent for f in frames]).to(device, dtype)[:, None]
        actions = torch.stack([f.action for f in frames]).to(device, dtype)[:, None]
        states = torch.stack([f.state for f in frames]).to(device, dtype)[:, None]
        x = p.embed(z, actions, states).flatten(0, 2)[None]  # [1, rows * F, d]: the flat batch
        table_cos, table_sin = p.rope_tables(device)
        index = torch.tensor([f.frame for f in frames], device=device)
        cos = table_cos[index].to(dtype).flatten(0, 1)[None]  # [1, rows * F, 1, head_dim]
        sin = table_sin[index].to(dtype).flatten(0, 1)[None]
        tokens = x.shape[1]
        scale = self.scale

        def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return ctx.attend(layer, q[0], k[0], v[0], scale).view(1, tokens, *q.shape[2:])

        for layer, block in enumerate(p.predictor_blocks):
            x = block(x, cos, sin, lambda q, k, v, layer=layer: attend(layer, q, k, v))
        return cast(torch.Tensor, p.predictor_proj(p.predictor_norm(x[0])))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The predictor samples nothing (its walks return rows)."""
        raise NotImplementedError("the V-JEPA 2 predictor returns rows; it has no logits")
