"""The thinker's and the talker's text models: Qwen3-MoE decoders on mstar's paged KV cache.

Both are `PagedModel`s. A step's rows are token ids or `EmbedsInput` payloads (a prompt whose
embeddings the node assembled: text embeddings with audio or vision features scattered in, or
the talker's summed text and codec embeddings). A payload may carry 3-D MRoPE coordinates and
DeepStack features; after a payload with 3-D coordinates, the sequence's later rows sit at
``position + rope_delta`` on all three axes (transformers' ``rope_deltas``), which the model keeps
per sequence until `forget` is called.

Module names follow the Hugging Face checkpoint below ``thinker.`` / ``talker.``::

    model.embed_tokens            thinker token embedding (the talker's is model.codec_embedding)
    model.layers.{i}.self_attn    q/k/v/o_proj, q_norm / k_norm (RMSNorm over head_dim)
    model.layers.{i}.mlp          gate (router), experts.{gate_up_proj, down_proj} (fused),
                                  shared_expert.*, shared_expert_gate (talker), or a dense MLP
    model.norm                    final RMSNorm
    lm_head / codec_head          the output projection

With ``capture_layer`` set, the model returns, beside each row's final hidden state, its input
embedding and the output of layer ``capture_layer - 1`` (transformers' ``hidden_states[0]`` and
``hidden_states[capture_layer]``): ``[rows, 3 * hidden]``, what the talker is fed from. The logits
read the first ``hidden`` columns.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Literal, cast

import torch
from torch import nn

from mstar.engines.interfaces import PagedKVContext
from mstar.engines.kv_cache import KVCacheSpec
from mstar.engines.layers import (
    GatedMLP,
    RMSNorm,
    WeightSlice,
    apply_rotary,
    attention_slices,
    gather_vocab_parallel,
    head_counts,
    shard_module_,
)
from mstar.engines.parallel import TensorShard, mirrored, tensor_payload
from mstar.zoo.qwen3_omni.config import MoETextConfig
from mstar.zoo.qwen3_omni.modules.moe import SparseMoE
from mstar.zoo.qwen3_omni.modules.rope import MRoPE

__all__ = ["EmbedsInput", "MoEDecoder", "MoEDecoderLayer", "QKNormAttention"]


@tensor_payload
@dataclass(frozen=True, eq=False)
class EmbedsInput:
    """A payload chunk of a thinker or talker sequence: its rows' input embeddings.

    Attributes:
        embeds: ``[rows, hidden]`` input embeddings.
        positions3: ``[3, rows]`` MRoPE coordinates (None: the sequence positions plus the
            sequence's current ``rope_delta``).
        rope_delta: The sequence's MRoPE offset from this chunk on (None: unchanged).
        deepstack: ``[num_layers, rows, hidden]`` added to the output of the first layers
            (zero rows where the input is not visual).
    """

    embeds: torch.Tensor
    positions3: torch.Tensor | None = None
    rope_delta: int | None = None
    deepstack: torch.Tensor | None = None

    @property
    def num_rows(self) -> int:
        """Return the payload's positions."""
        return int(self.embeds.shape[0])


class QKNormAttention(nn.Module):
    """Grouped-query attention with RMSNorm on each head's queries and keys, over the paged
    cache."""

    def __init__(self, config: MoETextConfig, layer_index: int) -> None:
        super().__init__()
        self.layer_index = layer_index
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.scale = self.head_dim**-0.5
        hidden = config.hidden_size
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=False)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.shard: TensorShard | None = None

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: PagedKVContext
    ) -> torch.Tensor:
        """Attend the flat batch ``x`` ``[rows, hidden]``."""
        rows = x.shape[0]
        q = self.q_norm(self.q_proj(x).view(rows, self.num_heads, self.head_dim))
        k = self.k_norm(self.k_proj(x).view(rows, self.num_kv_heads, self.head_dim))
        v = self.v_proj(x).view(rows, self.num_kv_heads, self.head_dim)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = ctx.attend(self.layer_index, q, k, v, self.scale)
        o = self.o_proj(out.reshape(rows, self.num_heads * self.head_dim))
        # A shard's output product is a partial sum: the group adds the ranks' up.
        return cast(torch.Tensor, o if self.shard is None else self.shard.all_reduce_(o))


class MoEDecoderLayer(nn.Module):
    """Pre-norm attention and (MoE or dense) MLP with residuals."""

    def __init__(self, config: MoETextConfig, layer_index: int) -> None:
        super().__init__()
        self.self_attn = QKNormAttention(config, layer_index)
        self.mlp: nn.Module
        if config.is_moe_layer(layer_index):
            self.mlp = SparseMoE(
                config.hidden_size,
                config.moe_intermediate_size,
                config.num_experts,
                config.num_experts_per_tok,
                config.norm_topk_prob,
                config.shared_expert_intermediate_size,
            )
        else:
            self.mlp = GatedMLP(config.hidden_size, config.intermediate_size)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: PagedKVContext
    ) -> torch.Tensor:
        """Apply the layer."""
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, ctx)
        return x + self.mlp(self.post_attention_layernorm(x))


class _Backbone(nn.Module):
    """``model.*``: the embedding (token or codec), the layers and the final norm."""

    def __init__(self, config: MoETextConfig, embedding_name: str) -> None:
        super().__init__()
        self.embedding_name = embedding_name
        self.add_module(embedding_name, nn.Embedding(config.vocab_size, config.hidden_size))
        self.layers = nn.ModuleList([MoEDecoderLayer(config, i) for i in range(config.num_layers)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    @property
    def embedding(self) -> nn.Embedding:
        """Return the input embedding."""
        return cast(nn.Embedding, getattr(self, self.embedding_name))


class MoEDecoder(nn.Module):
    """A Qwen3-MoE decoder for `KVCacheEngine` (`PagedModel`, `SupportsTensorParallel`).

    Sharded (`shard_`), it holds its heads, its share of every expert and dense MLP, and its
    rows of the head (`mstar.engines.parallel`); the embedding stays whole on every rank (the
    nodes look tokens up in it themselves).

    Args:
        config: The text model.
        embedding_name: ``embed_tokens`` (thinker) or ``codec_embedding`` (talker).
        head_name: ``lm_head`` (thinker) or ``codec_head`` (talker).
        capture_layer: Also return each row's input embedding and this captured hidden
            state (see the module docstring); None returns the final hidden states only.
        shard_head: Sharded, split the head by vocabulary rows (the thinker's); False keeps it
            whole on every rank (the talker's: the leader draws its frames inside the step,
            alone).
    """

    def __init__(
        self,
        config: MoETextConfig,
        *,
        embedding_name: str = "embed_tokens",
        head_name: str = "lm_head",
        capture_layer: int | None = None,
        shard_head: bool = True,
    ) -> None:
        super().__init__()
        self.config = config
        self.head_name = head_name
        self.shard_head = shard_head
        self.capture_layer = capture_layer
        self.model = _Backbone(config, embedding_name)
        self.add_module(head_name, nn.Linear(config.hidden_size, config.vocab_size, bias=False))
        self.rope = MRoPE(
            config.head_dim, config.rope_theta, config.mrope_section, config.max_position
        )
        self._rope_deltas: dict[str, int] = {}
        self.shard: TensorShard | None = None

    supports_tensor_parallel: ClassVar[Literal[True]] = True

    @property
    def tensor_shard(self) -> TensorShard | None:
        """The tensor-parallel shard this network holds (None: all of it)."""
        return self.shard

    def shard_slices(self, shard: TensorShard) -> dict[str, WeightSlice]:
        """This rank's part of every weight (names of this module; norms, router and embedding
        stay whole)."""
        out: dict[str, WeightSlice] = {}
        if self.shard_head:
            start, stop, rows = shard.vocab_range(self.config.vocab_size)
            out[f"{self.head_name}.weight"] = WeightSlice(0, start, stop, rows)
        for i, layer in enumerate(cast(list[MoEDecoderLayer], list(self.model.layers))):
            attn = layer.self_attn
            projections = (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj)
            prefix = f"model.layers.{i}"
            out.update(
                attention_slices(
                    f"{prefix}.self_attn",
                    projections,
                    attn.num_heads,
                    attn.num_kv_heads,
                    attn.head_dim,
                    shard,
                )
            )
            out.update(cast(Any, layer.mlp).shard_slices(f"{prefix}.mlp", shard))
        return out

    def shard_(self, shard: TensorShard) -> None:
        """Keep this rank's shard of every weight (meta weights too; see `shard_slices`)."""
        shard_module_(self, self.shard_slices(shard))
        self.shard = shard
        for layer in cast(list[MoEDecoderLayer], list(self.model.layers)):
            attn = layer.self_attn
            attn.num_heads, attn.num_kv_heads = head_counts(attn.q_proj, attn.k_proj, attn.head_dim)
            attn.shard = shard
            cast(Any, layer.mlp).shard = shard

    @property
    def head(self) -> nn.Linear:
        """Return the output projection."""
        return cast(nn.Linear, getattr(self, self.head_name))

    @property
    def embedding(self) -> nn.Embedding:
        """Return the input embedding."""
        return self.model.embedding

    @property
    def kv_cache_spec(self) -> KVCacheSpec:
        """Return the cache geometry."""
        return KVCacheSpec(
            num_layers=self.config.num_layers,
            num_kv_heads=cast(MoEDecoderLayer, self.model.layers[0]).self_attn.num_kv_heads,
            head_dim=self.config.head_dim,
            dtype=self.embedding.weight.dtype,
        )

    @property
    def max_position(self) -> int:
        """Return the longest supported sequence."""
        return self.config.max_position

    @property
    def hidden_size(self) -> int:
        """Return the width of the final hidden states."""
        return self.config.hidden_size

    def to_device_tables(self) -> None:
        """Move the rotary tables next to the weights (after ``.to(device)``)."""
        self.rope.to(self.embedding.weight.device)

    @mirrored
    def forget(self, seq_key: str) -> None:
        """Drop what the model keeps for a sequence (its MRoPE offset)."""
        self._rope_deltas.pop(seq_key, None)

    def rope_delta(self, seq_key: str) -> int:
        """Return a sequence's MRoPE offset (0 until a payload sets one)."""
        return self._rope_deltas.get(seq_key, 0)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: PagedKVContext
    ) -> torch.Tensor:
        """Return hidden states ``[rows, hidden]`` (``[rows, 3 * hidden]`` with
        ``capture_layer``)."""
        x = self.embedding(input_ids)
        positions3: torch.Tensor | None = None
        deepstack: list[tuple[int, int, torch.Tensor]] = []
        chunks = ctx.step.chunks
        if any(c.payload is not None for c in chunks) or self._rope_deltas:
            x = x.clone()
            coords: list[torch.Tensor] = []
            use3 = False
            for chunk in chunks:
                lo, hi = chunk.row_start, chunk.row_end
                payload = chunk.payload
                delta = self._rope_deltas.get(chunk.seq_key, 0)
                if isinstance(payload, EmbedsInput):
                    if payload.num_rows != hi - lo:
                        raise ValueError(
                            f"a payload of {payload.num_rows} rows was scheduled as {hi - lo} rows"
                        )
                    x[lo:hi] = payload.embeds.to(x.device, x.dtype)
                    if payload.deepstack is not None:
                        deepstack.append((lo, hi, payload.deepstack.to(x.device, x.dtype)))
                    if payload.positions3 is not None:
                        coords.append(payload.positions3.to(positions.device, torch.long))
                        use3 = True
                    else:
                        coords.append((positions[lo:hi] + delta).expand(3, -1))
                        use3 = use3 or delta != 0
                    if payload.rope_delta is not None:
                        if payload.rope_delta:
                            self._rope_deltas[chunk.seq_key] = payload.rope_delta
                        else:
                            self._rope_deltas.pop(chunk.seq_key, None)
                elif payload is not None:
                    raise TypeError(
                        f"Qwen3-Omni text chunks carry an EmbedsInput, got {type(payload).__name__}"
                    )
                else:
                    coords.append((positions[lo:hi] + delta).expand(3, -1))
                    use3 = use3 or delta != 0
            if use3:
                positions3 = torch.cat(coords, dim=1)
        cos, sin = self.rope.tables(positions, positions3, x.dtype)
        embeds = x
        captured: torch.Tensor | None = None
        for index, layer in enumerate(self.model.layers):
            x = layer(x, cos, sin, ctx)
            if self.capture_layer is not None and index == self.capture_layer - 1:
                captured = x
            for lo, hi, features in deepstack:
                if index < features.shape[0]:
                    if captured is not None and x is captured:
                        x = captured.clone()  # the captured state is taken before DeepStack
                    x[lo:hi] += features[index]
        final = self.model.norm(x)
        if self.capture_layer is None:
            return cast(torch.Tensor, final)
        if (
            captured is None
        ):  # capture_layer 0 (the embeddings) or the last layer (normed, as transformers does)
            captured = embeds if self.capture_layer == 0 else final
        return torch.cat((final, embeds, captured), dim=-1)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Project (the first ``hidden`` columns of) hidden states to vocabulary logits (a
        shard's rows gathered over its group)."""
        logits = cast(torch.Tensor, self.head(hidden[:, : self.config.hidden_size]))
        shard = self.shard if self.shard_head else None  # an unsharded head's logits are whole
        return gather_vocab_parallel(logits, shard, self.config.vocab_size)
