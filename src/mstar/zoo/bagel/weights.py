"""All of ``ema.safetensors`` (the MoT LLM and the modules around it), and its step on the paged
cache.

```
language_model.*            Qwen2MoTForCausalLM (`mstar.zoo.bagel.llm`)
time_embedder.mlp.{0,2}     flow time -> LLM width
vae2llm, llm2vae            latent token (p*p*z) <-> LLM width (the velocity head)
latent_pos_embed.pos_embed  2D sin-cos over max_latent_size^2 latent positions
vit_model.*                 SigLIP NaViT (checkpoint: vit_model.vision_model.*)
connector.fc1, fc2          ViT width -> LLM width
vit_pos_embed.pos_embed     2D sin-cos over the ViT's position grid
```

Every cache input is a payload (`TextInput`, `ImageInput`) that names its first RoPE position:
BAGEL's positions are not its cache positions (an image of n tokens takes one). Sampled tokens
(text decoding) carry no payload; their RoPE position is their cache position less the
sequence's offset, which each engine notes from every payload it writes (``rope_offsets`` of
`step`).

A tensor-parallel shard (`Qwen2MoTForCausalLM.shard_`) embeds its ids' rows of a step (the
image rows around them on rank 0 alone) and sums the step's rows over its group once; the
payloads travel to the followers as they are (`tensor_payload`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, cast

import torch
from torch import nn

from mstar.engines.interfaces import PagedKVContext
from mstar.engines.kv_cache import KVCacheSpec
from mstar.engines.layers import can_pack
from mstar.engines.parallel import tensor_payload
from mstar.zoo.bagel.config import BagelConfig
from mstar.zoo.bagel.llm import (
    Attend,
    MoTLayer,
    PositionEmbedding,
    Qwen2MoTForCausalLM,
    Repeats,
    Routing,
    TimestepEmbedder,
)
from mstar.zoo.bagel.vision import (
    MLPConnector,
    NaViT,
    connector_output,
    flattened_positions,
    patchify,
)

__all__ = ["BagelWeights", "ImageInput", "TextInput"]


@tensor_payload
@dataclass(frozen=True, slots=True)
class TextInput:
    """Text tokens for the cache, the first at RoPE position ``rope`` (understanding weights,
    causal)."""

    token_ids: torch.Tensor  # [n] int64
    rope: int

    @property
    def num_tokens(self) -> int:
        """Count the cache positions."""
        return int(self.token_ids.shape[0])

    @property
    def rope_end(self) -> int:
        """The RoPE position after the input."""
        return self.rope + self.num_tokens


@tensor_payload
@dataclass(frozen=True, slots=True)
class ImageInput:
    """``[<soi>, n image tokens, <eoi>]``, all at RoPE position ``rope`` (full attention).

    Attributes:
        kind: "vit": ``tokens`` are LLM-width ViT tokens (understanding weights); "vae" (a
            clean input image, ``timestep`` 0) or "flow" (noisy latents at ``timestep``):
            ``tokens`` are latent tokens ``[n, p*p*z]`` (generation weights).
        latent_positions: ``[n]`` latent table positions ("vae" and "flow").
    """

    kind: Literal["vit", "vae", "flow"]
    tokens: torch.Tensor
    rope: int
    latent_positions: torch.Tensor | None = None
    timestep: float = 0.0

    @property
    def num_tokens(self) -> int:
        """Count the cache positions (the markers included)."""
        return int(self.tokens.shape[0]) + 2

    @property
    def rope_end(self) -> int:
        """The RoPE position after the image."""
        return self.rope + 1


class BagelWeights(nn.Module):
    """The weights of ``ema.safetensors``, and BAGEL's step on the paged cache (`step`)."""

    def __init__(self, config: BagelConfig) -> None:
        super().__init__()
        self.config = config
        hidden = config.llm.hidden_size
        self.language_model = Qwen2MoTForCausalLM(config.llm)
        self.time_embedder = TimestepEmbedder(hidden, config.timestep_frequencies)
        self.vae2llm = nn.Linear(config.patch_latent_dim, hidden)
        self.llm2vae = nn.Linear(hidden, config.patch_latent_dim)
        self.latent_pos_embed = PositionEmbedding(config.max_latent_size, hidden)
        self.vit_model = NaViT(config.vit)
        self.connector = MLPConnector(config.vit.hidden_size, hidden)
        self.vit_pos_embed = PositionEmbedding(config.vit.max_patches_per_side, hidden)

    # -- the PagedModel contract -----------------------------------------------------------

    @property
    def kv_cache_spec(self) -> KVCacheSpec:
        """Return the cache geometry (one joint attention for both experts; a shard's KV
        heads)."""
        cfg = self.config.llm
        kv_heads = self.language_model.decoder_layers[0].self_attn.num_kv_heads
        return KVCacheSpec(cfg.num_layers, kv_heads, cfg.head_dim, self.vae2llm.weight.dtype)

    @property
    def max_position(self) -> int:
        """Return the longest sequence of cache positions."""
        return self.config.llm.max_position

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Return next-token logits of text rows (a shard's gathered over its group)."""
        return self.language_model.compute_logits(hidden)

    def fuse_for_inference(self) -> None:
        """Store the LLM's products in their fastest layouts (inference only; see `FusedLinear`).

        Only where oneDNN packs (float32, bfloat16 on a CPU): there each layer's products run
        about twice as fast at an image's rows. Float64 (the parity runs) keeps plain products.
        The dense reference uses these modules too, so both sides get the same kernels.
        """
        cfg = self.config
        if not can_pack(self.vae2llm.weight):
            return
        side = (
            cfg.image_size[0] // cfg.latent_downsample,
            cfg.image_size[1] // cfg.latent_downsample,
        )
        image_rows = side[0] * side[1] + 2  # an image's latent tokens and its markers
        for layer in self.language_model.model.layers:
            cast(MoTLayer, layer).fuse(
                und_rows=(1, image_rows), gen_rows=(image_rows, 3 * image_rows)
            )

    # -- pieces ----------------------------------------------------------------------------

    @property
    def _dtype(self) -> torch.dtype:
        return self.vae2llm.weight.dtype

    def embed_tokens(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Return token embeddings (a shard's summed over its group)."""
        return self.language_model.reduce(self._embed_tokens(token_ids))

    def _embed_tokens(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Return token embeddings (a shard's part, not yet summed)."""
        embed = self.language_model.model.embed_tokens
        return self.language_model.embed(token_ids.to(embed.weight.device))

    @torch.inference_mode()
    def embed_vit(self, image: torch.Tensor) -> torch.Tensor:
        """Return one image's LLM-width ViT tokens ``[h*w, hidden]`` for pixels ``[3, h*p, w*p]`` in
        [-1, 1]."""
        cfg = self.config.vit
        p = cfg.patch_size
        h, w = image.shape[1] // p, image.shape[2] // p
        positions = flattened_positions(h, w, cfg.max_patches_per_side).to(
            self.connector.fc1.weight.device
        )
        states = self.vit_model.encode(
            patchify(image.to(positions.device, self._dtype), p), positions
        )
        return connector_output(self.connector, self.vit_pos_embed, states, positions)

    def embed_input(
        self, payload: TextInput | ImageInput
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Return a payload's rows, their RoPE positions and which rows run the generation
        weights."""
        x, rope, is_gen = self._embed_input(payload)
        return self.language_model.reduce(x), rope, is_gen

    def _embed_input(
        self, payload: TextInput | ImageInput
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`embed_input`, a shard's part of the rows (not yet summed over its group): its ids'
        embeddings, and the image's own rows on rank 0 only (zeros elsewhere)."""
        device = self.vae2llm.weight.device
        if isinstance(payload, TextInput):
            n = payload.num_tokens
            x = self._embed_tokens(payload.token_ids)
            rope = payload.rope + torch.arange(n, device=device)
            return x, rope, torch.zeros(n, dtype=torch.bool, device=device)
        if not isinstance(payload, ImageInput):
            raise TypeError(
                f"BAGEL chunks carry a TextInput or an ImageInput, got {type(payload).__name__}"
            )
        tokens = self.config.tokens
        markers = self._embed_tokens(
            torch.tensor([tokens.start_of_image, tokens.end_of_image], device=device)
        )
        n = payload.num_tokens
        is_gen = torch.zeros(n, dtype=torch.bool, device=device)
        if payload.kind != "vit":
            is_gen[1:-1] = True
        shard = self.language_model.tensor_shard
        if shard is not None and shard.rank != 0:  # rank 0 adds the image's rows to the sum
            middle = markers.new_zeros((n - 2, markers.shape[1]))
        elif payload.kind == "vit":
            middle = payload.tokens.to(device, self._dtype)
        else:
            assert payload.latent_positions is not None
            t = torch.tensor([payload.timestep], dtype=torch.float32, device=device)
            middle = (
                self.vae2llm(payload.tokens.to(device, self._dtype))
                + self.time_embedder(t)
                + self.latent_pos_embed(payload.latent_positions.to(device))
            )
        x = torch.cat([markers[:1], middle.to(markers.dtype), markers[1:]])
        return x, torch.full((n,), payload.rope, device=device), is_gen

    def run(
        self,
        x: torch.Tensor,
        rope: torch.Tensor,
        is_gen: torch.Tensor,
        attend: Attend,
        repeats: Repeats | None = None,
    ) -> torch.Tensor:
        """Run embedded rows through the decoder with ``attend`` over their caches; return final
        states."""
        return cast(
            torch.Tensor, self.language_model.model(x, rope, Routing.of(is_gen), attend, repeats)
        )

    # -- the step --------------------------------------------------------------------------

    def step(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        ctx: PagedKVContext,
        rope_offsets: dict[str, int],
    ) -> torch.Tensor:
        """Run a step's chunks jointly over the paged cache; return every row's final state.

        ``rope_offsets`` maps each sequence (engine id) to its cache position less its RoPE
        position after its last payload; the step updates it from the payloads it writes.
        """
        cfg = self.config.llm
        xs: list[torch.Tensor] = []
        ropes: list[torch.Tensor] = []
        gens: list[torch.Tensor] = []
        # The CFG branches of one flow step query the same latents: embedded (and projected
        # by the first layer) once. Per chunk: the index of the chunk it repeats, or its own.
        firsts: list[int] = []
        queries: list[tuple[int, ImageInput]] = []
        for chunk in ctx.step.chunks:
            payload = chunk.payload
            if payload is None:  # sampled tokens: RoPE follows the sequence's last payload
                rows = slice(chunk.row_start, chunk.row_end)
                xs.append(self._embed_tokens(input_ids[rows]))
                ropes.append(positions[rows] - rope_offsets.get(chunk.seq_key, 0))
                gens.append(torch.zeros(chunk.num_rows, dtype=torch.bool, device=positions.device))
                firsts.append(len(xs) - 1)
                continue
            first = next((j for j, q in queries if _same_query(q, payload)), None)
            if first is None:
                x, rope, is_gen = self._embed_input(payload)
                if isinstance(payload, ImageInput) and payload.kind == "flow":
                    queries.append((len(xs), payload))
            else:
                x, is_gen = xs[first], gens[first]
                rope = torch.full((x.shape[0],), payload.rope, device=x.device)
            firsts.append(len(xs) if first is None else first)
            if x.shape[0] != chunk.num_rows:
                raise ValueError(
                    f"a payload of {x.shape[0]} rows was scheduled as {chunk.num_rows}"
                )
            if not chunk.is_read_only:
                rope_offsets[chunk.seq_key] = chunk.position + chunk.num_rows - payload.rope_end
            xs.append(x)
            ropes.append(rope)
            gens.append(is_gen)
        scale = cfg.head_dim**-0.5

        def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return ctx.attend(i, q, k, v, scale)

        is_gen = torch.cat(gens)
        repeats = (
            _repeats(firsts, [x.shape[0] for x in xs], is_gen)
            if len(set(firsts)) < len(firsts)
            else None
        )
        # a shard's rows summed over its group: one all-reduce for the step's embeddings
        x = self.language_model.reduce(torch.cat(xs))
        return self.run(x, torch.cat(ropes), is_gen, attend, repeats)


def _same_query(a: ImageInput, b: TextInput | ImageInput) -> bool:
    """Whether two flow queries hold the same latents at the same time (their RoPE positions may
    differ)."""
    if not isinstance(b, ImageInput) or b.kind != "flow" or a.timestep != b.timestep:
        return False
    if a.tokens is not b.tokens and not (
        a.tokens.shape == b.tokens.shape and torch.equal(a.tokens, b.tokens)
    ):
        return False
    assert a.latent_positions is not None and b.latent_positions is not None
    return a.latent_positions is b.latent_positions or torch.equal(
        a.latent_positions, b.latent_positions
    )


def _repeats(firsts: list[int], sizes: list[int], is_gen: torch.Tensor) -> Repeats:
    """Return which rows repeat which: chunk ``i`` repeats chunk ``firsts[i]`` (itself:
    computed)."""
    starts = [0]
    for size in sizes:
        starts.append(starts[-1] + size)
    distinct_chunks = sorted(set(firsts))
    offset = {}  # a computed chunk's first row among the distinct rows
    count = 0
    for i in distinct_chunks:
        offset[i] = count
        count += sizes[i]
    distinct = torch.cat([torch.arange(starts[i], starts[i + 1]) for i in distinct_chunks])
    expand = torch.cat([offset[f] + torch.arange(sizes[i]) for i, f in enumerate(firsts)])
    device = is_gen.device
    distinct, expand = distinct.to(device), expand.to(device)
    return Repeats(distinct, expand, Routing.of(is_gen.index_select(0, distinct)))
