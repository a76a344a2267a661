"""BAGEL's dense reference: each CFG context recomputed with its own dense cache, in fp32.

Nothing is paged, forked or shared: every context is built from its own items
(`branch_items`) into plain per-layer key/value tensors, and every step of the flow queries
the branches it needs (`FlowSpec.branches`) over them. The paged, forked, branch-skipping
walks must give the same latents and the same PNG bytes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from mstar.zoo.bagel.context import ImageItem, Item, TextItem, branch_items
from mstar.zoo.bagel.flow import CFG_IMG, CFG_TEXT, COND, FlowSpec, guidance
from mstar.zoo.bagel.latents import decode_image, latent_grid, vae_tokens
from mstar.zoo.bagel.vae import FluxVAE
from mstar.zoo.bagel.weights import BagelWeights, ImageInput, TextInput

__all__ = ["DenseContext", "build_context", "reference_generate", "reference_understand"]


@dataclass
class DenseContext:
    """One context's dense cache: per layer keys and values ``[T, kv_heads, head_dim]``."""

    weights: BagelWeights
    keys: list[torch.Tensor] = field(default_factory=list)
    values: list[torch.Tensor] = field(default_factory=list)
    rope: int = 0
    num_passes: int = 0  # LLM passes that read this context (queries)

    def _run(self, payload: TextInput | ImageInput, *, causal: bool, write: bool) -> torch.Tensor:
        w = self.weights
        cfg = w.config.llm
        x, rope, is_gen = w.embed_input(payload)
        n = x.shape[0]
        past = self.keys[0].shape[0] if self.keys else 0
        # full attention (images, queries): no mask, as the paged kernel runs it
        visible: torch.Tensor | None = None
        if causal:
            visible = torch.ones(n, past + n, dtype=torch.bool)
            visible[:, past:] = torch.ones(n, n, dtype=torch.bool).tril()
        new_k: list[torch.Tensor] = []
        new_v: list[torch.Tensor] = []

        def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            keys = torch.cat([self.keys[i], k]) if self.keys else k
            values = torch.cat([self.values[i], v]) if self.values else v
            new_k.append(keys)
            new_v.append(values)
            out = F.scaled_dot_product_attention(
                q.transpose(0, 1)[None],
                keys.transpose(0, 1)[None],
                values.transpose(0, 1)[None],
                attn_mask=visible,
                scale=cfg.head_dim**-0.5,
                enable_gqa=cfg.num_heads != cfg.num_kv_heads,
            )
            return out[0].transpose(0, 1)

        hidden = w.run(x, rope, is_gen, attend)
        if write:
            self.keys, self.values = new_k, new_v
            self.rope = payload.rope_end
        return hidden

    def add(self, payload: TextInput | ImageInput) -> None:
        """Append a payload to the cache (text causal, images full)."""
        self._run(payload, causal=isinstance(payload, TextInput), write=True)

    def velocity(self, x: torch.Tensor, positions: torch.Tensor, t: float) -> torch.Tensor:
        """Return the velocity ``[n, p*p*z]`` of noisy latents at time ``t``, reading the cache
        only."""
        self.num_passes += 1
        query = ImageInput("flow", x, self.rope, positions, t)
        hidden = self._run(query, causal=False, write=False)
        return self.weights.llm2vae(hidden[1:-1]).float()


@torch.inference_mode()
def build_context(weights: BagelWeights, vae: FluxVAE | None, items: list[Item]) -> DenseContext:
    """Prefill one context from its items: text, then each image's VAE and ViT tokens."""
    cfg = weights.config
    ctx = DenseContext(weights)
    for item in items:
        if isinstance(item, TextItem):
            ctx.add(TextInput(item.token_ids, ctx.rope))
            continue
        assert isinstance(item, ImageItem)
        if item.vae is not None:
            assert vae is not None
            p, down = cfg.latent_patch_size, cfg.latent_downsample
            h, w = item.vae.shape[1] // down, item.vae.shape[2] // down
            ctx.add(
                ImageInput(
                    "vae",
                    vae_tokens(vae, item.vae, p, item.vae_noise),
                    ctx.rope,
                    latent_grid(weights, h, w),
                    0.0,
                )
            )
        if item.vit is not None:
            ctx.add(ImageInput("vit", weights.embed_vit(item.vit), ctx.rope))
    return ctx


@torch.inference_mode()
def reference_generate(
    weights: BagelWeights,
    vae: FluxVAE,
    items: list[Item],
    spec: FlowSpec,
    noise: torch.Tensor,
    think_ids: list[int] | None = None,
) -> tuple[torch.Tensor, np.ndarray, int]:
    """Generate one image densely: return its final latent tokens, its uint8 pixels and the LLM
    passes.

    ``think_ids``: the planning text of think mode (`reference_understand` over the items),
    which the full context takes after the items.
    """
    tokens = weights.config.tokens
    think = (
        None
        if think_ids is None
        else TextItem(torch.tensor([tokens.bos, *think_ids, tokens.eos], dtype=torch.long))
    )
    contexts = {
        branch: build_context(weights, vae, its)
        for branch, its in branch_items(items, think).items()
    }
    positions = latent_grid(weights, spec.height, spec.width)
    x = noise.float()
    for k in range(spec.num_steps):
        t, dt = spec.step(k)
        run = spec.branches(k)
        v = {b: contexts[b].velocity(x, positions, t) for b in run}
        x = x - guidance(spec, v[COND], v.get(CFG_TEXT), v.get(CFG_IMG)) * dt
    passes = sum(c.num_passes for c in contexts.values())
    return x, decode_image(weights, vae, x, spec.height, spec.width), passes


@torch.inference_mode()
def reference_understand(
    weights: BagelWeights, vae: FluxVAE | None, items: list[Item], max_tokens: int
) -> list[int]:
    """Answer densely and greedily: tokens sampled after ``<|im_start|>`` until ``<|im_end|>``
    (excluded).

    Think mode's planning text is such an answer too (over the items of an image request).
    """
    ctx = build_context(weights, vae, items)
    eos = weights.config.tokens.eos
    token = weights.config.tokens.bos
    out: list[int] = []
    for _ in range(max_tokens):
        hidden = ctx._run(TextInput(torch.tensor([token]), ctx.rope), causal=True, write=True)
        token = int(weights.compute_logits(hidden[-1:]).argmax(-1))
        if token == eos:
            break
        out.append(token)
    return out
