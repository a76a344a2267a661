"""BAGEL's graph nodes on dense caches, for the reference interpreter (`mstar.graph.run_reference`).

The same walks, node for node, but every LLM node works on plain per-context caches kept the
way upstream's inferencer keeps them: the text-free context is a copy of the full one taken
before each text item and after each image, and the image-free context is computed on its own
from the text items. Nothing is paged or forked; the runtime's walks must emit the same.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from mstar.baselines.bagel import DenseContext
from mstar.graph import NodeFn
from mstar.zoo.bagel.context import ContextState, TextItem
from mstar.zoo.bagel.flow import BRANCHES, CFG_IMG, CFG_TEXT, COND
from mstar.zoo.bagel.latents import latent_grid
from mstar.zoo.bagel.model import BagelModel, denoise_node
from mstar.zoo.bagel.nodes import (
    CombineNode,
    FlowState,
    Segments,
    VaeDecoderNode,
    VaeEncoderNode,
    VaeLatents,
    VitNode,
    prefilled,
    query_input,
    velocity_output,
)
from mstar.zoo.bagel.weights import ImageInput, TextInput

__all__ = ["dense_nodes"]


def _copy(ctx: DenseContext) -> DenseContext:
    return DenseContext(ctx.weights, list(ctx.keys), list(ctx.values), ctx.rope)


def dense_nodes(
    model: BagelModel, device: torch.device | None = None
) -> tuple[dict[str, NodeFn], Callable[[], int]]:
    """Return a callable per node of ``model``'s graph for one request (they keep its caches), and a
    count of the LLM passes its flow ran."""
    weights, vae = model.load(device or torch.device("cpu"))
    contexts = {
        COND: DenseContext(weights),
        CFG_TEXT: DenseContext(weights),
        CFG_IMG: DenseContext(weights),
    }
    decoded: list[int] = []
    thinking: list[DenseContext] = []  # the full context before a planning text was decoded
    tokens = model.config.tokens

    def one(node: Callable[[list[Mapping[str, Any]]], list[Mapping[str, Any]]]) -> NodeFn:
        return lambda inputs: node([inputs])[0]

    @torch.inference_mode()
    def llm(inputs: Mapping[str, Any]) -> Mapping[str, Any]:
        state: ContextState = inputs["context"]
        segments: Segments = inputs["segments"]
        if state.cursor < len(segments.items):  # prefill_text
            item = segments.items[state.cursor]
            assert isinstance(item, TextItem)
            contexts[CFG_TEXT] = _copy(contexts[COND])
            for branch in (COND, CFG_IMG):
                contexts[branch].add(TextInput(item.token_ids, contexts[branch].rope))
            text = TextInput(item.token_ids, state.cond.rope)
            return prefilled(inputs, state.after_text(text), text)
        if state.think_ids is not None:  # prefill_text of the planning text: the full context alone
            ids = torch.tensor([tokens.bos, *state.think_ids, tokens.eos], dtype=torch.long)
            contexts[COND] = thinking.pop()
            contexts[COND].add(TextInput(ids, contexts[COND].rope))
            think = TextInput(ids, state.cond.rope)
            return prefilled(inputs, state.after_think(think), think)
        if not decoded:  # decode on a copy: a planning text is prefilled again afterwards
            thinking.append(_copy(contexts[COND]))
        ctx = contexts[COND]  # decode: one greedy token per firing
        token = decoded[-1] if decoded else tokens.bos
        hidden = ctx._run(TextInput(torch.tensor([token]), ctx.rope), causal=True, write=True)
        nxt = int(weights.compute_logits(hidden[-1:]).argmax(-1))
        decoded.append(nxt)
        out: dict[str, Any] = {"stop": nxt == tokens.eos or len(decoded) >= segments.max_tokens}
        if nxt != tokens.eos:
            out["token"] = nxt
        if out["stop"] and segments.is_think:
            out["context"] = state.with_think([t for t in decoded if t != tokens.eos])
        return out

    @torch.inference_mode()
    def llm_vit(inputs: Mapping[str, Any]) -> Mapping[str, Any]:
        state: ContextState = inputs["context"]
        embeds = inputs["vit_embeds"]
        contexts[COND].add(ImageInput("vit", embeds, contexts[COND].rope))
        contexts[CFG_TEXT] = _copy(contexts[COND])
        vit = ImageInput("vit", embeds, state.cond.rope)
        return prefilled(inputs, state.after_image(vit, is_last_part=True), vit)

    @torch.inference_mode()
    def llm_vae(inputs: Mapping[str, Any]) -> Mapping[str, Any]:
        state: ContextState = inputs["context"]
        latents: VaeLatents = inputs["vae_latents"]
        positions = latent_grid(weights, latents.height, latents.width)
        contexts[COND].add(ImageInput("vae", latents.tokens, contexts[COND].rope, positions, 0.0))
        contexts[CFG_TEXT] = _copy(contexts[COND])
        payload = ImageInput("vae", latents.tokens, state.cond.rope, positions, 0.0)
        return prefilled(
            inputs, state.after_image(payload, is_last_part=not latents.then_vit), payload
        )

    def denoise(branch: str) -> NodeFn:
        @torch.inference_mode()
        def run(inputs: Mapping[str, Any]) -> Mapping[str, Any]:
            flow: FlowState | None = inputs[query_input(branch)]
            if flow is None:
                return {velocity_output(branch): None}
            t, _ = flow.spec.step(flow.step)
            positions = latent_grid(weights, flow.spec.height, flow.spec.width)
            return {velocity_output(branch): contexts[branch].velocity(flow.x, positions, t)}

        return run

    nodes: dict[str, NodeFn] = {
        "llm": llm,
        "llm_vit": llm_vit,
        "llm_vae": llm_vae,
        "vit": one(VitNode(weights)),
        "vae_encoder": one(VaeEncoderNode(weights, vae)),
        "cfg_combine": CombineNode().step,
        "vae_decoder": one(VaeDecoderNode(weights, vae)),
    }
    nodes.update({denoise_node(b): denoise(b) for b in BRANCHES})
    return nodes, lambda: sum(c.num_passes for c in contexts.values())
