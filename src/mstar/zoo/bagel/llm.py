"""BAGEL's language model: Qwen2.5 with Mixture-of-Transformer-Experts (two weight sets per layer).

Every layer holds an understanding copy (``q/k/v/o_proj``, ``q_norm/k_norm``, ``mlp``,
``input_layernorm``, ``post_attention_layernorm``) and a generation copy (the same names with
``_moe_gen``). A row runs through one copy: VAE latent tokens through the generation weights,
text and ViT tokens (and the start/end markers around every image) through the understanding
weights. Attention is joint over all rows and the cache, whichever copy made a row's keys.

```
row        | text ... | <soi> latent latent ... latent <eoi> |
weights    | und      | und   gen    gen        gen    und   |
RoPE pos   | r r+1 .. | q     q      q    ...   q      q     |   one position per image
```

Module names are upstream's (``language_model.model.layers.{i}.self_attn.q_proj_moe_gen``...), so
``state_dict()`` is the checkpoint's ``language_model.*`` part as it is.

Tensor parallelism (`Qwen2MoTForCausalLM.shard_`, `mstar.engines.parallel`): both experts split
alike, each rank holding the same heads and MLP columns of either copy, so a row's partial
sums are summed once whichever copy made them:

```
q/k/v (both experts)       column-parallel: this rank's heads (q_norm/k_norm whole: per head)
o, MLP down (both)         row-parallel: one all-reduce per layer site, after the experts'
                           rows are merged
MLP gate/up (both)         column-parallel
embedding, head            vocabulary-parallel: lookups summed once per step, logits gathered
norms                      whole
```
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar, Literal, cast

import torch
from torch import nn

from mstar.engines.layers import (
    FusedLinear,
    GatedMLP,
    RMSNorm,
    WeightSlice,
    apply_rotary,
    attention_slices,
    gather_vocab_parallel,
    head_counts,
    shard_module_,
    vocab_parallel_embedding,
)
from mstar.engines.parallel import TensorShard
from mstar.zoo.bagel.config import LLMConfig

__all__ = [
    "GEN",
    "UND",
    "Attend",
    "MoTLayer",
    "PositionEmbedding",
    "Qwen2MoTForCausalLM",
    "Repeats",
    "Routing",
    "TimestepEmbedder",
    "rope_tables",
    "sincos_2d",
]

UND = 0  # the understanding weights (text, ViT tokens, image markers)
GEN = 1  # the generation weights (VAE latent tokens)

Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""``attend(layer, q [n, H, D], k [n, KV, D], v [n, KV, D]) -> [n, H, D]`` over the rows' caches."""


@dataclass(frozen=True, slots=True)
class Routing:
    """Which rows of a batch run through which weights.

    ``only`` is set when every row runs through one set (no gather or scatter then).
    """

    und: torch.Tensor  # row indices (int64)
    gen: torch.Tensor
    only: int | None

    @classmethod
    def of(cls, is_gen: torch.Tensor) -> Routing:
        """Route rows by a boolean ``[n]`` mask (True: generation weights)."""
        gen = is_gen.nonzero().squeeze(1)
        und = (~is_gen).nonzero().squeeze(1)
        only = GEN if und.numel() == 0 else UND if gen.numel() == 0 else None
        return cls(und, gen, only)

    def apply(
        self,
        x: torch.Tensor,
        und: Callable[[torch.Tensor], torch.Tensor],
        gen: Callable[[torch.Tensor], torch.Tensor],
    ) -> torch.Tensor:
        """Return ``und(x[und rows])`` and ``gen(x[gen rows])`` put back in row order."""
        if self.only == UND:
            return und(x)
        if self.only == GEN:
            return gen(x)
        y_und = und(x.index_select(0, self.und))
        y_gen = gen(x.index_select(0, self.gen))
        out = y_und.new_empty((x.shape[0], *y_und.shape[1:]))
        out.index_copy_(0, self.und, y_und)
        out.index_copy_(0, self.gen, y_gen)
        return out


@dataclass(frozen=True, slots=True)
class Repeats:
    """Rows of a batch whose inputs repeat earlier rows' (the CFG branches' queries of one flow
    step).

    Until attention (which reads each row's own context and RoPE position) such rows are the
    same: the first layer's norm and q/k/v products run on the distinct rows alone.
    """

    distinct: torch.Tensor  # row indices computed (int64)
    expand: torch.Tensor  # for every row, its row among ``distinct``
    routing: Routing  # of the distinct rows


class _Attention(nn.Module):
    """Both experts' projections and per-head query/key norms (Qwen2: biased q/k/v, unbiased o)."""

    def __init__(self, cfg: LLMConfig) -> None:
        super().__init__()
        h, d, kv, heads, eps = (
            cfg.hidden_size,
            cfg.head_dim,
            cfg.num_kv_heads,
            cfg.num_heads,
            cfg.rms_norm_eps,
        )
        self.num_heads, self.num_kv_heads, self.head_dim = heads, kv, d
        self.q_proj, self.q_proj_moe_gen = nn.Linear(h, heads * d), nn.Linear(h, heads * d)
        self.k_proj, self.k_proj_moe_gen = nn.Linear(h, kv * d), nn.Linear(h, kv * d)
        self.v_proj, self.v_proj_moe_gen = nn.Linear(h, kv * d), nn.Linear(h, kv * d)
        self.o_proj = nn.Linear(heads * d, h, bias=False)
        self.o_proj_moe_gen = nn.Linear(heads * d, h, bias=False)
        self.q_norm, self.q_norm_moe_gen = RMSNorm(d, eps), RMSNorm(d, eps)
        self.k_norm, self.k_norm_moe_gen = RMSNorm(d, eps), RMSNorm(d, eps)
        # Per expert suffix: q/k/v as one product, and o (set by `fuse`).
        self.fused_qkv: dict[str, FusedLinear] = {}
        self.fused_o: dict[str, FusedLinear] = {}

    def shard_slices(self, prefix: str, shard: TensorShard) -> dict[str, WeightSlice]:
        """This rank's heads of both experts, by parameter name under ``prefix`` (see
        `attention_slices`): the same heads of either copy."""
        out: dict[str, WeightSlice] = {}
        for suffix in ("", "_moe_gen"):
            projections = cast(
                tuple[nn.Linear, nn.Linear, nn.Linear, nn.Linear],
                tuple(getattr(self, f"{p}_proj{suffix}") for p in "qkvo"),
            )
            slices = attention_slices(
                prefix, projections, self.num_heads, self.num_kv_heads, self.head_dim, shard
            )
            # attention_slices names the understanding copy's projections: rename for the other
            out.update(
                {name.replace("_proj.", f"_proj{suffix}."): part for name, part in slices.items()}
            )
        return out

    def fuse(self, suffix: str, rows: tuple[int, ...]) -> None:
        """Store one expert's q/k/v as one product and o in their fastest layouts at ``rows``
        rows."""
        names = [f"{p}_proj{suffix}" for p in "qkv"]
        self.fused_qkv[suffix] = FusedLinear.of([getattr(self, n) for n in names], rows=rows)
        self.fused_o[suffix] = FusedLinear.of([getattr(self, f"o_proj{suffix}")], rows=rows)

    def qkv(self, h: torch.Tensor, suffix: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Return the normalised queries and keys, and the values, of rows ``h`` by one expert."""
        n = h.shape[0]
        fused = self.fused_qkv.get(suffix)
        if fused is None:
            q = getattr(self, f"q_proj{suffix}")(h)
            k = getattr(self, f"k_proj{suffix}")(h)
            v = getattr(self, f"v_proj{suffix}")(h)
        else:
            q_end, k_end = (
                self.num_heads * self.head_dim,
                (self.num_heads + self.num_kv_heads) * self.head_dim,
            )
            packed = fused(h)
            q, k, v = packed[:, :q_end], packed[:, q_end:k_end], packed[:, k_end:]
        q = q.reshape(n, self.num_heads, self.head_dim)
        k = k.reshape(n, self.num_kv_heads, self.head_dim)
        v = v.reshape(n, self.num_kv_heads, self.head_dim)
        return getattr(self, f"q_norm{suffix}")(q), getattr(self, f"k_norm{suffix}")(k), v

    def o(self, out: torch.Tensor, suffix: str) -> torch.Tensor:
        """Return one expert's output projection of attention rows ``out``."""
        fused = self.fused_o.get(suffix)
        return (
            fused(out)
            if fused is not None
            else cast(torch.Tensor, getattr(self, f"o_proj{suffix}")(out))
        )


class MoTLayer(nn.Module):
    """One ``Qwen2MoTDecoderLayer``."""

    def __init__(self, cfg: LLMConfig) -> None:
        super().__init__()
        self.self_attn = _Attention(cfg)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size)
        self.mlp_moe_gen = GatedMLP(cfg.hidden_size, cfg.intermediate_size)
        eps = cfg.rms_norm_eps
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps)
        self.input_layernorm_moe_gen = RMSNorm(cfg.hidden_size, eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps)
        self.post_attention_layernorm_moe_gen = RMSNorm(cfg.hidden_size, eps)
        self.shard: TensorShard | None = None

    def shard_slices(self, prefix: str, shard: TensorShard) -> dict[str, WeightSlice]:
        """This rank's slices of the layer (by parameter name under ``prefix``): both experts'
        heads and MLP columns; the norms stay whole."""
        return {
            **self.self_attn.shard_slices(f"{prefix}.self_attn", shard),
            **self.mlp.shard_slices(f"{prefix}.mlp", shard),
            **self.mlp_moe_gen.shard_slices(f"{prefix}.mlp_moe_gen", shard),
        }

    def _reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum a shard's partial products (both experts' rows, merged) over its group."""
        return x if self.shard is None else self.shard.all_reduce_(x.contiguous())

    def forward(
        self,
        index: int,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        routing: Routing,
        attend: Attend,
        repeats: Repeats | None = None,
    ) -> torch.Tensor:
        """Run rows ``x`` through the layer; ``attend`` reads and writes their caches.

        ``repeats``: rows equal to earlier ones (``x`` too), whose q/k/v before RoPE are theirs.
        """
        attn = self.self_attn
        n = x.shape[0]
        width = (attn.num_heads + 2 * attn.num_kv_heads) * attn.head_dim

        def qkv(suffix: str) -> Callable[[torch.Tensor], torch.Tensor]:
            return lambda rows: torch.cat(
                [t.reshape(rows.shape[0], -1) for t in attn.qkv(rows, suffix)], dim=1
            )

        def projections(rows: torch.Tensor, rows_routing: Routing) -> torch.Tensor:
            h = rows_routing.apply(rows, self.input_layernorm, self.input_layernorm_moe_gen)
            return rows_routing.apply(h, qkv(""), qkv("_moe_gen"))

        if repeats is None:
            packed = projections(x, routing)
        else:
            packed = projections(x.index_select(0, repeats.distinct), repeats.routing).index_select(
                0, repeats.expand
            )
        assert packed.shape[1] == width
        q_end = attn.num_heads * attn.head_dim
        k_end = q_end + attn.num_kv_heads * attn.head_dim
        q = packed[:, :q_end].reshape(n, attn.num_heads, attn.head_dim)
        k = packed[:, q_end:k_end].reshape(n, attn.num_kv_heads, attn.head_dim)
        v = packed[:, k_end:].reshape(n, attn.num_kv_heads, attn.head_dim)
        q = apply_rotary(q, cos.to(q.dtype), sin.to(q.dtype))
        k = apply_rotary(k, cos.to(k.dtype), sin.to(k.dtype))
        out = attend(index, q, k, v).reshape(n, attn.num_heads * attn.head_dim)
        # A shard's o and down products are partial sums: one all-reduce each, after the
        # experts' rows are merged.
        x = x + self._reduce(
            routing.apply(out, lambda rows: attn.o(rows, ""), lambda rows: attn.o(rows, "_moe_gen"))
        )
        mlp_und = lambda rows: self.mlp.unreduced(self.post_attention_layernorm(rows))  # noqa: E731
        mlp_gen = lambda rows: self.mlp_moe_gen.unreduced(  # noqa: E731
            self.post_attention_layernorm_moe_gen(rows)
        )
        return x + self._reduce(routing.apply(x, mlp_und, mlp_gen))

    def fuse(self, und_rows: tuple[int, ...], gen_rows: tuple[int, ...]) -> None:
        """Store each expert's products in their fastest layouts for the rows it mostly sees."""
        for suffix, rows in (("", und_rows), ("_moe_gen", gen_rows)):
            self.self_attn.fuse(suffix, rows)
        self.mlp.fuse(und_rows)
        self.mlp_moe_gen.fuse(gen_rows)


class Qwen2MoTModel(nn.Module):
    """The token embedding, the layers and both final norms."""

    def __init__(self, cfg: LLMConfig) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(MoTLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.norm_moe_gen = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        rope: torch.Tensor,
        routing: Routing,
        attend: Attend,
        repeats: Repeats | None = None,
    ) -> torch.Tensor:
        """Run embedded rows at RoPE positions ``rope`` through every layer; return the normed
        states.

        ``repeats``: rows whose inputs repeat earlier rows' (the first layer projects them once).
        """
        cfg = self.config
        cos, sin = rope_tables(rope, cfg.head_dim, cfg.rope_theta)
        for i, layer in enumerate(self.layers):
            x = layer(i, x, cos, sin, routing, attend, repeats if i == 0 else None)
        return routing.apply(x, self.norm, self.norm_moe_gen)


class Qwen2MoTForCausalLM(nn.Module):
    """``language_model``: the decoder and its (untied) head (`SupportsTensorParallel`).

    Sharded (`shard_`), it holds its heads and MLP columns of both experts and its rows of the
    embedding and the head; `embed` then gives this rank's part of each lookup (the caller sums
    a step's rows over the group once, `reduce`), `compute_logits` every id's logits.
    """

    supports_tensor_parallel: ClassVar[Literal[True]] = True

    def __init__(self, cfg: LLMConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = Qwen2MoTModel(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.shard: TensorShard | None = None
        self.vocab_start, self.vocab_stop = 0, cfg.vocab_size  # the ids this shard holds

    @property
    def tensor_shard(self) -> TensorShard | None:
        """The tensor-parallel shard this network holds (None: all of it)."""
        return self.shard

    @property
    def decoder_layers(self) -> list[MoTLayer]:
        """Return the decoder layers, typed."""
        return cast(list[MoTLayer], list(self.model.layers))

    def shard_slices(self, shard: TensorShard) -> dict[str, WeightSlice]:
        """This rank's part of every weight, by parameter name of this module (the norms stay
        whole)."""
        start, stop, rows = shard.vocab_range(self.config.vocab_size)
        vocab = WeightSlice(0, start, stop, rows)
        out = {"model.embed_tokens.weight": vocab, "lm_head.weight": vocab}
        for i, layer in enumerate(self.decoder_layers):
            out.update(layer.shard_slices(f"model.layers.{i}", shard))
        return out

    def shard_(self, shard: TensorShard) -> None:
        """Keep this rank's shard of every weight (meta weights too; before `fuse`): its heads
        and MLP columns of both experts, its rows of the vocabulary."""
        shard_module_(self, self.shard_slices(shard))
        self.shard = shard
        self.vocab_start, self.vocab_stop, _ = shard.vocab_range(self.config.vocab_size)
        for layer in self.decoder_layers:
            attn = layer.self_attn
            attn.num_heads, attn.num_kv_heads = head_counts(attn.q_proj, attn.k_proj, attn.head_dim)
            layer.shard = shard

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Return the embedding rows of ``token_ids`` (a shard: its ids' rows, zeros for the
        others' ids; `reduce` sums them)."""
        embed = self.model.embed_tokens
        if self.shard is None:
            return cast(torch.Tensor, embed(token_ids))
        return vocab_parallel_embedding(embed, token_ids, self.vocab_start, self.vocab_stop)

    def reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum a shard's partial rows over its group (the rows themselves when whole)."""
        return x if self.shard is None else self.shard.all_reduce_(x.contiguous())

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Return every id's logits of ``hidden`` (a shard's rows of the head gathered over its
        group)."""
        logits = cast(torch.Tensor, self.lm_head(hidden))
        return gather_vocab_parallel(logits, self.shard, self.config.vocab_size)


class TimestepEmbedder(nn.Module):
    """A flow time's sinusoid (cosines first, ``frequencies`` wide) through a two-layer MLP."""

    def __init__(self, hidden: int, frequencies: int = 256) -> None:
        super().__init__()
        self.frequencies = frequencies
        self.mlp = nn.Sequential(
            nn.Linear(frequencies, hidden), nn.SiLU(), nn.Linear(hidden, hidden)
        )

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        """Embed times ``[n]`` (float32) as ``[n, hidden]``."""
        half = self.frequencies // 2
        freqs = torch.exp(
            -math.log(10_000.0) * torch.arange(half, dtype=torch.float32, device=t.device) / half
        )
        angles = t.float()[:, None] * freqs[None]
        emb = torch.cat([angles.cos(), angles.sin()], dim=-1)
        first = cast(nn.Linear, self.mlp[0])
        return cast(torch.Tensor, self.mlp(emb.to(first.weight.dtype)))


class PositionEmbedding(nn.Module):
    """A fixed 2D sin-cos table over a ``side x side`` grid, looked up by ``row * side + col``."""

    def __init__(self, side: int, hidden: int) -> None:
        super().__init__()
        self.side = side
        self.pos_embed = nn.Parameter(sincos_2d(hidden, side), requires_grad=False)

    def forward(self, position_ids: torch.Tensor) -> torch.Tensor:
        """Return the rows of ``position_ids``."""
        return self.pos_embed[position_ids]


def sincos_2d(dim: int, side: int) -> torch.Tensor:
    """Return the ``[side * side, dim]`` table: the column's 1D sin-cos, then the row's (float64
    math)."""
    rows, cols = torch.meshgrid(
        torch.arange(side, dtype=torch.float64),
        torch.arange(side, dtype=torch.float64),
        indexing="ij",
    )

    def one_d(d: int, pos: torch.Tensor) -> torch.Tensor:
        omega = 1.0 / 10_000 ** (torch.arange(d // 2, dtype=torch.float64) / (d / 2))
        angles = pos.reshape(-1)[:, None] * omega[None]
        return torch.cat([angles.sin(), angles.cos()], dim=1)

    return torch.cat([one_d(dim // 2, cols), one_d(dim // 2, rows)], dim=1).float()


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
