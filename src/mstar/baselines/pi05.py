"""The naive pi0.5 sampler, kept as the reference: every flow step recomputes prefix and suffix.

At step ``k`` the prefix (image and prompt tokens, VLM expert) and the noisy actions (action
expert) run jointly through every layer with openpi's mask: prefix tokens see the prefix only,
action tokens see the prefix and each other. Nothing is cached; the KV-cached node must give
the same velocities at every step.
"""

from __future__ import annotations

from typing import cast

import torch
import torch.nn.functional as F

from mstar.engines.layers import apply_rotary
from mstar.zoo.pi05.modules import (
    AdaRMSNorm,
    GemmaRMSNorm,
    Pi05Weights,
    PrefixInput,
    flow_times,
    rope_tables,
)

__all__ = ["naive_sample_actions", "naive_velocity"]


@torch.inference_mode()
def naive_velocity(
    weights: Pi05Weights, prefix: PrefixInput, actions: torch.Tensor, time: float
) -> torch.Tensor:
    """Return the action expert's velocity ``[H, action_dim]`` for one request, recomputing all."""
    cfg = weights.config
    x0 = weights.embed_prefix(prefix)
    n0 = x0.shape[0]
    x1 = weights.action_in_proj(actions.to(weights.action_in_proj.weight.dtype)).to(
        weights.compute_dtype
    )
    h_len = x1.shape[0]
    cond = weights.condition(torch.tensor([time], dtype=torch.float32)).expand(h_len, -1)
    total = n0 + h_len
    cos, sin = rope_tables(torch.arange(total), cfg.vlm.head_dim, cfg.rope_theta)
    visible = torch.ones(total, total, dtype=torch.bool)
    visible[:n0, n0:] = False  # the prefix never sees the actions
    heads, kv_heads, dim = cfg.vlm.num_heads, cfg.vlm.num_kv_heads, cfg.vlm.head_dim
    for layer0, layer1 in zip(
        weights.language_model.blocks, weights.gemma_expert.blocks, strict=True
    ):
        norm0 = cast(GemmaRMSNorm, layer0.input_layernorm)
        norm1 = cast(AdaRMSNorm, layer1.input_layernorm)
        h0 = norm0(x0)
        h1, gate1 = norm1(x1, cond)
        q = torch.cat([layer0.self_attn.q_proj(h0), layer1.self_attn.q_proj(h1)]).view(
            total, heads, dim
        )
        k = torch.cat([layer0.self_attn.k_proj(h0), layer1.self_attn.k_proj(h1)]).view(
            total, kv_heads, dim
        )
        v = torch.cat([layer0.self_attn.v_proj(h0), layer1.self_attn.v_proj(h1)]).view(
            total, kv_heads, dim
        )
        q = apply_rotary(q, cos.to(q.dtype), sin.to(q.dtype))
        k = apply_rotary(k, cos.to(k.dtype), sin.to(k.dtype))
        out = (
            F.scaled_dot_product_attention(
                q.transpose(0, 1)[None],
                k.transpose(0, 1)[None],
                v.transpose(0, 1)[None],
                attn_mask=visible,
                scale=dim**-0.5,
                enable_gqa=heads != kv_heads,
            )[0]
            .transpose(0, 1)
            .reshape(total, heads * dim)
        )
        x0 = x0 + layer0.self_attn.o_proj(out[:n0])
        x0 = x0 + layer0.mlp(layer0.post_attention_layernorm(x0))
        x1 = x1 + layer1.self_attn.o_proj(out[n0:]) * gate1
        h, gate2 = cast(AdaRMSNorm, layer1.post_attention_layernorm)(x1, cond)
        x1 = x1 + layer1.mlp(h) * gate2
    final, _gate = cast(AdaRMSNorm, weights.gemma_expert.norm)(x1, cond)
    return cast(
        torch.Tensor, weights.action_out_proj(final.to(weights.action_out_proj.weight.dtype))
    ).float()


@torch.inference_mode()
def naive_sample_actions(
    weights: Pi05Weights, prefix: PrefixInput, noise: torch.Tensor
) -> torch.Tensor:
    """Integrate the flow from ``noise`` (t = 1) to actions (t = 0) in ``num_steps`` Euler steps."""
    steps = weights.config.num_steps
    dt = -1.0 / steps
    x = noise.float()
    for time in flow_times(steps):
        x = x + dt * naive_velocity(weights, prefix, x, time)
    return x
