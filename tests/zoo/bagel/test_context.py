"""BAGEL's persisted values: the context state stays small, the context inputs go only where they
are read.

A prefill returns the new `ContextState` (to every node that follows the items) and each CFG
branch's own context inputs (`Parts`); the large ones (ViT embeddings, latents) must not reach
the image encoders, and the image-free branch gets text alone.
"""

from __future__ import annotations

from typing import Any

import torch

from mstar.graph import GraphEdge
from mstar.zoo.bagel.context import ContextState, Parts
from mstar.zoo.bagel.flow import BRANCHES
from mstar.zoo.bagel.model import BagelModel
from mstar.zoo.bagel.nodes import parts_input, prefilled
from mstar.zoo.bagel.weights import ImageInput, TextInput


def _has_tensor(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    if isinstance(value, dict):
        return any(_has_tensor(v) for v in value.values())
    if isinstance(value, list | tuple):
        return any(_has_tensor(v) for v in value)
    return False


def test_context_inputs_persist_only_to_the_prefills_and_each_branch() -> None:
    graph = BagelModel("bagel-tiny").graph()
    readers: dict[str, set[str]] = {}
    for node in graph.nodes.values():
        for edge in node.outputs:
            if isinstance(edge, GraphEdge) and edge.persist:
                readers.setdefault(edge.name, set()).add(edge.dst)
    assert readers["parts"] == {"llm", "llm_vit", "llm_vae", "denoise"}
    assert readers["cfg_text_parts"] == {"denoise_cfg_text"}
    assert readers["cfg_img_parts"] == {"denoise_cfg_img"}
    assert {"vit", "vae_encoder", "denoise_cfg_img"} <= readers["context"]


def _edit_prefills() -> tuple[ContextState, dict[str, Any], list[Any]]:
    """Prefill an edit's items (the image's VAE then ViT tokens, then the text) as the LLM nodes
    do."""
    state, outputs = ContextState(), {name: Parts() for name in map(parts_input, BRANCHES)}
    vae = ImageInput("vae", torch.randn(16, 16), 0, torch.arange(16), 0.0)
    vit = ImageInput("vit", torch.randn(16, 64), 0)
    text = TextInput(torch.tensor([1, 5, 6, 2]), 1)
    outputs = prefilled(outputs, state.after_image(vae, is_last_part=False), vae)
    outputs = prefilled(outputs, outputs["context"].after_image(vit, is_last_part=True), vit)
    outputs = prefilled(outputs, outputs["context"].after_text(text), text)
    return outputs["context"], outputs, [vae, vit, text]


def test_the_state_carries_no_tensor_and_each_branch_its_own_inputs() -> None:
    state, outputs, (vae, vit, text) = _edit_prefills()
    assert state.cursor == 2 and state.cond.num_tokens == 18 + 18 + 4
    assert not _has_tensor(state.wire_form())
    full, text_free, image_free = (outputs[parts_input(b)] for b in BRANCHES)
    assert full.parts == (vae, vit, text)
    assert text_free.parts == (vae, vit) and text_free.num_tokens == state.cfg_text.num_tokens
    assert len(image_free.parts) == 1 and isinstance(image_free.parts[0], TextInput)
    assert image_free.parts[0].rope == 0 and torch.equal(
        image_free.parts[0].token_ids, text.token_ids
    )
    assert image_free.num_tokens == state.cfg_img.num_tokens


def test_parts_cross_as_plain_data() -> None:
    _, outputs, _ = _edit_prefills()
    full = outputs["parts"]
    back = Parts.of(full.wire_form())
    assert [type(p) for p in back.parts] == [type(p) for p in full.parts]
    assert all(
        torch.equal(
            a.tokens if isinstance(a, ImageInput) else a.token_ids,
            b.tokens if isinstance(b, ImageInput) else b.token_ids,
        )
        for a, b in zip(back.parts, full.parts, strict=True)
    )
    assert [p.rope for p in back.parts] == [p.rope for p in full.parts]
