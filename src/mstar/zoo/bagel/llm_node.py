"""BAGEL's LLM nodes: every one on one paged cache (the ``llm`` node's engine).

Every LLM node runs on the ``llm`` node's engine (`SupportsSharedEngines`); `LLMNode` tells
their firings apart by their inputs:

```
node              inputs                              does
llm               segments, context, parts            prefill the next text item (forward); decode text (token walk)
llm_vit           vit_embeds, context, parts          prefill an image's ViT tokens
llm_vae           vae_latents, context, parts         prefill an image's VAE tokens
denoise           cond_query, context, parts          one flow step's velocity over the full context
denoise_cfg_text  cfg_text_query, context, cfg_text_parts   ... over the context without the latest text
denoise_cfg_img   cfg_img_query, context, cfg_img_parts     ... over the context without images
```

A prefill returns the new `ContextState` (to every node that follows the items) and the
inputs of each branch's context (`Parts`, to that branch's node, and the full ones to the
prefilling nodes, which append to them): only a branch placed on a rank of its own reads
them, to rebuild its context. A query of None is a branch this step does not need: its
firing runs nothing (no chunk) and returns a velocity of None.
"""  # noqa: E501 (a table or diagram)

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar, Literal

import torch

from mstar.engines.interfaces import FiringRows, KVChunk, KVForward, KVTurn, PagedKVContext
from mstar.engines.kv_cache import KVCacheSpec
from mstar.engines.kv_engine import KVCacheEngineConfig
from mstar.engines.masks import AttentionMask
from mstar.engines.parallel import TensorShard, mirrored
from mstar.engines.sampler import TokenLogprobs
from mstar.engines.sampling_params import SamplingParams
from mstar.zoo.bagel.context import Context, ContextState, Part, Parts, TextItem
from mstar.zoo.bagel.flow import BRANCHES
from mstar.zoo.bagel.latents import latent_grid
from mstar.zoo.bagel.llm import GEN
from mstar.zoo.bagel.nodes import (
    FlowState,
    Segments,
    VaeLatents,
    parts_input,
    prefilled,
    query_input,
    velocity_output,
)
from mstar.zoo.bagel.weights import BagelWeights, ImageInput, TextInput

__all__ = ["LLMNode"]


class LLMNode:
    """Every LLM node of BAGEL on one paged cache (a `ForwardKVNode` with token walks).

    Args:
        weights: The model.
        engine_config: The cache's settings.
        branch: None for the ``llm`` node's engine, which holds every context of a request
            (each LLM node co-located with it runs on it); a CFG branch for that branch's
            node placed on a rank of its own: its engine rebuilds the branch's context from
            the persisted ``parts`` at the request's first query, then queries a fork of it.
    """

    forward_walks: ClassVar[Literal[True]] = True
    token_walks: ClassVar[Literal[True]] = True

    def __init__(
        self,
        weights: BagelWeights,
        engine_config: KVCacheEngineConfig | None = None,
        *,
        branch: str | None = None,
    ) -> None:
        self.model = _EngineView(weights)
        self.weights = weights
        self.config = weights.config
        self.branch = branch
        self.engine_config = engine_config or KVCacheEngineConfig(
            block_size=16,
            max_num_seqs=64,
            max_num_batched_tokens=8192,
            max_model_len=weights.config.llm.max_position,
            enable_prefix_caching=False,  # inputs are payloads: never shared by token hash
            cuda_graphs=False,
        )
        self._full = AttentionMask.full()
        # requests whose branch context this engine holds (``branch`` set)
        self._built: set[str] = set()
        self._decoding: dict[str, ContextState] = {}  # requests decoding a planning text

    # -- forward firings -----------------------------------------------------------------

    def forward(self, request_id: str, inputs: Mapping[str, Any]) -> KVForward:
        """Return a firing's chunks: a prefill of the next item, or one branch's flow query.

        Raises:
            ValueError: Inputs of no LLM node, or an item of the wrong kind.
        """
        state = ContextState.of(inputs["context"])
        if "segments" in inputs:
            return self._text(state, Segments.of(inputs["segments"]))
        if "vit_embeds" in inputs:
            payload = ImageInput("vit", inputs["vit_embeds"], state.cond.rope)
            return KVForward(
                [
                    KVChunk(
                        payload=payload,
                        num_tokens=payload.num_tokens,
                        mask=self._full,
                        output="none",
                    )
                ]
            )
        if "vae_latents" in inputs:
            latents = VaeLatents.of(inputs["vae_latents"])
            positions = latent_grid(self.weights, latents.height, latents.width)
            payload = ImageInput("vae", latents.tokens, state.cond.rope, positions, 0.0)
            chunk = KVChunk(
                payload=payload,
                num_tokens=payload.num_tokens,
                mask=self._full,
                expert=GEN,
                output="none",
            )
            return KVForward([chunk])
        for branch in BRANCHES:
            if query_input(branch) in inputs:
                flow = FlowState.of(inputs[query_input(branch)])
                if self.branch is not None:
                    return self._own_query(
                        request_id, branch, state, flow, Parts.of(inputs[parts_input(branch)])
                    )
                return self._query(branch, state, flow)
        raise ValueError(f"no LLM node of BAGEL takes inputs {sorted(inputs)}")

    def _text(self, state: ContextState, segments: Segments) -> KVForward:
        # the planning text: the decode's tokens, recomputed as a text item
        if state.think_ids is not None:
            tokens = self.config.tokens
            ids = torch.tensor([tokens.bos, *state.think_ids, tokens.eos], dtype=torch.long)
            text = TextInput(ids, state.cond.rope)
            return KVForward(
                [
                    KVChunk(
                        payload=text,
                        num_tokens=len(ids),
                        output="none",
                        truncate=state.cond.num_tokens,
                    )
                ]
            )
        item = segments.items[state.cursor]
        if not isinstance(item, TextItem):
            raise ValueError(f"item {state.cursor} is not text")
        ids = item.token_ids
        chunks = [
            KVChunk(payload=TextInput(ids, state.cond.rope), num_tokens=len(ids), output="none")
        ]
        # the image-free context takes the text on a sequence of its own
        if not state.image_free_follows:
            own = state.cfg_img
            text = TextInput(ids, own.rope)
            if own.seq == "cfg_img":
                chunks.append(
                    KVChunk(seq="cfg_img", payload=text, num_tokens=len(ids), output="none")
                )
            elif own.num_tokens > 0:  # "" up to its first image, forked there
                chunks.append(
                    KVChunk(
                        seq="cfg_img",
                        payload=text,
                        num_tokens=len(ids),
                        output="none",
                        fork_from="",
                        fork_tokens=own.num_tokens,
                    )
                )
            else:
                chunks.append(
                    KVChunk(
                        seq="cfg_img", payload=text, num_tokens=len(ids), output="none", reset=True
                    )
                )
        return KVForward(chunks)

    def _flow_payload(self, ctx: Context, flow: FlowState) -> ImageInput:
        t, _ = flow.spec.step(flow.step)
        positions = latent_grid(self.weights, flow.spec.height, flow.spec.width)
        return ImageInput("flow", flow.x, ctx.rope, positions, t)

    def _query(self, branch: str, state: ContextState, flow: FlowState | None) -> KVForward:
        if flow is None:
            return KVForward([])  # a branch this step does not need
        ctx = state.context(branch)
        payload = self._flow_payload(ctx, flow)
        n = payload.num_tokens
        if ctx.num_tokens == 0:  # an empty context: the query alone, on a sequence dropped after it
            chunk = KVChunk(
                seq=f"{branch}~",
                payload=payload,
                num_tokens=n,
                mask=self._full,
                expert=GEN,
                reset=True,
                release=True,
            )
        elif ctx.seq == "" and ctx.num_tokens == state.cond.num_tokens:
            chunk = KVChunk(
                payload=payload, num_tokens=n, mask=self._full, expert=GEN, read_only=True
            )
        elif ctx.seq == "":  # a prefix of the full context: a fork of it (block tables only)
            chunk = KVChunk(
                seq=branch,
                payload=payload,
                num_tokens=n,
                mask=self._full,
                expert=GEN,
                read_only=True,
                fork_from="",
                fork_tokens=ctx.num_tokens,
            )
        else:
            chunk = KVChunk(
                seq=ctx.seq,
                payload=payload,
                num_tokens=n,
                mask=self._full,
                expert=GEN,
                read_only=True,
            )
        return KVForward([chunk])

    def _own_query(
        self,
        request_id: str,
        branch: str,
        state: ContextState,
        flow: FlowState | None,
        parts: Parts,
    ) -> KVForward:
        """Query a branch's context on an engine of the branch's own (another rank than ``llm``'s).

        ```
        first query   own: [ part | part | ... | query ]     the context rebuilt, then the query (written)
        later ones    own~ = fork of own at the context's end, queried read-only
        ```
        """  # noqa: E501 (a table or diagram)
        if flow is None:
            return KVForward([])
        ctx = state.context(branch)
        if ctx.num_tokens == 0:
            return self._query(branch, state, flow)
        payload = self._flow_payload(ctx, flow)
        n = payload.num_tokens
        own = f"{branch}:own"
        if request_id in self._built:
            chunk = KVChunk(
                seq=f"{own}~",
                payload=payload,
                num_tokens=n,
                mask=self._full,
                expert=GEN,
                read_only=True,
                fork_from=own,
                fork_tokens=ctx.num_tokens,
            )
            return KVForward([chunk])
        if parts.num_tokens != ctx.num_tokens:
            raise ValueError(
                f"the persisted inputs of context {branch!r} do not make its "
                f"{ctx.num_tokens} tokens"
            )
        chunks = [
            self._part_chunk(own, p, output="none", reset=i == 0) for i, p in enumerate(parts.parts)
        ]
        chunks.append(KVChunk(seq=own, payload=payload, num_tokens=n, mask=self._full, expert=GEN))
        self._built.add(request_id)
        return KVForward(chunks)

    def _part_chunk(self, seq: str, part: Part, **extra: Any) -> KVChunk:
        if isinstance(part, TextInput):
            return KVChunk(seq=seq, payload=part, num_tokens=part.num_tokens, **extra)
        expert = GEN if part.kind != "vit" else 0
        return KVChunk(
            seq=seq,
            payload=part,
            num_tokens=part.num_tokens,
            mask=self._full,
            expert=expert,
            **extra,
        )

    @torch.inference_mode()
    def forward_outputs(self, firings: list[FiringRows]) -> list[Mapping[str, Any] | BaseException]:
        """Return new context states of prefills, and every query's velocity (one head product)."""
        queried = [(i, f) for i, f in enumerate(firings) if f.rows and f.rows[-1] is not None]
        velocities: dict[int, torch.Tensor] = {}
        if queried:
            rows = [f.rows[-1][1:-1] for _, f in queried if f.rows[-1] is not None]
            v = self.weights.llm2vae(torch.cat(rows)).float().split([r.shape[0] for r in rows])
            velocities = {i: vi for (i, _), vi in zip(queried, v, strict=True)}
        out: list[Mapping[str, Any] | BaseException] = []
        for i, f in enumerate(firings):
            try:
                out.append(self._outputs(f.inputs, velocities.get(i)))
            except Exception as exc:  # this firing's own failure
                out.append(exc)
        return out

    def _outputs(
        self, inputs: Mapping[str, Any], velocity: torch.Tensor | None
    ) -> Mapping[str, Any]:
        state = ContextState.of(inputs["context"])
        if "segments" in inputs:
            if state.think_ids is not None:
                ids = torch.tensor(
                    [self.config.tokens.bos, *state.think_ids, self.config.tokens.eos],
                    dtype=torch.long,
                )
                think = TextInput(ids, state.cond.rope)
                return prefilled(inputs, state.after_think(think), think)
            item = Segments.of(inputs["segments"]).items[state.cursor]
            assert isinstance(item, TextItem)
            text = TextInput(item.token_ids, state.cond.rope)
            return prefilled(inputs, state.after_text(text), text)
        if "vit_embeds" in inputs:
            vit = ImageInput("vit", inputs["vit_embeds"], state.cond.rope)
            return prefilled(inputs, state.after_image(vit, is_last_part=True), vit)
        if "vae_latents" in inputs:
            latents = VaeLatents.of(inputs["vae_latents"])
            positions = latent_grid(self.weights, latents.height, latents.width)
            payload = ImageInput("vae", latents.tokens, state.cond.rope, positions, 0.0)
            return prefilled(
                inputs, state.after_image(payload, is_last_part=not latents.then_vit), payload
            )
        branch = next(b for b in BRANCHES if query_input(b) in inputs)
        return {velocity_output(branch): velocity}

    def release(self, request_id: str) -> None:
        """Forget what is noted for a request: its sequences' RoPE offsets, its rebuilt context."""
        self.model.forget(request_id)
        self._built.discard(request_id)
        self._decoding.pop(request_id, None)

    # -- token walks (understanding text, planning text) ---------------------------------

    def turn(self, request_id: str, inputs: Mapping[str, Any], *, is_first: bool) -> KVTurn:
        """Decode from ``<|im_start|>`` after the request's context, until ``<|im_end|>``.

        Greedily, unless the request's sampling says otherwise (answers only; a planning text is
        greedy).
        """
        if is_first:
            raise ValueError(
                "decode needs the request's context in this engine: prefill it first, on this rank"
            )
        segments = Segments.of(inputs["segments"])
        state = ContextState.of(inputs["context"])
        if state.cursor >= len(segments.items) and segments.is_think:
            self._decoding[request_id] = state
        tokens = self.config.tokens
        sampling: dict[str, Any] = {"temperature": 0.0, **dict(segments.sampling)}
        params = SamplingParams(
            **sampling, max_tokens=max(1, segments.max_tokens), stop_token_ids=(tokens.eos,)
        )
        return KVTurn([tokens.bos], params, is_done=segments.max_tokens < 1)

    def outputs(
        self,
        request_id: str,
        token_id: int,
        history: list[int] | None,
        *,
        logprobs: TokenLogprobs | None = None,
    ) -> Mapping[str, Any]:
        """Emit each token but ``<|im_end|>`` (with its log-probabilities if asked); the walk's last
        token stops the loop.

        After a planning text the context state takes its tokens (they are prefilled next).
        """
        out: dict[str, Any] = {"stop": history is not None}
        eos = self.config.tokens.eos
        if token_id != eos:
            out["token"] = token_id if logprobs is None else logprobs.to_dict()
        if history is not None and request_id in self._decoding:
            state = self._decoding.pop(request_id)
            generated = history[state.cond.num_tokens + 1 :]  # after the context and <|im_start|>
            if generated and generated[-1] == eos:
                generated = generated[:-1]
            out["context"] = state.with_think(generated)
        return out


class _EngineView:
    """The weights' paged step as one engine sees it: the RoPE offsets of its own sequences.

    Ranks in one process share the weights; each engine notes the offsets of its sequences.
    A tensor-parallel rank's weights hold its shard (`SupportsTensorParallel`): a follower's
    view notes the same offsets from the same steps, and forgets a request when the leader's
    does (`mirrored`).
    """

    supports_step_chunks: ClassVar[Literal[True]] = True
    supports_tensor_parallel: ClassVar[Literal[True]] = True

    def __init__(self, weights: BagelWeights) -> None:
        self.weights = weights
        self.rope_offsets: dict[str, int] = {}

    @property
    def tensor_shard(self) -> TensorShard | None:
        """The tensor-parallel shard the LLM's weights hold (None: all of them)."""
        return self.weights.language_model.tensor_shard

    @property
    def kv_cache_spec(self) -> KVCacheSpec:
        """Return the cache geometry."""
        return self.weights.kv_cache_spec

    @property
    def max_position(self) -> int:
        """Return the longest sequence of cache positions."""
        return self.weights.max_position

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Return next-token logits of text rows."""
        return self.weights.compute_logits(hidden)

    def __call__(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: PagedKVContext
    ) -> torch.Tensor:
        """Run a step over the paged cache."""
        return self.weights.step(input_ids, positions, ctx, self.rope_offsets)

    @mirrored
    def forget(self, request_id: str) -> None:
        """Drop the offsets noted for a request's sequences (on a tensor-parallel group's every
        rank)."""
        for key in [
            k for k in self.rope_offsets if k == request_id or k.startswith(f"{request_id}/")
        ]:
            self.rope_offsets.pop(key, None)
