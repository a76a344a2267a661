"""Llama-family decoder on the paged KV cache, with Hugging Face parameter names.

RMSNorm, rotary embeddings (default, linear and llama3 scaling), grouped-query attention
and a SiLU-gated MLP; a checkpoint directory of `LlamaForCausalLM` (config.json +
safetensors) loads directly:

```
model.embed_tokens.weight                        [vocab, hidden]
model.layers.{i}.input_layernorm.weight          [hidden]
model.layers.{i}.self_attn.{q,k,v,o}_proj.weight
model.layers.{i}.post_attention_layernorm.weight [hidden]
model.layers.{i}.mlp.{gate,up,down}_proj.weight
model.norm.weight                                [hidden]
lm_head.weight                                   [vocab, hidden]  (absent when tied)
```
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal, cast

import torch
import torch.nn.functional as F
from torch import nn

from mstar.engines.greedy_head import ScreenedArgmax, can_screen
from mstar.engines.interfaces import PagedKVContext
from mstar.engines.kv_cache import KVCacheSpec
from mstar.engines.layers import (
    FusedLinear,
    GatedMLP,
    RMSNorm,
    WeightSlice,
    apply_rotary_signed,
    attention_slices,
    deterministic_products,
    gather_vocab_parallel,
    head_counts,
    shard_module_,
    signed_sin,
    vocab_parallel_embedding,
)
from mstar.engines.native import cpu_kernels
from mstar.engines.parallel import ShmGroup, TensorShard, current_shard
from mstar.errors import UnsupportedModelError
from mstar.zoo.hf_checkpoint import load_hf_config, load_into_module

__all__ = ["LlamaCausalLM", "LlamaConfig", "load_llama", "rope_inv_freq"]


@dataclass(frozen=True, slots=True)
class LlamaConfig:
    """The architecture fields of a Hugging Face Llama `config.json`."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = field(default=None, hash=False)
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    torch_dtype: str | None = None

    @classmethod
    def from_hf(cls, config: dict[str, Any] | Any) -> LlamaConfig:
        """Read a `config.json` dict or a transformers `LlamaConfig` (v4 or v5 layout)."""
        raw: dict[str, Any] = config if isinstance(config, dict) else config.to_dict()
        model_type = raw.get("model_type", "llama")
        if model_type != "llama":
            raise UnsupportedModelError(
                f"expected a Llama config (model_type 'llama'), got {model_type!r}"
            )
        act = raw.get("hidden_act", "silu")
        if act != "silu":
            raise UnsupportedModelError(f"only hidden_act 'silu' is supported, got {act!r}")
        try:
            hidden = int(raw["hidden_size"])
            heads = int(raw["num_attention_heads"])
            kv_heads = int(raw.get("num_key_value_heads") or heads)
            # transformers v5 moves theta and scaling into one "rope_parameters" dict.
            rope = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
            theta = float(rope.pop("rope_theta", raw.get("rope_theta", 10000.0)))
            rope_type = rope.get("rope_type", rope.get("type", "default"))
            return cls(
                vocab_size=int(raw["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(raw["intermediate_size"]),
                num_hidden_layers=int(raw["num_hidden_layers"]),
                num_attention_heads=heads,
                num_key_value_heads=kv_heads,
                head_dim=int(raw.get("head_dim") or hidden // heads),
                max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                rope_theta=theta,
                rope_scaling=None if rope_type == "default" else rope,
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
                attention_bias=bool(raw.get("attention_bias", False)),
                mlp_bias=bool(raw.get("mlp_bias", False)),
                torch_dtype=raw.get("torch_dtype") or raw.get("dtype"),
            )
        except KeyError as exc:
            raise UnsupportedModelError(f"Llama config lacks the field {exc.args[0]!r}") from exc

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise UnsupportedModelError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )


def rope_inv_freq(config: LlamaConfig) -> torch.Tensor:
    """Return the rotary inverse frequencies `[head_dim // 2]` (float32), scaled as configured."""
    dim = config.head_dim
    inv_freq = 1.0 / (
        config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    )
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    rope_type = scaling.get("rope_type", scaling.get("type"))
    if rope_type == "linear":
        return inv_freq / float(scaling["factor"])
    if rope_type == "llama3":
        factor = float(scaling["factor"])
        low = float(scaling["low_freq_factor"])
        high = float(scaling["high_freq_factor"])
        original = float(scaling["original_max_position_embeddings"])
        low_wavelen = original / low
        high_wavelen = original / high
        wavelen = 2 * math.pi / inv_freq
        # Long wavelengths are slowed by `factor`, short ones kept, the band between blended.
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (original / wavelen - low) / (high - low)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(is_medium, blended, scaled)
    raise UnsupportedModelError(
        f"rope type {rope_type!r} is not supported (supported: default, linear, llama3)"
    )


class LlamaAttention(nn.Module):
    """Grouped-query self-attention over the paged cache."""

    def __init__(self, config: LlamaConfig, layer_index: int) -> None:
        super().__init__()
        self.layer_index = layer_index
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.scale = self.head_dim**-0.5
        bias = config.attention_bias
        hidden = config.hidden_size
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=bias)
        self.qkv: FusedLinear | None = None
        self.o: FusedLinear | None = None
        self.shard: TensorShard | None = None

    def shard_slices(self, prefix: str, shard: TensorShard) -> dict[str, WeightSlice]:
        """This rank's heads, by parameter name under ``prefix`` (see `attention_slices`)."""
        projections = (self.q_proj, self.k_proj, self.v_proj, self.o_proj)
        return attention_slices(
            prefix, projections, self.num_heads, self.num_kv_heads, self.head_dim, shard
        )

    def fuse(self) -> None:
        """Store q/k/v as one transposed matrix (the HF-named weights become views of it)."""
        self.qkv = FusedLinear.of([self.q_proj, self.k_proj, self.v_proj])
        self.o = FusedLinear.of([self.o_proj])

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: PagedKVContext
    ) -> torch.Tensor:
        """Attend the flat batch `x` `[tokens, hidden]`; `sin` is signed (see `signed_sin`)."""
        tokens = x.shape[0]
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        if self.qkv is not None:
            # q and k sit side by side in the fused output: rotate them in one pass.
            qkv = self.qkv(x)
            qk = qkv[:, : q_size + kv_size].view(
                tokens, self.num_heads + self.num_kv_heads, self.head_dim
            )
            q, k = apply_rotary_signed(qk, cos, sin).split(
                [self.num_heads, self.num_kv_heads], dim=1
            )
            v2 = qkv[:, q_size + kv_size :]
        else:
            q2, k2, v2 = self.q_proj(x), self.k_proj(x), self.v_proj(x)
            q = apply_rotary_signed(q2.view(tokens, self.num_heads, self.head_dim), cos, sin)
            k = apply_rotary_signed(k2.view(tokens, self.num_kv_heads, self.head_dim), cos, sin)
        v = v2.view(tokens, self.num_kv_heads, self.head_dim)
        out = ctx.attend(self.layer_index, q, k, v, self.scale).reshape(tokens, q_size)
        o = self.o(out) if self.o is not None else self.o_proj(out)
        # A shard's output product is a partial sum: the group adds the ranks' up.
        return o if self.shard is None else self.shard.all_reduce_(o.contiguous())


class LlamaDecoderLayer(nn.Module):
    """Pre-norm attention and MLP with residuals."""

    def __init__(self, config: LlamaConfig, layer_index: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, layer_index)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, bias=config.mlp_bias)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: PagedKVContext
    ) -> torch.Tensor:
        """Apply the layer."""
        x, h = self.post_attention_layernorm.residual(
            x, self.self_attn(self.input_layernorm(x), cos, sin, ctx)
        )
        return x + self.mlp(h)

    def native_products(
        self,
    ) -> tuple[list[torch.Tensor], list[torch.Tensor | None], list[bool]] | None:
        """The q/k/v, output, gate/up and down products as `decode_layer` takes them, or None.

        None unless the layer is fused, its MLP is SwiGLU, both norms share an epsilon, and
        every product is in a layout the native call multiplies (tiles, `[in, out]`, `[out, in]`).
        """
        attn, mlp = self.self_attn, self.mlp
        if mlp.act is not F.silu or self.input_layernorm.eps != self.post_attention_layernorm.eps:
            return None
        operands = []
        for product in (attn.qkv, attn.o, mlp.gate_up, mlp.down):
            operand = product.native_operands() if product is not None else None
            if operand is None:
                return None
            operands.append(operand)
        return [o[0] for o in operands], [o[1] for o in operands], [o[2] for o in operands]


class LlamaBackbone(nn.Module):
    """Embeddings, decoder layers and the final norm (HF's `LlamaModel`)."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            [LlamaDecoderLayer(config, i) for i in range(config.num_hidden_layers)]
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaCausalLM(nn.Module):
    """A Llama causal LM for `KVCacheEngine` (`PagedModel`, `SupportsNarrowLogits`,
    `SupportsGreedyTokens`)."""

    supports_narrow_logits: ClassVar[Literal[True]] = True
    supports_greedy_tokens: ClassVar[Literal[True]] = True
    supports_tensor_parallel: ClassVar[Literal[True]] = True

    rope_cos: torch.Tensor
    rope_sin: torch.Tensor

    def __init__(self, config: LlamaConfig) -> None:
        """Build the module with uninitialised-but-finite weights for `config`."""
        super().__init__()
        self.config = config
        self.model = LlamaBackbone(config)
        self.lm_head: nn.Linear | None = None
        self._head: FusedLinear | None = None
        self._greedy: ScreenedArgmax | Literal[False] | None = None  # False: no screen here
        # Deterministic head products over id ranges (`compute_logits_in`), by range.
        self._head_slices: dict[tuple[int, int], FusedLinear] = {}
        # The decoder for the native decode step (`DecodeStack`; None: not built yet; False:
        # a layer that the native call cannot run, or no kernels).
        self._native_stack: Any = None
        self.shard: TensorShard | None = None
        self.vocab_start, self.vocab_stop = 0, config.vocab_size  # the ids this shard holds
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        # Rotary tables for every position, built once (float32, as transformers does).
        inv_freq = rope_inv_freq(config)
        positions = torch.arange(config.max_position_embeddings, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq)
        angles = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("rope_cos", angles.cos(), persistent=False)
        self.register_buffer("rope_sin", angles.sin(), persistent=False)

    @property
    def tensor_shard(self) -> TensorShard | None:
        """The tensor-parallel shard this network holds (None: all of it)."""
        return self.shard

    def shard_slices(self, shard: TensorShard) -> dict[str, WeightSlice]:
        """This rank's part of every weight, by Hugging Face name (the norms stay whole)."""
        start, stop, rows = shard.vocab_range(self.config.vocab_size)
        vocab = WeightSlice(0, start, stop, rows)
        out = {"model.embed_tokens.weight": vocab}
        if self.lm_head is not None:
            out["lm_head.weight"] = vocab
        for i, layer in enumerate(self.decoder_layers):
            out.update(layer.self_attn.shard_slices(f"model.layers.{i}.self_attn", shard))
            out.update(layer.mlp.shard_slices(f"model.layers.{i}.mlp", shard))
        return out

    def shard_(self, shard: TensorShard) -> None:
        """Keep this rank's shard of every weight (before `fuse_for_inference`; meta weights too):
        its heads, its share of each MLP, its rows of the vocabulary."""
        shard_module_(self, self.shard_slices(shard))
        self.shard = shard
        self.vocab_start, self.vocab_stop, _ = shard.vocab_range(self.config.vocab_size)
        for layer in self.decoder_layers:
            attn = layer.self_attn
            attn.num_heads, attn.num_kv_heads = head_counts(attn.q_proj, attn.k_proj, attn.head_dim)
            attn.shard = layer.mlp.shard = shard

    @property
    def kv_cache_spec(self) -> KVCacheSpec:
        """Return the cache geometry (a shard's: its KV heads)."""
        return KVCacheSpec(
            num_layers=self.config.num_hidden_layers,
            num_kv_heads=self.decoder_layers[0].self_attn.num_kv_heads,
            head_dim=self.config.head_dim,
            dtype=self.model.embed_tokens.weight.dtype,
        )

    @property
    def max_position(self) -> int:
        """Return the longest supported sequence."""
        return self.config.max_position_embeddings

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: PagedKVContext
    ) -> torch.Tensor:
        """Return final hidden states `[tokens, hidden]` for a flat token batch."""
        embed = self.model.embed_tokens.weight
        dtype = embed.dtype
        if (
            dtype in (torch.float32, torch.bfloat16)
            and embed.device.type == "cpu"
            and not torch.is_grad_enabled()
        ):
            plan = ctx.native_decode()
            if plan is not None and (stack := self._decode_stack()) is not None:
                slots, tables, lens = plan
                # layer i's are kv_caches[i]
                caches = [cache for pair in ctx.kv_caches for cache in pair]
                return cast(
                    torch.Tensor, stack.forward(input_ids, positions, caches, slots, tables, lens)
                )
        x = self._embed(input_ids)
        # The step's rotary tables, once for every layer (the sine signed: see
        # `apply_rotary_signed`).
        cos = self.rope_cos.index_select(0, positions).unsqueeze(1).to(dtype)
        sin = signed_sin(self.rope_sin.index_select(0, positions).unsqueeze(1).to(dtype))
        for layer in self.decoder_layers:
            x = layer(x, cos, sin, ctx)
        return self.model.norm(x)

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The embedding rows of ``input_ids`` (a shard: its ids' rows, summed over the group)."""
        if self.shard is None:
            return cast(torch.Tensor, self.model.embed_tokens(input_ids))
        embed = self.model.embed_tokens
        x = vocab_parallel_embedding(embed, input_ids, self.vocab_start, self.vocab_stop)
        return self.shard.all_reduce_(x)

    def _decode_stack(self) -> Any:
        """The native decode step (`cpu_kernels.cpp`'s `DecodeStack`), or None where it cannot run.

        The same ops as `forward`'s layers, in one call: no Python and torch dispatch between
        them (about 60 ops a layer), and the GIL released for the whole step. Built at the
        first decode step with the weights as they are then (`fuse_for_inference` drops it).
        """
        if self._native_stack is None:
            kernels = cpu_kernels()
            layers = [(layer, layer.native_products()) for layer in self.decoder_layers]
            self._native_stack = False
            norm, embed = self.model.norm, self.model.embed_tokens.weight
            group = self.shard.group if self.shard is not None else None
            if (
                kernels is not None
                and norm.weight.dtype == embed.dtype
                and all(p is not None for _, p in layers)
                # a shard's sums inside the call: only over shared memory
                and (group is None or isinstance(group, ShmGroup))
            ):
                attn = self.decoder_layers[0].self_attn
                stack = kernels.DecodeStack(
                    embed,
                    self.rope_cos,
                    self.rope_sin,
                    norm.weight,
                    norm.eps,
                    attn.scale,
                    attn.num_heads,
                    invariant=attn.qkv is not None and attn.qkv.deterministic,
                )
                if isinstance(group, ShmGroup) and group.world > 1:
                    stack.set_group(group.native, self.vocab_start)
                for layer, products in layers:
                    assert products is not None
                    stack.add_layer(
                        layer.input_layernorm.weight,
                        layer.post_attention_layernorm.weight,
                        layer.input_layernorm.eps,
                        *products,
                    )
                self._native_stack = stack
        return self._native_stack or None

    @property
    def decoder_layers(self) -> list[LlamaDecoderLayer]:
        """Return the decoder layers, typed."""
        return cast(list[LlamaDecoderLayer], list(self.model.layers))

    def fuse_for_inference(self) -> None:
        """Fuse q/k/v and gate/up projections, in the faster layout per shape (see `FusedLinear`).

        Weights in dense layouts stay reachable under their Hugging Face names; packed ones
        leave their modules (see `FusedLinear`). A tied head gets its own copy only where another
        layout is faster (the embedding lookup needs rows).
        """
        for layer in self.decoder_layers:
            layer.self_attn.fuse()
            layer.mlp.fuse()
        if self.lm_head is not None:
            # Kept dense as well (like a tied head's embedding): `compute_logits_in` slices it.
            self._head = FusedLinear.shared(self.lm_head.weight)
        else:
            self._head = FusedLinear.shared(self.model.embed_tokens.weight)
        self._greedy = None
        self._head_slices = {}
        self._native_stack = None

    def compute_logits_in(
        self, hidden: torch.Tensor, ranges: list[list[tuple[int, int]]]
    ) -> torch.Tensor:
        """Return logits computed only inside each row's id ranges, `-inf` elsewhere.

        Rows sharing ranges share one product with just those rows of the head: constrained
        audio decoding needs 4,097 of Orpheus' 156,940 logits per step.
        """
        weight = self._dense_head()
        logits = hidden.new_full((hidden.shape[0], weight.shape[0]), float("-inf"))
        groups: dict[tuple[tuple[int, int], ...], list[int]] = {}
        for row, row_ranges in enumerate(ranges):
            # a shard's ids only, counted from its first
            local = [
                (
                    max(a, self.vocab_start) - self.vocab_start,
                    min(b, self.vocab_stop) - self.vocab_start,
                )
                for a, b in row_ranges
            ]
            groups.setdefault(tuple((a, b) for a, b in local if a < b), []).append(row)
        deterministic = self._head is not None and self._head.deterministic
        for key, rows in groups.items():
            index = torch.tensor(rows, device=hidden.device)
            part = hidden.index_select(0, index)
            for start, end in key:
                if deterministic:
                    # The head's own per-row sums over just these ids: each logit equals the
                    # full head's, whichever rows share the step.
                    logits[index, start:end] = self._head_slice(start, end)(part)
                else:
                    logits[index, start:end] = F.linear(part, weight[start:end])
        return gather_vocab_parallel(logits, self.shard, self.config.vocab_size)

    def _head_slice(self, start: int, end: int) -> FusedLinear:
        """The head's rows `[start, end)` as a deterministic product, made once per range."""
        key = (start, end)
        if key not in self._head_slices:
            with deterministic_products():
                self._head_slices[key] = FusedLinear.shared(self._dense_head()[start:end])
        return self._head_slices[key]

    def _dense_head(self) -> torch.Tensor:
        """Return the head as a dense `[vocab, hidden]` matrix (rows can be sliced)."""
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Return each row's argmax token of `compute_logits(hidden)`, or None (see
        `SupportsGreedyTokens`)."""
        if self._head is None:
            return None
        if self.shard is not None and self.shard.group is not None:
            return self._shard_greedy_tokens(hidden, self.shard.group)
        if self._greedy is None:
            dense = self._dense_head()
            # A float32 head on a CPU with bfloat16 products: greedy rows screen in bfloat16
            # and stay exact (see `ScreenedArgmax`). Its copy (half the head's size) is made
            # at the first greedy step: models that always constrain their logits never pay it.
            head = self._head
            with deterministic_products(head.deterministic):
                self._greedy = ScreenedArgmax(dense, full=head) if can_screen(dense) else False
        if self._greedy is False:
            # The full product, then each row's first maximum: what sampling greedy rows gives,
            # without building the sampler's per-row state.
            return self._head.argmax(hidden)
        return self._greedy(hidden)

    def _shard_greedy_tokens(self, hidden: torch.Tensor, group: Any) -> torch.Tensor:
        """Each row's argmax over the group: every rank's best id and logit (two numbers a row)
        are gathered, and the highest wins (the lowest id on ties, as one argmax does)."""
        assert self._head is not None
        logits = self._head(hidden)[:, : self.vocab_stop - self.vocab_start]
        best, index = logits.float().max(dim=1)
        mine = torch.stack((best.double(), (index + self.vocab_start).double()), dim=1)
        every = group.all_gather(mine)  # [world, rows, 2], ranks in id order
        winner = every[:, :, 0].argmax(dim=0)  # the first rank holding the maximum
        return every[winner, torch.arange(hidden.shape[0]), 1].long()

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Project hidden states to vocabulary logits (a shard's gathered over the group)."""
        if self._head is not None:
            logits = self._head(hidden)
        else:
            weight = (
                self.lm_head.weight if self.lm_head is not None else self.model.embed_tokens.weight
            )
            logits = F.linear(hidden, weight)
        return gather_vocab_parallel(logits, self.shard, self.config.vocab_size)


def load_llama(
    checkpoint_dir: str | Path,
    *,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | None = None,
) -> LlamaCausalLM:
    """Build a `LlamaCausalLM` from a Hugging Face checkpoint directory.

    Args:
        checkpoint_dir: holds `config.json` and safetensors weights (sharded or not).
        device: where the weights go.
        dtype: weight dtype; default float32 on CPU, the checkpoint's dtype on CUDA.
    """
    config = LlamaConfig.from_hf(load_hf_config(checkpoint_dir))
    device = torch.device(device)
    if dtype is None:
        dtype = torch.float32
        if device.type == "cuda" and config.torch_dtype in ("bfloat16", "float16"):
            dtype = getattr(torch, config.torch_dtype)
    with torch.device("meta"):
        model = LlamaCausalLM(config)
    shard = current_shard()
    slices = None
    if shard is not None:  # a tensor-parallel rank reads its slices of the checkpoint only
        slices = model.shard_slices(shard)
        model.shard_(shard)
    model = model.to_empty(device=device).to(dtype=dtype)
    _fill_rope(model, config, device)  # derived tables are not in checkpoints
    ignore = ["lm_head.weight"] if config.tie_word_embeddings else []
    load_into_module(model, checkpoint_dir, ignore=ignore, slices=slices)
    model.fuse_for_inference()
    return model.eval()


def _fill_rope(model: LlamaCausalLM, config: LlamaConfig, device: torch.device) -> None:
    inv_freq = rope_inv_freq(config).to(device)
    positions = torch.arange(config.max_position_embeddings, dtype=torch.float32, device=device)
    angles = torch.outer(positions, inv_freq)
    angles = torch.cat((angles, angles), dim=-1)
    model.rope_cos = angles.cos()
    model.rope_sin = angles.sin()
