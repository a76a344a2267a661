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

from mstar.engines.kv_cache import KVCacheSpec
from mstar.engines.kv_engine import KVCacheEngineConfig
from mstar.engines.kv_node import FiringRows, KVChunk, KVForward, KVTurn
from mstar.engines.masks import AttentionMask
from mstar.engines.paged_model import PagedKVContext
from mstar.engines.sampling_params import SamplingParams
from mstar.zoo.bagel.context import (
    Context,
    ContextState,
    ImageItem,
    Item,
    Part,
    TextItem,
    item_form,
    item_of,
)
from mstar.zoo.bagel.flow import BRANCHES, CFG_IMG, CFG_TEXT, FlowSpec, guidance
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
    """A request's items and how many text tokens it may decode (the answer, or the planning text)."""

    has_wire_form: ClassVar[Literal[True]] = True

    items: tuple[Item, ...]
    max_tokens: int = 0
    is_think: bool = False  # the decode after the items is a planning text, then an image

    def wire_form(self) -> dict[str, Any]:
        """Return the segments as plain data."""
        return {"items": [item_form(i) for i in self.items], "max_tokens": self.max_tokens, "is_think": self.is_think}

    @classmethod
    def of(cls, value: Segments | Mapping[str, Any]) -> Segments:
        """Read segments back (or pass them through)."""
        if isinstance(value, Segments):
            return value
        return cls(tuple(item_of(i) for i in value["items"]), int(value["max_tokens"]), bool(value["is_think"]))


@dataclass(frozen=True, slots=True)
class VaeLatents:
    """An input image's latent tokens ``[h*w, p*p*z]`` on an ``h x w`` grid; ``then_vit``: its ViT path follows."""

    has_wire_form: ClassVar[Literal[True]] = True

    tokens: torch.Tensor
    height: int
    width: int
    then_vit: bool

    def wire_form(self) -> dict[str, Any]:
        """Return the latents as plain data."""
        return {"tokens": self.tokens, "height": self.height, "width": self.width, "then_vit": self.then_vit}

    @classmethod
    def of(cls, value: VaeLatents | Mapping[str, Any]) -> VaeLatents:
        """Read latents back (or pass them through)."""
        if isinstance(value, VaeLatents):
            return value
        return cls(value["tokens"], int(value["height"]), int(value["width"]), bool(value["then_vit"]))


@dataclass(frozen=True, slots=True)
class FlowState:
    """The flow of one image: the latents ``x`` before step ``step``, and its spec."""

    has_wire_form: ClassVar[Literal[True]] = True

    x: torch.Tensor
    step: int
    spec: FlowSpec

    def wire_form(self) -> dict[str, Any]:
        """Return the flow as plain data."""
        return {"x": self.x, "step": self.step, "spec": self.spec.wire_form()}

    @classmethod
    def of(cls, value: FlowState | Mapping[str, Any] | None) -> FlowState | None:
        """Read a flow back (or pass one, or None, through)."""
        if value is None or isinstance(value, FlowState):
            return value
        return cls(value["x"], int(value["step"]), FlowSpec.of_value(value["spec"]))


def _current(inputs: Mapping[str, Any]) -> ImageItem:
    segments = Segments.of(inputs["segments"])
    state = ContextState.of(inputs["context"])
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

    def __init__(self, weights: BagelWeights, engine_config: KVCacheEngineConfig | None = None, *, branch: str | None = None) -> None:
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
        self._built: set[str] = set()  # requests whose branch context this engine holds (``branch`` set)
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
            return KVForward([KVChunk(payload=payload, num_tokens=payload.num_tokens, mask=self._full, output="none")])
        if "vae_latents" in inputs:
            latents = VaeLatents.of(inputs["vae_latents"])
            positions = latent_grid(self.weights, latents.height, latents.width)
            payload = ImageInput("vae", latents.tokens, state.cond.rope, positions, 0.0)
            chunk = KVChunk(payload=payload, num_tokens=payload.num_tokens, mask=self._full, expert=GEN, output="none")
            return KVForward([chunk])
        for branch in BRANCHES:
            if query_input(branch) in inputs:
                flow = FlowState.of(inputs[query_input(branch)])
                if self.branch is not None:
                    return self._own_query(request_id, branch, state, flow)
                return self._query(branch, state, flow)
        raise ValueError(f"no LLM node of BAGEL takes inputs {sorted(inputs)}")

    def _text(self, state: ContextState, segments: Segments) -> KVForward:
        if state.think_ids is not None:  # the planning text: the decode's tokens, recomputed as a text item
            tokens = self.config.tokens
            ids = torch.tensor([tokens.bos, *state.think_ids, tokens.eos], dtype=torch.long)
            text = TextInput(ids, state.cond.rope)
            return KVForward([KVChunk(payload=text, num_tokens=len(ids), output="none", truncate=state.cond.num_tokens)])
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

    def _own_query(self, request_id: str, branch: str, state: ContextState, flow: FlowState | None) -> KVForward:
        """Query a branch's context on an engine of the branch's own (another rank than ``llm``'s).

        ```
        first query   own: [ part | part | ... | query ]     the context rebuilt, then the query (written)
        later ones    own~ = fork of own at the context's end, queried read-only
        ```
        """
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
                seq=f"{own}~", payload=payload, num_tokens=n, mask=self._full, expert=GEN, read_only=True,
                fork_from=own, fork_tokens=ctx.num_tokens,
            )
            return KVForward([chunk])
        parts = state.branch_parts(branch)
        if sum(p.num_tokens for p in parts) != ctx.num_tokens:
            raise ValueError(f"the persisted inputs of context {branch!r} do not make its {ctx.num_tokens} tokens")
        chunks = [self._part_chunk(own, p, output="none", reset=i == 0) for i, p in enumerate(parts)]
        chunks.append(KVChunk(seq=own, payload=payload, num_tokens=n, mask=self._full, expert=GEN))
        self._built.add(request_id)
        return KVForward(chunks)

    def _part_chunk(self, seq: str, part: Part, **extra: Any) -> KVChunk:
        if isinstance(part, TextInput):
            return KVChunk(seq=seq, payload=part, num_tokens=part.num_tokens, **extra)
        expert = GEN if part.kind != "vit" else 0
        return KVChunk(seq=seq, payload=part, num_tokens=part.num_tokens, mask=self._full, expert=expert, **extra)

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

    def _outputs(self, inputs: Mapping[str, Any], velocity: torch.Tensor | None) -> Mapping[str, Any]:
        state = ContextState.of(inputs["context"])
        if "segments" in inputs:
            if state.think_ids is not None:
                ids = torch.tensor([self.config.tokens.bos, *state.think_ids, self.config.tokens.eos], dtype=torch.long)
                return {"context": state.after_think(TextInput(ids, state.cond.rope))}
            item = Segments.of(inputs["segments"]).items[state.cursor]
            assert isinstance(item, TextItem)
            return {"context": state.after_text(TextInput(item.token_ids, state.cond.rope))}
        if "vit_embeds" in inputs:
            return {"context": state.after_image(ImageInput("vit", inputs["vit_embeds"], state.cond.rope), is_last_part=True)}
        if "vae_latents" in inputs:
            latents = VaeLatents.of(inputs["vae_latents"])
            positions = latent_grid(self.weights, latents.height, latents.width)
            payload = ImageInput("vae", latents.tokens, state.cond.rope, positions, 0.0)
            return {"context": state.after_image(payload, is_last_part=not latents.then_vit)}
        branch = next(b for b in BRANCHES if query_input(b) in inputs)
        return {velocity_output(branch): velocity}

    def release(self, request_id: str) -> None:
        """Forget what is noted for a request: its sequences' RoPE offsets, its rebuilt context."""
        self.model.forget(request_id)
        self._built.discard(request_id)
        self._decoding.pop(request_id, None)

    # -- token walks (understanding text, planning text) ---------------------------------

    def turn(self, request_id: str, inputs: Mapping[str, Any], *, is_first: bool) -> KVTurn:
        """Decode greedily from ``<|im_start|>`` after the request's context, until ``<|im_end|>``."""
        if is_first:
            raise ValueError("decode needs the request's context in this engine: prefill it first, on this rank")
        segments = Segments.of(inputs["segments"])
        state = ContextState.of(inputs["context"])
        if state.cursor >= len(segments.items) and segments.is_think:
            self._decoding[request_id] = state
        tokens = self.config.tokens
        params = SamplingParams(temperature=0.0, max_tokens=max(1, segments.max_tokens), stop_token_ids=(tokens.eos,))
        return KVTurn([tokens.bos], params, is_done=segments.max_tokens < 1)

    def outputs(self, request_id: str, token_id: int, history: list[int] | None) -> Mapping[str, Any]:
        """Emit each token but ``<|im_end|>``; the walk's last token stops the loop.

        After a planning text the context state takes its tokens (they are prefilled next).
        """
        out: dict[str, Any] = {"stop": history is not None}
        eos = self.config.tokens.eos
        if token_id != eos:
            out["token"] = token_id
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
    """

    supports_step_chunks: ClassVar[Literal[True]] = True

    def __init__(self, weights: BagelWeights) -> None:
        self.weights = weights
        self.rope_offsets: dict[str, int] = {}

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

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: PagedKVContext) -> torch.Tensor:
        """Run a step over the paged cache."""
        return self.weights.step(input_ids, positions, ctx, self.rope_offsets)

    def forget(self, request_id: str) -> None:
        """Drop the offsets noted for a request's sequences."""
        for key in [k for k in self.rope_offsets if k == request_id or k.startswith(f"{request_id}/")]:
            self.rope_offsets.pop(key, None)


class CombineNode:
    """``cfg_combine``: guide and take one Euler step; say which branches the next step needs."""

    def __call__(self, batch: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
        """Integrate every request's step."""
        return [self.step(inputs) for inputs in batch]

    @torch.inference_mode()
    def step(self, inputs: Mapping[str, Any]) -> Mapping[str, Any]:
        """Return the next flow and its queries, or, after the last step, the latents."""
        flow = FlowState.of(inputs["flow"])
        assert flow is not None
        spec = flow.spec
        needed = spec.branches(flow.step)
        v_text, v_img = (inputs[velocity_output(b)] if b in needed else None for b in (CFG_TEXT, CFG_IMG))
        v = guidance(spec, inputs[velocity_output("cond")], v_text, v_img)
        _, dt = spec.step(flow.step)
        nxt = FlowState(flow.x - v * dt, flow.step + 1, spec)
        # ``done`` every step: ranks hosting a branch but not this node wait for it to go on.
        out: dict[str, Any] = {"flow": nxt, **queries(nxt), "done": nxt.step == spec.num_steps}
        if out["done"]:
            out["latents"] = nxt.x
        return out


def queries(flow: FlowState) -> dict[str, FlowState | None]:
    """Return each branch's query for the flow's step: the flow itself, or None where it is not needed."""
    if flow.step >= flow.spec.num_steps:
        return dict.fromkeys(map(query_input, BRANCHES))
    run = flow.spec.branches_run(flow.step)
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
        flow = FlowState.of(inputs["flow"])
        assert flow is not None
        return decode_image(self.weights, self.vae, inputs["latents"], flow.spec.height, flow.spec.width)


def png_bytes(pixels: np.ndarray) -> bytes:
    """Encode ``[H, W, 3]`` uint8 pixels as PNG."""
    buffer = BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def initial_flow(spec: FlowSpec, noise: torch.Tensor) -> FlowState:
    """Return a flow's state before its first step."""
    return FlowState(noise.float(), 0, spec)


