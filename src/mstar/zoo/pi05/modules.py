"""pi0.5's weights and its forward pass on the paged KV cache (openpi's ``PI0Pytorch``, pi05).

Module names follow the published PyTorch checkpoint after its prefixes are taken off (see
`mstar.zoo.pi05.checkpoint`):

```
vision_tower.*                      transformers' SiglipVisionModel (So400m/14, no pooling head)
multi_modal_projector.linear        SigLIP width -> VLM width
language_model.embed_tokens         the VLM's (tied) token embedding
language_model.layers.{i}.*         Gemma blocks: self_attn.{q,k,v,o}_proj, mlp.{gate,up,down}_proj,
                                    input_layernorm / post_attention_layernorm (weights, zero-centred)
gemma_expert.layers.{i}.*           the action expert's blocks; its norms are adaptive:
                                    input_layernorm.dense / post_attention_layernorm.dense, norm.dense
action_in_proj, action_out_proj     action_dim <-> expert width
time_mlp_in, time_mlp_out           the timestep MLP (its output conditions every adaptive norm)
```

A step's rows come in chunks of two kinds: **prefix** chunks (`PrefixInput`: image tokens and
prompt tokens, run by the VLM, expert 0, written to the cache) and **action** chunks
(`ActionInput`: the noisy actions at one flow time, run by the action expert, expert 1,
read-only over their request's prefix). Each expert keeps its own residual stream (their widths
differ); at every layer both project to queries, keys and values of one shape and attend jointly
through the cache. The model returns, per row, the velocity of an action row (zeros for prefix
rows, whose only product is their cache).

Tensor parallelism (`mstar.engines.parallel`; the ``llm`` node in a ``tensor_parallel`` group):
`Pi05Weights.shard_` keeps a rank's part of both experts, Megatron's split per expert:

```
q, k, v          column-parallel: the rank's query heads; with fewer KV heads than ranks (the
                 Gemma variants' 8 over 1) each rank keeps the KV head they read (replicated)
o, down          row-parallel: a partial sum per expert, one all-reduce each
gate, up         column-parallel (GeGLU: each rank its columns of both)
embed_tokens     vocabulary-parallel: the rank's ids, the lookup summed over the group
kept whole       the norms, every adaptive norm's conditioning map (one row per chunk), the
                 time MLP and the action projections, SigLIP and the projector (the vision
                 node's, never sharded)
```

Each rank runs every step on its shard; the leader returns the velocities. Nothing outside the
steps changes the model (the node keeps its flow state in its inputs), so no method is mirrored.

`Pi05Weights.fuse_for_inference` (called when the engine's node is built) stores each block's
q/k/v, gate/up, output and down projections as `FusedLinear`s in the layout that multiplies
fastest for the rows they see, and every adaptive norm's conditioning map as one product over
a step's flow times (one row per chunk, not per action row). The checkpoint-named modules keep
working unfused until then; in the dense layouts they stay views of the fused weights.

In bfloat16 the weights follow openpi's mixed policy (`Pi05Weights.to_precision`): the blocks,
SigLIP's encoder, the projector and the token embedding in bfloat16; SigLIP's patch and position
embeddings, every RMSNorm (the adaptive norms' conditioning maps with them), the time MLP and the
action projections in float32. Activations enter the blocks in bfloat16, the conditioning and
the velocities stay float32.
"""  # noqa: E501 (a table or diagram)

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar, Literal, cast

import torch
import torch.nn.functional as F
from torch import nn
from transformers import SiglipVisionConfig, SiglipVisionModel

from mstar.engines.interfaces import PagedKVContext
from mstar.engines.kv_cache import KVCacheSpec
from mstar.engines.layers import (
    FusedLinear,
    GatedMLP,
    WeightSlice,
    apply_rotary,
    attention_slices,
    head_counts,
    shard_module_,
    vocab_parallel_embedding,
)
from mstar.engines.parallel import TensorShard, tensor_payload
from mstar.zoo.pi05.config import GemmaConfig, Pi05Config

__all__ = [
    "FLOAT32_IN_BFLOAT16",
    "ActionInput",
    "AdaRMSNorm",
    "GemmaLayer",
    "GemmaRMSNorm",
    "GemmaStack",
    "Pi05Weights",
    "PrefixInput",
    "flow_times",
    "rope_tables",
    "time_embedding",
]

PREFIX_EXPERT = 0
ACTION_EXPERT = 1


FLOAT32_IN_BFLOAT16 = (
    "vision_tower.embeddings.",
    "language_model.norm.",
    "gemma_expert.norm.",
    "action_in_proj.",
    "action_out_proj.",
    "time_mlp_in.",
    "time_mlp_out.",
)
"""Prefixes of the parameters openpi keeps in float32 when the model runs in bfloat16 (with
every block's ``input_layernorm`` and ``post_attention_layernorm``)."""
_FLOAT32_NORMS = (".input_layernorm.", ".post_attention_layernorm.")


@tensor_payload
@dataclass(frozen=True, slots=True)
class PrefixInput:
    """A request's prefix: its valid image tokens (already projected), then its prompt ids.

    Masked cameras and prompt padding are left out: they are attended by nothing and do not
    advance positions (openpi's ``cumsum(mask) - 1``), so dropping them changes no value.
    """

    image_embeds: torch.Tensor  # [num_image_tokens, vlm width]
    token_ids: torch.Tensor  # [num_prompt_tokens] int64

    @property
    def num_tokens(self) -> int:
        """Count the prefix's tokens."""
        return int(self.image_embeds.shape[0] + self.token_ids.shape[0])


@tensor_payload
@dataclass(frozen=True, slots=True)
class ActionInput:
    """One flow-matching step of a request: its noisy actions ``[H, action_dim]`` at time ``t``."""

    actions: torch.Tensor
    time: float


class GemmaRMSNorm(nn.Module):
    """Gemma's RMSNorm: ``x / rms(x) * (1 + weight)`` in float32 (the weight is zero-centred)."""

    def __init__(self, width: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(width))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalise the last dimension."""
        x32 = x.float()
        y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * (1.0 + self.weight.float())).to(x.dtype)


class AdaRMSNorm(nn.Module):
    """The action expert's adaptive RMSNorm: a dense map of the conditioning gives scale, shift,
    gate."""

    def __init__(self, width: int, eps: float) -> None:
        super().__init__()
        self.dense = nn.Linear(width, 3 * width)
        self.eps = eps

    def forward(self, x: torch.Tensor, cond: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Return ``rms(x) * (1 + scale) + shift`` and the gate, for rows ``x`` and their
        ``cond``."""
        return self.modulate(x, self.dense(cond.to(self.dense.weight.dtype)))

    def modulate(
        self, x: torch.Tensor, modulation: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Return the normalised rows and the gate, given ``dense(cond)`` (``[rows, 3 *
        width]``)."""
        scale, shift, gate = modulation.chunk(3, dim=-1)
        x32 = x.float()
        y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        y = y * (1.0 + scale.float()) + shift.float()
        return y.to(x.dtype), gate.to(x.dtype)


class _Attention(nn.Module):
    """Query, key, value and output projections of one Gemma block (no biases)."""

    def __init__(self, cfg: GemmaConfig) -> None:
        super().__init__()
        self.shape = (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)  # a shard's: its heads
        self.q_proj = nn.Linear(cfg.width, cfg.num_heads * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.width, cfg.num_kv_heads * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.width, cfg.num_kv_heads * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.width, bias=False)
        self.qkv: FusedLinear | None = None
        self.o: FusedLinear | None = None
        self.shard: TensorShard | None = None

    def shard_slices(self, prefix: str, shard: TensorShard) -> dict[str, WeightSlice]:
        """This rank's heads, by parameter name under ``prefix`` (see `attention_slices`)."""
        heads, kv_heads, head_dim = self.shape
        projections = (self.q_proj, self.k_proj, self.v_proj, self.o_proj)
        return attention_slices(prefix, projections, heads, kv_heads, head_dim, shard)

    def fuse(self, rows: tuple[int, ...]) -> None:
        """Store q/k/v as one product and the output projection in their fastest layouts."""
        self.qkv = FusedLinear.of([self.q_proj, self.k_proj, self.v_proj], rows=rows)
        self.o = FusedLinear.of([self.o_proj], rows=rows)

    def project(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Return queries, keys and values ``[rows, heads, head_dim]`` of rows ``h``."""
        heads, kv_heads, head_dim = self.shape
        n = h.shape[0]
        if self.qkv is None:
            return (
                self.q_proj(h).view(n, heads, head_dim),
                self.k_proj(h).view(n, kv_heads, head_dim),
                self.v_proj(h).view(n, kv_heads, head_dim),
            )
        q, k, v = self.qkv(h).split(
            [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1
        )
        return (
            q.view(n, heads, head_dim),
            k.view(n, kv_heads, head_dim),
            v.reshape(n, kv_heads, head_dim),
        )

    def output(self, attended: torch.Tensor) -> torch.Tensor:
        """Project the attention's output ``[rows, heads * head_dim]`` back to the width (a
        shard's partial sums added up over the group)."""
        o = self.o(attended) if self.o is not None else cast(torch.Tensor, self.o_proj(attended))
        return o if self.shard is None else self.shard.all_reduce_(o.contiguous())


class GemmaLayer(nn.Module):
    """One Gemma block: attention and MLP, each behind its (plain or adaptive) norm."""

    def __init__(self, cfg: GemmaConfig, eps: float, adaptive: bool) -> None:
        super().__init__()
        self.self_attn = _Attention(cfg)
        self.mlp = GatedMLP(cfg.width, cfg.mlp_dim, activation="gelu_tanh")
        norm: type[nn.Module] = AdaRMSNorm if adaptive else GemmaRMSNorm
        self.input_layernorm = norm(cfg.width, eps)
        self.post_attention_layernorm = norm(cfg.width, eps)


class GemmaStack(nn.Module):
    """One expert's blocks and final norm (and, for the VLM, its token embedding)."""

    def __init__(
        self, cfg: GemmaConfig, vocab_size: int | None, eps: float, *, adaptive: bool
    ) -> None:
        super().__init__()
        self.config = cfg
        self.adaptive = adaptive
        self.embed_tokens = nn.Embedding(vocab_size, cfg.width) if vocab_size else None
        self.layers = nn.ModuleList(GemmaLayer(cfg, eps, adaptive) for _ in range(cfg.depth))
        self.norm: nn.Module = (
            AdaRMSNorm(cfg.width, eps) if adaptive else GemmaRMSNorm(cfg.width, eps)
        )

    @property
    def blocks(self) -> list[GemmaLayer]:
        """Return the blocks, typed."""
        return cast(list[GemmaLayer], list(self.layers))


class _Projector(nn.Module):
    def __init__(self, vision_width: int, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(vision_width, width)


def time_embedding(
    t: torch.Tensor, width: int, min_period: float, max_period: float
) -> torch.Tensor:
    """Return the sinusoidal embedding ``[rows, width]`` of flow times ``t`` ``[rows]`` (float64
    math).

    Periods are geometric from ``min_period`` to ``max_period``; the sine half comes first.
    """
    fraction = torch.linspace(0.0, 1.0, width // 2, dtype=torch.float64, device=t.device)
    period = min_period * (max_period / min_period) ** fraction
    angle = (2 * math.pi / period)[None, :] * t.double()[:, None]
    return torch.cat([angle.sin(), angle.cos()], dim=-1).float()


def flow_times(num_steps: int) -> list[float]:
    """Return the flow times of the Euler steps, as openpi accumulates them (float32, t += dt from
    1)."""
    t, dt = (
        torch.tensor(1.0, dtype=torch.float32),
        torch.tensor(-1.0 / num_steps, dtype=torch.float32),
    )
    times = []
    for _ in range(num_steps):
        times.append(float(t))
        t = t + dt
    return times


def rope_tables(
    positions: torch.Tensor, head_dim: int, theta: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return ``(cos, sin)`` ``[rows, 1, head_dim]`` (float32) for half-split rotary embedding."""
    inv_freq = 1.0 / theta ** (
        torch.arange(0, head_dim, 2, dtype=torch.float32, device=positions.device) / head_dim
    )
    angles = positions.float()[:, None] * inv_freq[None, :]
    angles = torch.cat([angles, angles], dim=-1)[:, None, :]
    return angles.cos(), angles.sin()


class Pi05Weights(nn.Module):
    """All of pi0.5's weights, and its step on the paged cache (a `PagedModel`,
    `SupportsTensorParallel`)."""

    supports_tensor_parallel: ClassVar[Literal[True]] = True

    def __init__(self, config: Pi05Config) -> None:
        super().__init__()
        self.config = config
        self.shard: TensorShard | None = None
        self.vocab_start, self.vocab_stop = 0, config.vocab_size  # the ids this shard holds
        v = config.vision
        self.vision_tower = SiglipVisionModel(
            SiglipVisionConfig(
                hidden_size=v.width,
                intermediate_size=v.mlp_dim,
                num_hidden_layers=v.depth,
                num_attention_heads=v.num_heads,
                image_size=v.image_size,
                patch_size=v.patch_size,
                layer_norm_eps=v.layer_norm_eps,
                hidden_act="gelu_pytorch_tanh",
                vision_use_head=False,
            )
        )
        self.multi_modal_projector = _Projector(v.width, config.vlm.width)
        eps = config.rms_norm_eps
        self.language_model = GemmaStack(config.vlm, config.vocab_size, eps, adaptive=False)
        self.gemma_expert = GemmaStack(config.expert, None, eps, adaptive=True)
        width = config.expert.width
        self.action_in_proj = nn.Linear(config.action_dim, width)
        self.action_out_proj = nn.Linear(width, config.action_dim)
        self.time_mlp_in = nn.Linear(width, width)
        self.time_mlp_out = nn.Linear(width, width)
        self.modulation: FusedLinear | None = None  # every adaptive norm's dense, fused

    # -- tensor parallelism ----------------------------------------------------------------

    @property
    def tensor_shard(self) -> TensorShard | None:
        """The tensor-parallel shard this network holds (None: all of it)."""
        return self.shard

    def shard_slices(self, shard: TensorShard) -> dict[str, WeightSlice]:
        """This rank's part of every sharded weight, by our parameter name: both experts' heads
        and MLP columns, the token embedding's vocabulary rows (see the module doc)."""
        start, stop, rows = shard.vocab_range(self.config.vocab_size)
        out = {"language_model.embed_tokens.weight": WeightSlice(0, start, stop, rows)}
        for name, stack in (
            ("language_model", self.language_model),
            ("gemma_expert", self.gemma_expert),
        ):
            for i, layer in enumerate(stack.blocks):
                prefix = f"{name}.layers.{i}"
                out.update(layer.self_attn.shard_slices(f"{prefix}.self_attn", shard))
                out.update(layer.mlp.shard_slices(f"{prefix}.mlp", shard))
        return out

    def shard_(self, shard: TensorShard) -> None:
        """Keep this rank's shard of every sharded weight (before `fuse_for_inference`; meta
        weights too).

        Raises:
            TensorParallelError: The heads cannot be split over ``shard.world`` ranks.
        """
        shard_module_(self, self.shard_slices(shard))
        self.shard = shard
        self.vocab_start, self.vocab_stop, _ = shard.vocab_range(self.config.vocab_size)
        for stack in (self.language_model, self.gemma_expert):
            for layer in stack.blocks:
                attn = layer.self_attn
                head_dim = attn.shape[2]
                attn.shape = (*head_counts(attn.q_proj, attn.k_proj, head_dim), head_dim)
                attn.shard = layer.mlp.shard = shard

    def to_precision(self, dtype: torch.dtype) -> Pi05Weights:
        """Cast the weights to ``dtype``; in bfloat16, openpi's float32 islands stay float32.

        openpi's ``PaliGemmaWithExpertModel.to_bfloat16_for_selected_params`` keeps SigLIP's
        embeddings and every norm in float32; the action and time projections belong to
        ``PI0Pytorch`` itself, which is never cast.
        """
        self.to(dtype=dtype)
        if dtype == torch.bfloat16:
            for name, param in self.named_parameters():
                if name.startswith(FLOAT32_IN_BFLOAT16) or any(s in name for s in _FLOAT32_NORMS):
                    param.data = param.data.float()
        return self

    def fuse_for_inference(
        self, prefix_rows: tuple[int, ...], action_rows: tuple[int, ...]
    ) -> None:
        """Fuse the blocks' products for the rows their experts see (see the module doc).

        Args:
            prefix_rows: Rows of a prefix step (a prefix's tokens, a few robots' at once).
            action_rows: Rows of a flow step (the horizon, times the robots in a batch).
        """
        for stack, rows in ((self.language_model, prefix_rows), (self.gemma_expert, action_rows)):
            for layer in stack.blocks:
                layer.self_attn.fuse(rows)
                layer.mlp.fuse(rows)
        chunks = tuple(sorted({max(1, r // self.config.action_horizon) for r in action_rows}))
        self.modulation = FusedLinear.of(
            [norm.dense for norm in self._adaptive_norms()], rows=chunks
        )

    def _adaptive_norms(self) -> list[AdaRMSNorm]:
        """Return the action expert's adaptive norms: two per block, then the final one."""
        norms: list[nn.Module] = []
        for layer in self.gemma_expert.blocks:
            norms += [layer.input_layernorm, layer.post_attention_layernorm]
        norms.append(self.gemma_expert.norm)
        return cast(list[AdaRMSNorm], norms)

    def modulations(self, times: torch.Tensor, counts: torch.Tensor) -> list[torch.Tensor]:
        """Return each adaptive norm's ``dense(cond)`` for action rows, ``[rows, 3 * width]``.

        ``times`` holds one flow time per action chunk, ``counts`` its rows: the conditioning
        map runs once per chunk, and its result is repeated for the chunk's rows.
        """
        cond = self.condition(times)
        norms = self._adaptive_norms()
        if self.modulation is None:
            per_chunk = [norm.dense(cond) for norm in norms]
        else:
            per_chunk = list(self.modulation(cond).chunk(len(norms), dim=-1))
        if cond.shape[0] == 1:
            rows = int(counts[0])
            return [m.expand(rows, -1) for m in per_chunk]
        return [m.repeat_interleave(counts, dim=0) for m in per_chunk]

    # -- the PagedModel contract -----------------------------------------------------------

    @property
    def kv_cache_spec(self) -> KVCacheSpec:
        """Return the joint attention's cache geometry (the experts share it)."""
        _, kv_heads, head_dim = self.language_model.blocks[0].self_attn.shape  # a shard's
        return KVCacheSpec(self.config.vlm.depth, kv_heads, head_dim, self.compute_dtype)

    @property
    def compute_dtype(self) -> torch.dtype:
        """Return the dtype the transformer blocks run in (their weights', the cache's)."""
        embed = self.language_model.embed_tokens
        assert embed is not None
        return embed.weight.dtype

    @property
    def max_position(self) -> int:
        """Return the longest prefix plus suffix."""
        return self.config.max_position

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """pi0.5 samples no tokens (its walks return action velocities)."""
        raise NotImplementedError("pi0.5 returns action velocities, not logits")

    # -- pieces ----------------------------------------------------------------------------

    @torch.inference_mode()
    def embed_images(self, pixels: torch.Tensor) -> torch.Tensor:
        """Return projected image tokens ``[images, patches, vlm width]`` for ``[images, 3, S, S]``
        in [-1, 1]."""
        tower = self.vision_tower
        patches = tower.embeddings(pixels.to(tower.embeddings.patch_embedding.weight.dtype))
        out = tower.encoder(inputs_embeds=patches.to(self.compute_dtype)).last_hidden_state
        return cast(torch.Tensor, self.multi_modal_projector.linear(tower.post_layernorm(out)))

    def embed_prefix(self, prefix: PrefixInput) -> torch.Tensor:
        """Return a prefix's rows: image tokens as they are, prompt embeddings times sqrt(width)."""
        return self.embed_prefixes([prefix])[0]

    def embed_prefixes(self, prefixes: list[PrefixInput]) -> list[torch.Tensor]:
        """Return each prefix's rows (`embed_prefix`), the prompts' embeddings looked up at once
        (a shard's: one sum over the group)."""
        embed = self.language_model.embed_tokens
        assert embed is not None
        scale = math.sqrt(self.config.vlm.width)
        ids = torch.cat([p.token_ids for p in prefixes]).to(embed.weight.device)
        tokens = self._embed(embed, ids) * scale
        counts = [int(p.token_ids.shape[0]) for p in prefixes]
        return [
            torch.cat([p.image_embeds.to(t.dtype), t])
            for p, t in zip(prefixes, tokens.split(counts), strict=True)
        ]

    def _embed(self, embed: nn.Embedding, ids: torch.Tensor) -> torch.Tensor:
        """The embedding rows of ``ids`` (a shard's: its ids' rows, the others zero, summed over
        the group: each row is one rank's, exactly)."""
        if self.shard is None:
            return cast(torch.Tensor, embed(ids))
        x = vocab_parallel_embedding(embed, ids, self.vocab_start, self.vocab_stop)
        return self.shard.all_reduce_(x)

    def condition(self, times: torch.Tensor) -> torch.Tensor:
        """Return the adaptive norms' conditioning ``[rows, expert width]`` for flow times
        ``[rows]``."""
        cfg = self.config
        emb = time_embedding(times, cfg.expert.width, cfg.min_period, cfg.max_period).to(
            self.time_mlp_in.weight.dtype
        )
        return F.silu(self.time_mlp_out(F.silu(self.time_mlp_in(emb))))

    # -- the step --------------------------------------------------------------------------

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: PagedKVContext
    ) -> torch.Tensor:
        """Run a step's prefix and action chunks jointly; return each row's action velocity.

        Rows of prefix chunks get zeros (their product is the cache).
        """
        cfg = self.config
        chunks = ctx.step.chunks
        device = positions.device
        rows0: list[int] = []
        rows1: list[int] = []
        prefixes: list[PrefixInput] = []
        x1_parts: list[torch.Tensor] = []
        times: list[float] = []
        counts: list[int] = []
        for chunk in chunks:
            span = range(chunk.row_start, chunk.row_end)
            payload = chunk.payload
            if isinstance(payload, PrefixInput):
                rows0.extend(span)
                prefixes.append(payload)
            elif isinstance(payload, ActionInput):
                rows1.extend(span)
                x1_parts.append(payload.actions.to(device, self.action_in_proj.weight.dtype))
                times.append(payload.time)
                counts.append(chunk.num_rows)
            else:
                raise TypeError(
                    "pi0.5 chunks carry a PrefixInput or an ActionInput, got "
                    f"{type(payload).__name__}"
                )
        total = positions.shape[0]
        index0 = torch.tensor(rows0, dtype=torch.long, device=device)
        index1 = torch.tensor(rows1, dtype=torch.long, device=device)
        x0 = torch.cat(self.embed_prefixes(prefixes)) if prefixes else None
        x1 = self.action_in_proj(torch.cat(x1_parts)).to(self.compute_dtype) if x1_parts else None
        mods: list[torch.Tensor] = []
        if x1 is not None:
            mods = self.modulations(
                torch.tensor(times, dtype=torch.float32, device=device),
                torch.tensor(counts, device=device),
            )
        cos, sin = rope_tables(positions, cfg.vlm.head_dim, cfg.rope_theta)
        only = total == len(rows0) or total == len(rows1)  # one expert in the step: rows in order
        vlm, expert = self.language_model.blocks, self.gemma_expert.blocks
        heads, _, head_dim = vlm[0].self_attn.shape  # a shard's: its query heads
        scale = head_dim**-0.5
        last = cfg.vlm.depth - 1
        for i in range(cfg.vlm.depth):
            parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = []
            gate1: torch.Tensor | None = None
            if x0 is not None:
                h = vlm[i].input_layernorm(x0)
                parts.append((index0, *vlm[i].self_attn.project(h)))
            if x1 is not None:
                h, gate1 = cast(AdaRMSNorm, expert[i].input_layernorm).modulate(x1, mods[2 * i])
                parts.append((index1, *expert[i].self_attn.project(h)))
            q, k, v = _join(parts, total, only)
            q = apply_rotary(q, cos.to(q.dtype), sin.to(q.dtype))
            k = apply_rotary(k, cos.to(k.dtype), sin.to(k.dtype))
            out = ctx.attend(i, q, k, v, scale).reshape(total, heads * head_dim)
            if x0 is not None:
                layer0 = vlm[i]
                x0 = x0 + layer0.self_attn.output(out if only else out.index_select(0, index0))
                if i < last:  # the last block's MLP feeds nothing: the prefix is only its cache
                    x0 = x0 + layer0.mlp(layer0.post_attention_layernorm(x0))
            if x1 is not None:
                assert gate1 is not None
                layer1 = expert[i]
                x1 = (
                    x1
                    + layer1.self_attn.output(out if only else out.index_select(0, index1)) * gate1
                )
                h, gate2 = cast(AdaRMSNorm, layer1.post_attention_layernorm).modulate(
                    x1, mods[2 * i + 1]
                )
                x1 = x1 + layer1.mlp(h) * gate2
        velocity = torch.zeros(total, cfg.action_dim, dtype=torch.float32, device=device)
        if x1 is not None:
            final, _gate = cast(AdaRMSNorm, self.gemma_expert.norm).modulate(x1, mods[-1])
            v1 = self.action_out_proj(final.to(self.action_out_proj.weight.dtype)).float()
            if only:
                return v1
            velocity.index_copy_(0, index1, v1)
        return velocity


def _join(
    parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]],
    total: int,
    only: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Put each expert's queries, keys and values at its rows of the flat batch."""
    if only:
        _, q, k, v = parts[0]
        return q, k, v
    q_all = parts[0][1].new_empty((total, *parts[0][1].shape[1:]))
    k_all = parts[0][2].new_empty((total, *parts[0][2].shape[1:]))
    v_all = parts[0][3].new_empty((total, *parts[0][3].shape[1:]))
    for index, q, k, v in parts:
        q_all.index_copy_(0, index, q)
        k_all.index_copy_(0, index, k)
        v_all.index_copy_(0, index, v)
    return q_all, k_all, v_all
