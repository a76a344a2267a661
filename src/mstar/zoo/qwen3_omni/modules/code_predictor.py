"""The talker's code predictor: a small dense decoder that draws codebooks 1..G-1 of each frame.

For every talker step it runs a fixed 15-step autoregressive loop with a cache of its own,
started afresh each frame (at most ``G + 1`` = 17 positions), so the cache is a dense tensor
per batch rather than a paged one; the frames of all requests in a talker step run as one
batch::

    position   0               1                 2                    ...  G-1
    input      talker hidden   embed0(code 0)    cp_embed[0](code 1)  ...  cp_embed[G-3](code G-2)
    head       -               lm_head[0]        lm_head[1]           ...  lm_head[G-2]
    draws      -               code 1            code 2               ...  code G-1

Module names follow the checkpoint below ``talker.code_predictor.``: ``model.layers.{i}``
(q/k/v/o_proj, q_norm / k_norm, a dense SiLU MLP), ``model.norm``,
``model.codec_embedding.{k}`` and ``lm_head.{k}`` for k = 0..G-2.
"""

from __future__ import annotations

from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from mstar.engines.layers import GatedMLP, RMSNorm, apply_rotary
from mstar.zoo.qwen3_omni.config import CodePredictorConfig
from mstar.zoo.qwen3_omni.modules.sampling import DrawParams, draw

__all__ = ["CodePredictor"]


class _Attention(nn.Module):
    def __init__(self, config: CodePredictorConfig) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        hidden = config.hidden_size
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=False)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: tuple[torch.Tensor, torch.Tensor],
        start: int,
    ) -> torch.Tensor:
        """Attend ``x`` ``[B, T, hidden]`` (positions ``start..start+T``) over the frame's cache."""
        batch, steps, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(batch, steps, self.num_heads, self.head_dim))
        k = self.k_norm(self.k_proj(x).view(batch, steps, self.num_kv_heads, self.head_dim))
        v = self.v_proj(x).view(batch, steps, self.num_kv_heads, self.head_dim)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        k_cache, v_cache = cache
        k_cache[:, :, start : start + steps] = k.transpose(1, 2)
        v_cache[:, :, start : start + steps] = v.transpose(1, 2)
        keys = k_cache[:, :, : start + steps]
        values = v_cache[:, :, : start + steps]
        group = self.num_heads // self.num_kv_heads
        keys = keys.repeat_interleave(group, dim=1)
        values = values.repeat_interleave(group, dim=1)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), keys, values, is_causal=steps > 1 and start == 0
        )
        return cast(torch.Tensor, self.o_proj(out.transpose(1, 2).reshape(batch, steps, -1)))


class _Layer(nn.Module):
    def __init__(self, config: CodePredictorConfig) -> None:
        super().__init__()
        self.self_attn = _Attention(config)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: tuple[torch.Tensor, torch.Tensor],
        start: int,
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cache, start)
        return x + self.mlp(self.post_attention_layernorm(x))


class _Backbone(nn.Module):
    def __init__(self, config: CodePredictorConfig) -> None:
        super().__init__()
        self.layers = nn.ModuleList([_Layer(config) for _ in range(config.num_layers)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.codec_embedding = nn.ModuleList(
            [
                nn.Embedding(config.vocab_size, config.hidden_size)
                for _ in range(config.num_code_groups - 1)
            ]
        )


class CodePredictor(nn.Module):
    """Draw the residual codebooks of a batch of frames (see the module docstring)."""

    def __init__(self, config: CodePredictorConfig) -> None:
        super().__init__()
        self.config = config
        self.model = _Backbone(config)
        self.lm_head = nn.ModuleList(
            [
                nn.Linear(config.hidden_size, config.vocab_size, bias=False)
                for _ in range(config.num_code_groups - 1)
            ]
        )
        dim = config.head_dim
        inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
        angles = torch.outer(
            torch.arange(config.num_code_groups + 1, dtype=torch.float32), inv_freq
        )
        angles = torch.cat((angles, angles), dim=-1)
        self._cos = angles.cos()
        self._sin = angles.sin()

    def embed_residuals(self, codes: torch.Tensor) -> torch.Tensor:
        """Return ``sum_k codec_embedding[k-1](codes[:, k-1])`` over codebooks 1..G-1 (``codes``
        ``[B, G-1]``)."""
        embeddings = cast(list[nn.Embedding], list(self.model.codec_embedding))
        total = embeddings[0](codes[:, 0])
        for k in range(1, codes.shape[1]):
            total = total + embeddings[k](codes[:, k])
        return total

    @torch.no_grad()
    def generate(
        self,
        talker_hidden: torch.Tensor,
        code0_embeds: torch.Tensor,
        params: DrawParams,
        generators: list[torch.Generator | None],
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Draw codebooks 1..G-1 for a batch of frames.

        Args:
            talker_hidden: ``[B, hidden]`` the talker's last hidden state (final norm applied).
            code0_embeds: ``[B, hidden]`` the talker's embedding of the frame's codebook-0 code.
            params: How to draw.
            generators: One per frame.

        Returns:
            ``codes`` ``[B, G-1]`` and, per codebook 1..G-1, its input embedding ``[B, hidden]``.
        """
        config = self.config
        batch = talker_hidden.shape[0]
        steps = config.num_code_groups + 1
        dtype, device = talker_hidden.dtype, talker_hidden.device
        caches = [
            (
                torch.zeros(
                    batch, config.num_kv_heads, steps, config.head_dim, dtype=dtype, device=device
                ),
                torch.zeros(
                    batch, config.num_kv_heads, steps, config.head_dim, dtype=dtype, device=device
                ),
            )
            for _ in range(config.num_layers)
        ]
        cos_table = self._cos.to(device, dtype)
        sin_table = self._sin.to(device, dtype)
        embeddings = cast(list[nn.Embedding], list(self.model.codec_embedding))
        heads = cast(list[nn.Linear], list(self.lm_head))
        x = torch.stack((talker_hidden, code0_embeds), dim=1)
        start = 0
        codes: list[torch.Tensor] = []
        embeds: list[torch.Tensor] = []
        for k in range(config.num_code_groups - 1):
            width = x.shape[1]
            cos = cos_table[start : start + width].view(1, width, 1, -1)
            sin = sin_table[start : start + width].view(1, width, 1, -1)
            h = x
            for layer, cache in zip(self.model.layers, caches, strict=True):
                h = layer(h, cos, sin, cache, start)
            h = self.model.norm(h[:, -1])
            code = draw(heads[k](h), params, generators)
            codes.append(code)
            embed = embeddings[k](code)
            embeds.append(embed)
            start += width
            x = embed.unsqueeze(1)
        return torch.stack(codes, dim=1), embeds
