"""BAGEL's values between nodes, and its nodes off the LLM: the image encoders, the CFG combine, the
VAE decoder.

The LLM nodes (one paged cache for all of them) are in `mstar.zoo.bagel.llm_node`.
`CombineNode` decides, per request, which CFG branches the next step needs (the step's time
against ``cfg_interval``, the scales) and hands the others a query of None, so the skipping
is data in the walk.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from io import BytesIO
from typing import Any, ClassVar, Literal

import numpy as np
import torch
from PIL import Image

from mstar.zoo.bagel.context import (
    ContextState,
    ImageItem,
    Item,
    Part,
    Parts,
    branch_parts,
    item_form,
    item_of,
)
from mstar.zoo.bagel.flow import BRANCHES, CFG_IMG, CFG_TEXT, COND, FlowSpec, guidance
from mstar.zoo.bagel.latents import decode_image, vae_tokens
from mstar.zoo.bagel.vae import FluxVAE
from mstar.zoo.bagel.weights import BagelWeights

__all__ = [
    "CombineNode",
    "FlowState",
    "Segments",
    "VaeDecoderNode",
    "VaeEncoderNode",
    "VaeLatents",
    "VitNode",
    "parts_input",
    "prefilled",
    "query_input",
    "velocity_output",
]


def query_input(branch: str) -> str:
    """Return the input name of a branch's flow query."""
    return f"{branch}_query"


def velocity_output(branch: str) -> str:
    """Return the output name of a branch's velocity."""
    return f"v_{branch}"


def parts_input(branch: str) -> str:
    """Return the input name of a branch's context inputs (the full context's: ``parts``, the
    prefills' too)."""
    return "parts" if branch == COND else f"{branch}_parts"


def prefilled(inputs: Mapping[str, Any], state: ContextState, part: Part) -> dict[str, Any]:
    """Return a prefill's outputs: the new state, and each branch's context inputs with ``part``
    taken in."""
    parts = Parts.of(inputs["parts"]).then(part)
    return {"context": state, **{parts_input(b): branch_parts(state, parts, b) for b in BRANCHES}}


@dataclass(frozen=True, slots=True)
class Segments:
    """A request's items and how many text tokens it may decode (the answer, or the planning
    text)."""

    has_wire_form: ClassVar[Literal[True]] = True

    items: tuple[Item, ...]
    max_tokens: int = 0
    is_think: bool = False  # the decode after the items is a planning text, then an image
    # The answer's sampling (`SamplingParams` fields: temperature, top_p, seed...); none: greedy.
    sampling: tuple[tuple[str, float | int], ...] = ()

    def wire_form(self) -> dict[str, Any]:
        """Return the segments as plain data."""
        return {
            "items": [item_form(i) for i in self.items],
            "max_tokens": self.max_tokens,
            "is_think": self.is_think,
            "sampling": [list(kv) for kv in self.sampling],
        }

    @classmethod
    def of(cls, value: Segments | Mapping[str, Any]) -> Segments:
        """Read segments back (or pass them through)."""
        if isinstance(value, Segments):
            return value
        sampling = tuple((str(k), v) for k, v in value.get("sampling", ()))
        return cls(
            tuple(item_of(i) for i in value["items"]),
            int(value["max_tokens"]),
            bool(value["is_think"]),
            sampling,
        )


@dataclass(frozen=True, slots=True)
class VaeLatents:
    """An input image's latent tokens ``[h*w, p*p*z]`` on an ``h x w`` grid; ``then_vit``: its ViT
    path follows."""

    has_wire_form: ClassVar[Literal[True]] = True

    tokens: torch.Tensor
    height: int
    width: int
    then_vit: bool

    def wire_form(self) -> dict[str, Any]:
        """Return the latents as plain data."""
        return {
            "tokens": self.tokens,
            "height": self.height,
            "width": self.width,
            "then_vit": self.then_vit,
        }

    @classmethod
    def of(cls, value: VaeLatents | Mapping[str, Any]) -> VaeLatents:
        """Read latents back (or pass them through)."""
        if isinstance(value, VaeLatents):
            return value
        return cls(
            value["tokens"], int(value["height"]), int(value["width"]), bool(value["then_vit"])
        )


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
            tokens = vae_tokens(self.vae, item.vae, cfg.latent_patch_size, item.vae_noise)
            height, width = item.vae.shape[1] // down, item.vae.shape[2] // down
            out.append({"vae_latents": VaeLatents(tokens, height, width, item.vit is not None)})
        return out


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
        v_text, v_img = (
            inputs[velocity_output(b)] if b in needed else None for b in (CFG_TEXT, CFG_IMG)
        )
        v = guidance(spec, inputs[velocity_output("cond")], v_text, v_img)
        _, dt = spec.step(flow.step)
        nxt = FlowState(flow.x - v * dt, flow.step + 1, spec)
        # ``done`` every step: ranks hosting a branch but not this node wait for it to go on.
        out: dict[str, Any] = {"flow": nxt, **queries(nxt), "done": nxt.step == spec.num_steps}
        if out["done"]:
            out["latents"] = nxt.x
        return out


def queries(flow: FlowState) -> dict[str, FlowState | None]:
    """Return each branch's query for the flow's step: the flow itself, or None where it is not
    needed."""
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
        return decode_image(
            self.weights, self.vae, inputs["latents"], flow.spec.height, flow.spec.width
        )


def png_bytes(pixels: np.ndarray) -> bytes:
    """Encode ``[H, W, 3]`` uint8 pixels as PNG."""
    buffer = BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def initial_flow(spec: FlowSpec, noise: torch.Tensor) -> FlowState:
    """Return a flow's state before its first step."""
    return FlowState(noise.float(), 0, spec)
