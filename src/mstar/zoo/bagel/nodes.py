"""BAGEL's nodes: the image encoders, the LLM (one paged cache for every LLM node), the CFG combine, the VAE decoder.

Every LLM node runs on the ``llm`` node's engine (`SupportsSharedEngines`); `LLMNode` tells
their firings apart by their inputs:

```
node              inputs                       does
llm               segments, context            prefill the next text item (forward); decode text (token walk)
llm_vit           vit_embeds, context          prefill an image's ViT tokens
llm_vae           vae_latents, context         prefill an image's VAE tokens
denoise           cond_query, context          one flow step's velocity over the full context
denoise_cfg_text  cfg_text_query, context      ... over the context without the latest text
denoise_cfg_img   cfg_img_query, context       ... over the context without images
```

A query of None is a branch this step does not need: its firing runs nothing (no chunk) and
returns a velocity of None. `CombineNode` decides that for the next step, per request (the
step's time against ``cfg_interval``, the scales), so the skipping is data in the walk.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from io import BytesIO
from typing import Any, ClassVar, Literal

import numpy as np
import torch
from PIL import Image

from mstar.engines.kv_engine import KVCacheEngineConfig
from mstar.engines.kv_node import FiringRows, KVChunk, KVForward, KVTurn
from mstar.engines.masks import AttentionMask
from mstar.engines.sampling_params import SamplingParams
from mstar.zoo.bagel.context import ContextState, ImageItem, Item, TextItem
from mstar.zoo.bagel.flow import BRANCHES, FlowSpec, guidance
from mstar.zoo.bagel.llm import GEN
from mstar.zoo.bagel.reference import decode_image, latent_grid, vae_tokens
from mstar.zoo.bagel.vae import FluxVAE
from mstar.zoo.bagel.weights import BagelWeights, ImageInput, TextInput

__all__ = [
    "CombineNode",
    "FlowState",
    "LLMNode",
    "Segments",
    "VaeDecoderNode",
    "VaeEncoderNode",
    "VaeLatents",
    "VitNode",
    "query_input",
    "velocity_output",
]


def query_input(branch: str) -> str:
    """Return the input name of a branch's flow query."""
    return f"{branch}_query"


def velocity_output(branch: str) -> str:
    """Return the output name of a branch's velocity."""
    return f"v_{branch}"


@dataclass(frozen=True, slots=True)
class Segments:
    """A request's items and how many text tokens it may decode."""

    items: tuple[Item, ...]
    max_tokens: int = 0


@dataclass(frozen=True, slots=True)
class VaeLatents:
    """An input image's latent tokens ``[h*w, p*p*z]`` on an ``h x w`` grid; ``then_vit``: its ViT path follows."""

    tokens: torch.Tensor
    height: int
    width: int
    then_vit: bool


@dataclass(frozen=True, slots=True)
class FlowState:
    """The flow of one image: the latents ``x`` before step ``step``, and its spec."""

    x: torch.Tensor
    step: int
    spec: FlowSpec


def _current(inputs: Mapping[str, Any]) -> ImageItem:
    segments: Segments = inputs["segments"]
    state: ContextState = inputs["context"]
    item = segments.items[state.cursor]
    if not isinstance(item, ImageItem):
        raise ValueError(f"item {state.cursor} is not an image")
    return item


class VitNode:
    """``vit``: the current image item through the SigLIP NaViT and connector -> ``vit_embeds``."""

    def __init__(self, weights: BagelWeights) -> None:
        self.weights = weights

    @torch.inference_mode()
    def __call__(self, batch: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
        """Encode each request's image (sizes differ, so one at a time)."""
        out: list[Mapping[str, Any]] = []
        for inputs in batch:
            image = _current(inputs).vit
            if image is None:
                raise ValueError("the current image has no ViT input")
            out.append({"vit_embeds": self.weights.embed_vit(image)})
        return out


class VaeEncoderNode:
    """``vae_encoder``: the current image item through the VAE, patchified -> ``vae_latents``."""

    def __init__(self, weights: BagelWeights, vae: FluxVAE) -> None:
        self.weights, self.vae = weights, vae

    @torch.inference_mode()
    def __call__(self, batch: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
        """Encode each request's image."""
        cfg = self.weights.config
        out: list[Mapping[str, Any]] = []
        for inputs in batch:
            item = _current(inputs)
            if item.vae is None:
                raise ValueError("the current image has no VAE input")
            down = cfg.latent_downsample
            tokens = vae_tokens(self.vae, item.vae, cfg.latent_patch_size)
            height, width = item.vae.shape[1] // down, item.vae.shape[2] // down
            out.append({"vae_latents": VaeLatents(tokens, height, width, item.vit is not None)})
        return out


class LLMNode:
    """Every LLM node of BAGEL on one paged cache (a `ForwardKVNode` with token walks)."""

    forward_walks: ClassVar[Literal[True]] = True
    token_walks: ClassVar[Literal[True]] = True

    def __init__(self, weights: BagelWeights, engine_config: KVCacheEngineConfig | None = None) -> None:
        self.model = weights
        self.config = weights.config
        self.engine_config = engine_config or KVCacheEngineConfig(
            block_size=16,
            max_num_seqs=64,
            max_num_batched_tokens=8192,
            max_model_len=weights.config.llm.max_position,
            enable_prefix_caching=False,  # inputs are payloads: never shared by token hash
            cuda_graphs=False,
        )
        self._full = AttentionMask.full()

    # -- forward firings -----------------------------------------------------------------

    def forward(self, request_id: str, inputs: Mapping[str, Any]) -> KVForward:
        """Return a firing's chunks: a prefill of the next item, or one branch's flow query.

        Raises:
            ValueError: Inputs of no LLM node, or an item of the wrong kind.
        """
        state: ContextState = inputs["context"]
        if "segments" in inputs:
            return self._text(state, inputs["segments"])
        if "vit_embeds" in inputs:
            payload = ImageInput("vit", inputs["vit_embeds"], state.cond.rope)
            return KVForward([KVChunk(payload=payload, num_tokens=payload.num_tokens, mask=self._full, output="none")])
        if "vae_latents" in inputs:
            latents: VaeLatents = inputs["vae_latents"]
            positions = latent_grid(self.model, latents.height, latents.width)
            payload = ImageInput("vae", latents.tokens, state.cond.rope, positions, 0.0)
            chunk = KVChunk(payload=payload, num_tokens=payload.num_tokens, mask=self._full, expert=GEN, output="none")
            return KVForward([chunk])
        for branch in BRANCHES:
            if query_input(branch) in inputs:
                return self._query(branch, state, inputs[query_input(branch)])
        raise ValueError(f"no LLM node of BAGEL takes inputs {sorted(inputs)}")

    def _text(self, state: ContextState, segments: Segments) -> KVForward:
        item = segments.items[state.cursor]
        if not isinstance(item, TextItem):
            raise ValueError(f"item {state.cursor} is not text")
        ids = item.token_ids
        chunks = [KVChunk(payload=TextInput(ids, state.cond.rope), num_tokens=len(ids), output="none")]
        if not state.image_free_follows:  # the image-free context takes the text on a sequence of its own
            own = state.cfg_img
            text = TextInput(ids, own.rope)
            if own.seq == "cfg_img":
                chunks.append(KVChunk(seq="cfg_img", payload=text, num_tokens=len(ids), output="none"))
            elif own.num_tokens > 0:  # "" up to its first image, forked there
                chunks.append(
                    KVChunk(seq="cfg_img", payload=text, num_tokens=len(ids), output="none", fork_from="", fork_tokens=own.num_tokens)
                )
            else:
                chunks.append(KVChunk(seq="cfg_img", payload=text, num_tokens=len(ids), output="none", reset=True))
        return KVForward(chunks)

    def _query(self, branch: str, state: ContextState, flow: FlowState | None) -> KVForward:
        if flow is None:
            return KVForward([])  # a branch this step does not need
        ctx = state.context(branch)
        t, _ = flow.spec.step(flow.step)
        positions = latent_grid(self.model, flow.spec.height, flow.spec.width)
        payload = ImageInput("flow", flow.x, ctx.rope, positions, t)
        n = payload.num_tokens
        if ctx.num_tokens == 0:  # an empty context: the query alone, on a sequence dropped after it
            chunk = KVChunk(seq=f"{branch}~", payload=payload, num_tokens=n, mask=self._full, expert=GEN, reset=True, release=True)
        elif ctx.seq == "" and ctx.num_tokens == state.cond.num_tokens:
            chunk = KVChunk(payload=payload, num_tokens=n, mask=self._full, expert=GEN, read_only=True)
        elif ctx.seq == "":  # a prefix of the full context: a fork of it (block tables only)
            chunk = KVChunk(
                seq=branch, payload=payload, num_tokens=n, mask=self._full, expert=GEN, read_only=True,
                fork_from="", fork_tokens=ctx.num_tokens,
            )
        else:
            chunk = KVChunk(seq=ctx.seq, payload=payload, num_tokens=n, mask=self._full, expert=GEN, read_only=True)
        return KVForward([chunk])

    @torch.inference_mode()
    def forward_outputs(self, firings: list[FiringRows]) -> list[Mapping[str, Any] | BaseException]:
        """Return new context states of prefills, and every query's velocity (one head product)."""
        queried = [(i, f) for i, f in enumerate(firings) if f.rows and f.rows[0] is not None]
        velocities: dict[int, torch.Tensor] = {}
        if queried:
            rows = [f.rows[0][1:-1] for _, f in queried if f.rows[0] is not None]
            v = self.model.llm2vae(torch.cat(rows)).float().split([r.shape[0] for r in rows])
            velocities = {i: vi for (i, _), vi in zip(queried, v, strict=True)}
        out: list[Mapping[str, Any] | BaseException] = []
        for i, f in enumerate(firings):
            try:
                out.append(self._outputs(f.inputs, velocities.get(i)))
            except Exception as exc:  # this firing's own failure
                out.append(exc)
        return out

    def _outputs(self, inputs: Mapping[str, Any], velocity: torch.Tensor | None) -> Mapping[str, Any]:
        state: ContextState = inputs["context"]
        if "segments" in inputs:
            item = inputs["segments"].items[state.cursor]
            return {"context": state.after_text(len(item.token_ids))}
        if "vit_embeds" in inputs:
            return {"context": state.after_image(inputs["vit_embeds"].shape[0] + 2, is_last_part=True)}
        if "vae_latents" in inputs:
            latents: VaeLatents = inputs["vae_latents"]
            return {"context": state.after_image(latents.tokens.shape[0] + 2, is_last_part=not latents.then_vit)}
        branch = next(b for b in BRANCHES if query_input(b) in inputs)
        return {velocity_output(branch): velocity}

    def release(self, request_id: str) -> None:
        """Forget the RoPE offsets noted for a request's sequences."""
        self.model.forget(request_id)

    # -- token walks (understanding text) ------------------------------------------------

    def turn(self, request_id: str, inputs: Mapping[str, Any], *, is_first: bool) -> KVTurn:
        """Decode greedily from ``<|im_start|>`` after the request's context, until ``<|im_end|>``."""
        if is_first:
            raise ValueError("decode needs the request's context in this engine: prefill it first, on this rank")
        segments: Segments = inputs["segments"]
        tokens = self.config.tokens
        params = SamplingParams(temperature=0.0, max_tokens=max(1, segments.max_tokens), stop_token_ids=(tokens.eos,))
        return KVTurn([tokens.bos], params, is_done=segments.max_tokens < 1)

    def outputs(self, request_id: str, token_id: int, history: list[int] | None) -> Mapping[str, Any]:
        """Emit each token but ``<|im_end|>``; the walk's last token stops the loop."""
        out: dict[str, Any] = {"stop": history is not None}
        if token_id != self.config.tokens.eos:
            out["token"] = token_id
        return out


class CombineNode:
    """``cfg_combine``: guide and take one Euler step; say which branches the next step needs."""

    def __call__(self, batch: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
        """Integrate every request's step."""
        return [self.step(inputs) for inputs in batch]

    @torch.inference_mode()
    def step(self, inputs: Mapping[str, Any]) -> Mapping[str, Any]:
        """Return the next flow and its queries, or, after the last step, the latents."""
        flow: FlowState = inputs["flow"]
        spec = flow.spec
        v = guidance(spec, inputs[velocity_output("cond")], inputs[velocity_output("cfg_text")], inputs[velocity_output("cfg_img")])
        _, dt = spec.step(flow.step)
        nxt = FlowState(flow.x - v * dt, flow.step + 1, spec)
        out: dict[str, Any] = {"flow": nxt, **queries(nxt)}
        if nxt.step == spec.num_steps:
            out.update({"latents": nxt.x, "done": True})
        return out


def queries(flow: FlowState) -> dict[str, FlowState | None]:
    """Return each branch's query for the flow's step: the flow itself, or None where it is not needed."""
    if flow.step >= flow.spec.num_steps:
        return dict.fromkeys(map(query_input, BRANCHES))
    run = flow.spec.branches(flow.step)
    return {query_input(b): flow if b in run else None for b in BRANCHES}


class VaeDecoderNode:
    """``vae_decoder``: latent tokens -> PNG bytes."""

    def __init__(self, weights: BagelWeights, vae: FluxVAE) -> None:
        self.weights, self.vae = weights, vae

    def __call__(self, batch: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
        """Decode every request's image."""
        return [{"image": png_bytes(self.decode(inputs))} for inputs in batch]

    def decode(self, inputs: Mapping[str, Any]) -> np.ndarray:
        """Return the uint8 pixels of a request's final latents."""
        flow: FlowState = inputs["flow"]
        return decode_image(self.weights, self.vae, inputs["latents"], flow.spec.height, flow.spec.width)


def png_bytes(pixels: np.ndarray) -> bytes:
    """Encode ``[H, W, 3]`` uint8 pixels as PNG."""
    buffer = BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def initial_flow(spec: FlowSpec, noise: torch.Tensor) -> FlowState:
    """Return a flow's state before its first step."""
    return FlowState(noise.float(), 0, spec)


