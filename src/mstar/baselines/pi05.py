"""pi0.5 without mstar: the naive recompute reference and openpi's policy server.

- `naive_velocity` and `naive_sample_actions`, the reference: at flow step ``k`` the prefix
  (image and prompt tokens, VLM expert) and the noisy actions (action expert) run jointly
  through every layer with openpi's mask: prefix tokens see the prefix only, action tokens see
  the prefix and each other. Nothing is cached; the KV-cached node must give the same
  velocities at every step.
- `DenseKVSampler`: openpi's ``sample_actions`` with ``use_cache``, batch 1: the prefix's
  keys and values kept once per layer in dense tensors, then the Euler steps attend to them.
- `OpenpiServer`: what openpi's policy server does, the baseline served pi0.5 is timed
  against: one ``infer`` at a time (preprocess, `DenseKVSampler`, postprocess), each part
  timed into a `mstar.bench.Meter`.
- `chunk_flops`: one action chunk's matmul FLOPs, counted on the server's ``infer``.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from time import perf_counter
from typing import Any, cast

import numpy as np
import torch
import torch.nn.functional as F

from mstar.bench.phases import Meter
from mstar.bench.runner import is_warmup
from mstar.engines.layers import apply_rotary
from mstar.graph import Emission
from mstar.runtime import Request
from mstar.zoo.pi05.model import PARTITION, Pi05Model
from mstar.zoo.pi05.modules import (
    AdaRMSNorm,
    GemmaLayer,
    GemmaRMSNorm,
    Pi05Weights,
    PrefixInput,
    flow_times,
    rope_tables,
)

__all__ = [
    "DenseKVSampler",
    "LayerKV",
    "OpenpiServer",
    "chunk_flops",
    "naive_sample_actions",
    "naive_velocity",
]

LayerKV = tuple[torch.Tensor, torch.Tensor]
"""One layer's (rotated) keys and values, each ``[kv_heads, tokens, head_dim]``."""


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


class DenseKVSampler:
    """openpi's ``sample_actions`` with ``use_cache``, batch 1, on dense tensors (no paging).

    The prefix runs once through the VLM layers, keeping each layer's (rotated) keys and values;
    every Euler step runs the action tokens through the action expert, attending to
    [prefix K/V ; their own K/V] (the prefix never sees the actions). The per-layer math is
    `naive_velocity`'s, split at the cache.
    """

    def __init__(self, weights: Pi05Weights) -> None:
        self.weights = weights
        cfg = weights.config
        self.heads, self.kv_heads, self.head_dim = (
            cfg.vlm.num_heads,
            cfg.vlm.num_kv_heads,
            cfg.vlm.head_dim,
        )
        self.times = flow_times(cfg.num_steps)
        self.dt = -1.0 / cfg.num_steps

    @torch.inference_mode()
    def embed_images(self, images: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Return the present cameras' projected image tokens ``[tokens, vlm width]``."""
        present = images[mask.bool()]
        width = self.weights.config.vlm.width
        if not present.shape[0]:
            return torch.zeros(0, width, dtype=self.weights.action_in_proj.weight.dtype)
        return self.weights.embed_images(present).flatten(0, 1)

    def _qkv(
        self, layer: GemmaLayer, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        n = h.shape[0]
        attn = layer.self_attn
        q = attn.q_proj(h).view(n, self.heads, self.head_dim)
        k = attn.k_proj(h).view(n, self.kv_heads, self.head_dim)
        v = attn.v_proj(h).view(n, self.kv_heads, self.head_dim)
        q = apply_rotary(q, cos.to(q.dtype), sin.to(q.dtype))
        k = apply_rotary(k, cos.to(k.dtype), sin.to(k.dtype))
        return q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)  # heads first

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out = F.scaled_dot_product_attention(
            q[None],
            k[None],
            v[None],
            scale=self.head_dim**-0.5,
            enable_gqa=self.heads != self.kv_heads,
        )
        return out[0].transpose(0, 1).reshape(q.shape[1], self.heads * self.head_dim)

    @torch.inference_mode()
    def prefill(self, prefix: PrefixInput) -> list[LayerKV]:
        """Run the prefix through the VLM expert (bidirectional); return every layer's K/V."""
        w, cfg = self.weights, self.weights.config
        x = w.embed_prefix(prefix)
        cos, sin = rope_tables(torch.arange(x.shape[0]), cfg.vlm.head_dim, cfg.rope_theta)
        cache: list[LayerKV] = []
        blocks = w.language_model.blocks
        for i, layer in enumerate(blocks):
            q, k, v = self._qkv(layer, layer.input_layernorm(x), cos, sin)
            cache.append((k, v))
            x = x + layer.self_attn.o_proj(self._attend(q, k, v))
            # The last block's MLP feeds nothing but the VLM's (unused) final norm; openpi computes
            # it, mstar does not: it is left out here too, so both do the same work.
            if i < len(blocks) - 1:
                x = x + layer.mlp(layer.post_attention_layernorm(x))
        return cache

    @torch.inference_mode()
    def velocity(
        self, cache: Sequence[LayerKV], actions: torch.Tensor, time: float
    ) -> torch.Tensor:
        """Return the velocity ``[H, action_dim]`` of the noisy actions at flow ``time``."""
        w, cfg = self.weights, self.weights.config
        num_prefix = cache[0][0].shape[1]
        x = w.action_in_proj(actions.to(w.action_in_proj.weight.dtype))
        h_len = x.shape[0]
        cond = w.condition(torch.tensor([time], dtype=torch.float32)).expand(h_len, -1)
        positions = torch.arange(num_prefix, num_prefix + h_len)
        cos, sin = rope_tables(positions, cfg.vlm.head_dim, cfg.rope_theta)
        for layer, (k_prefix, v_prefix) in zip(w.gemma_expert.blocks, cache, strict=True):
            h, gate1 = cast(AdaRMSNorm, layer.input_layernorm)(x, cond)
            q, k, v = self._qkv(layer, h, cos, sin)
            out = self._attend(q, torch.cat([k_prefix, k], dim=1), torch.cat([v_prefix, v], dim=1))
            x = x + layer.self_attn.o_proj(out) * gate1
            h, gate2 = cast(AdaRMSNorm, layer.post_attention_layernorm)(x, cond)
            x = x + layer.mlp(h) * gate2
        final, _gate = cast(AdaRMSNorm, w.gemma_expert.norm)(x, cond)
        return cast(torch.Tensor, w.action_out_proj(final)).float()

    @torch.inference_mode()
    def flow(self, cache: Sequence[LayerKV], noise: torch.Tensor) -> torch.Tensor:
        """Integrate from ``noise`` (t = 1) to the actions (t = 0) in ``num_steps`` Euler steps."""
        x = noise.float()
        for t in self.times:
            x = x + self.dt * self.velocity(cache, x, t)
        return x


class OpenpiServer:
    """openpi's policy server in process: one ``infer`` at a time, in a worker thread.

    ``infer`` is the policy's: input transforms (`Pi05Model.preprocess`), the sampler
    (`DenseKVSampler`), output transforms (`Pi05Model.postprocess`). Its `meter` accounts the
    seconds of each part of every measured request (warm-up ones skipped), one count per
    request: ``preprocess``, ``vision``, ``prefix``, ``flow``, ``postprocess``.
    """

    def __init__(self, model: Pi05Model, weights: Pi05Weights) -> None:
        self.model = model
        self.sampler = DenseKVSampler(weights)
        self.meter = Meter()
        self.lock = asyncio.Lock()
        # The same torch threads as this thread (a new thread's OpenMP pool starts at every core).
        self.executor = ThreadPoolExecutor(
            1,
            thread_name_prefix="openpi",
            initializer=functools.partial(torch.set_num_threads, torch.get_num_threads()),
        )
        self.thread_torch_threads = 0

    async def act(self, request_id: str, obs: Mapping[str, Any]) -> np.ndarray:
        """Serve one observation after those before it; return its actions ``[H, robot_dof]``."""
        async with self.lock:
            return await asyncio.get_running_loop().run_in_executor(
                self.executor, self.infer, request_id, obs
            )

    def infer(self, request_id: str, obs: Mapping[str, Any]) -> np.ndarray:
        """Run one request start to end (the worker thread)."""
        self.thread_torch_threads = torch.get_num_threads()
        clock, meter = perf_counter, self.meter
        t0 = clock()
        prepared = self.model.preprocess(Request("act", dict(obs)))
        vision, noise = prepared.inputs["vision"], prepared.inputs["llm"]["flow"]["x"]
        t1 = clock()
        embeds = self.sampler.embed_images(vision["images"], vision["image_mask"])
        t2 = clock()
        cache = self.sampler.prefill(PrefixInput(embeds, vision["token_ids"]))
        t3 = clock()
        actions = self.sampler.flow(cache, noise)
        t4 = clock()
        emission = Emission(PARTITION, "action_gen", "llm", "actions", "action", actions)
        out = self.model.postprocess(request_id, emission).data
        t5 = clock()
        if not is_warmup(request_id):  # the figures cover the measured requests only
            for name, seconds in (
                ("preprocess", t1 - t0),
                ("vision", t2 - t1),
                ("prefix", t3 - t2),
                ("flow", t4 - t3),
                ("postprocess", t5 - t4),
            ):
                meter.add(name, seconds)
        return cast(np.ndarray, out)

    def close(self) -> None:
        """Stop the worker thread."""
        self.executor.shutdown()


def chunk_flops(server: OpenpiServer, observations: Sequence[Mapping[str, Any]]) -> float:
    """Return the mean FLOPs of one action chunk over ``observations``, counted on ``infer``.

    Matmuls and convolutions (torch's `FlopCounterMode`); attention's ``softmax(QK^T) V`` is
    not counted (on CPU it is not a registered op), nor are norms and activations. The calls
    are named as warm-up, so the server's meter does not account them.
    """
    from torch.utils.flop_counter import FlopCounterMode

    total = 0
    for obs in observations:
        with FlopCounterMode(display=False) as counter:
            server.infer("warmup-flops", obs)
        total += counter.get_total_flops()
    return total / len(observations)
