"""BAGEL's image inputs: the resize transform, patchify, and the SigLIP NaViT with its connector.

The ViT is transformers' `SiglipVisionModel` (its encoder layers and post-layernorm run as they
are). BAGEL runs it NaViT-style: an image of any size (a multiple of the patch) is cut into
``h x w`` patches, flattened ``(patch row, patch col, channel)`` per patch, embedded by the patch
weights as one linear map, and each patch takes the learned position ``row * side + col`` of the
``side x side`` table (``side = image_size / patch_size``), so no interpolation is needed::

    image 3 x (h*p) x (w*p) -> h*w patches of p*p*3 -> + pos[r*side + c] -> encoder -> connector
                                                                                      + vit_pos_embed

A full-size square image (``h = w = side``) takes positions ``0 .. side^2 - 1`` in order, exactly
transformers' own forward: that is the parity check against the library.
"""  # noqa: E501 (a table or diagram)

from __future__ import annotations

from typing import cast

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image
from torch import nn
from transformers import SiglipVisionConfig, SiglipVisionModel

from mstar.zoo.bagel.config import ImageSizing, ViTConfig
from mstar.zoo.bagel.llm import PositionEmbedding

__all__ = [
    "MLPConnector",
    "NaViT",
    "flattened_positions",
    "image_tensor",
    "patchify",
    "resize_for",
    "unpatchify",
]


def resize_for(image: Image.Image, sizing: ImageSizing) -> Image.Image:
    """Resize as upstream's ``MaxLongEdgeMinShortEdgeResize``: sides in range, multiples of the
    stride (bicubic)."""
    width, height = image.size
    stride = sizing.stride

    def scaled(w: float, h: float, scale: float) -> tuple[int, int]:
        return (
            max(stride, int(round(round(w * scale) / stride) * stride)),
            max(stride, int(round(round(h * scale) / stride) * stride)),
        )

    scale = min(sizing.max_size / max(width, height), 1.0)
    scale = max(scale, sizing.min_size / min(width, height))
    new_w, new_h = scaled(width, height, scale)
    if new_w * new_h > sizing.max_pixels:
        new_w, new_h = scaled(new_w, new_h, sizing.max_pixels / (new_w * new_h))
    if max(new_w, new_h) > sizing.max_size:
        new_w, new_h = scaled(new_w, new_h, sizing.max_size / max(new_w, new_h))
    if (new_w, new_h) == image.size:
        return image
    return image.resize((new_w, new_h), Image.Resampling.BICUBIC)


def image_tensor(image: Image.Image) -> torch.Tensor:
    """Return an RGB image as ``[3, H, W]`` float32 in [-1, 1] (``ToTensor`` then mean/std 0.5)."""
    array = np.asarray(image.convert("RGB"), dtype=np.float32) / 255.0
    return (torch.from_numpy(array).permute(2, 0, 1) - 0.5) / 0.5


def patchify(image: torch.Tensor, p: int) -> torch.Tensor:
    """Cut ``[c, h*p, w*p]`` into ``[h*w, p*p*c]`` patches, each flattened (row, col, channel)."""
    c, height, width = image.shape
    x = image.reshape(c, height // p, p, width // p, p)
    return torch.einsum("chpwq->hwpqc", x).reshape(-1, p * p * c)


def unpatchify(tokens: torch.Tensor, h: int, w: int, p: int, c: int) -> torch.Tensor:
    """Invert `patchify`: ``[h*w, p*p*c]`` to ``[c, h*p, w*p]``."""
    x = tokens.reshape(h, w, p, p, c)
    return torch.einsum("hwpqc->chpwq", x).reshape(c, h * p, w * p)


def flattened_positions(h: int, w: int, side: int) -> torch.Tensor:
    """Return the table positions ``row * side + col`` of an ``h x w`` grid (upstream's
    "extrapolate")."""
    return (torch.arange(h)[:, None] * side + torch.arange(w)[None, :]).flatten()


class MLPConnector(nn.Module):
    """ViT width -> LLM width: ``fc2(gelu_tanh(fc1(x)))``."""

    def __init__(self, in_dim: int, out_dim: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(in_dim, out_dim)
        self.fc2 = nn.Linear(out_dim, out_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Project ViT tokens to the LLM's width."""
        return cast(torch.Tensor, self.fc2(F.gelu(self.fc1(x), approximate="tanh")))


class NaViT(SiglipVisionModel):
    """transformers' `SiglipVisionModel` (no pooling head) run on images of any patch grid."""

    def __init__(self, cfg: ViTConfig) -> None:
        super().__init__(
            SiglipVisionConfig(
                hidden_size=cfg.hidden_size,
                intermediate_size=cfg.intermediate_size,
                num_hidden_layers=cfg.num_layers,
                num_attention_heads=cfg.num_heads,
                image_size=cfg.image_size,
                patch_size=cfg.patch_size,
                layer_norm_eps=cfg.layer_norm_eps,
                hidden_act="gelu_pytorch_tanh",
                vision_use_head=False,
            )
        )
        self.vit = cfg

    def patch_weight(self) -> torch.Tensor:
        """Return the patch embedding as a linear map ``[hidden, p*p*3]`` over (row, col,
        channel)."""
        conv = self.embeddings.patch_embedding
        return conv.weight.permute(0, 2, 3, 1).reshape(conv.weight.shape[0], -1)

    def encode(self, patches: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Encode one image's patches ``[n, p*p*3]`` at table ``positions`` ``[n]``; return ``[n,
        hidden]``."""
        conv = self.embeddings.patch_embedding
        weight = self.patch_weight()
        x = F.linear(patches.to(weight.dtype), weight, conv.bias)
        x = x + self.embeddings.position_embedding(positions)
        out = self.encoder(inputs_embeds=x[None]).last_hidden_state
        return cast(torch.Tensor, self.post_layernorm(out))[0]


def connector_output(
    connector: MLPConnector,
    pos_embed: PositionEmbedding,
    states: torch.Tensor,
    positions: torch.Tensor,
) -> torch.Tensor:
    """Return the LLM-width ViT tokens: the connector's projection plus the 2D sin-cos position."""
    return cast(torch.Tensor, connector(states)) + pos_embed(positions).to(states.dtype)
