"""BAGEL's latents: an image's VAE tokens, their table positions, and decoding them to pixels."""

from __future__ import annotations

import numpy as np
import torch

from mstar.zoo.bagel.vae import FluxVAE
from mstar.zoo.bagel.vision import flattened_positions, patchify, unpatchify
from mstar.zoo.bagel.weights import BagelWeights

__all__ = ["decode_image", "latent_grid", "vae_tokens"]


def vae_tokens(
    vae: FluxVAE, image: torch.Tensor, patch: int, noise: torch.Tensor | None = None
) -> torch.Tensor:
    """Return an image's latent tokens ``[h*w, p*p*z]`` (``image`` ``[3, H, W]`` in [-1, 1]).

    ``noise`` ``[z, H/8, W/8]``: the posterior sample's noise (None: the posterior mean).
    """
    return patchify(
        vae.encode(image[None], None if noise is None else noise[None])[0].float(), patch
    )


def latent_grid(weights: BagelWeights, height: int, width: int) -> torch.Tensor:
    """Return the latent table positions of an ``height x width`` token grid."""
    return flattened_positions(height, width, weights.config.max_latent_size)


def decode_image(
    weights: BagelWeights, vae: FluxVAE, tokens: torch.Tensor, height: int, width: int
) -> np.ndarray:
    """Decode latent tokens of an ``height x width`` grid to ``[H, W, 3]`` uint8 pixels (upstream's
    rounding)."""
    cfg = weights.config
    latent = unpatchify(tokens.float(), height, width, cfg.latent_patch_size, cfg.vae.z_channels)
    image = vae.decode(latent[None])[0].float()
    pixels = ((image * 0.5 + 0.5).clamp(0, 1).permute(1, 2, 0) * 255).to(torch.uint8)
    return pixels.cpu().numpy()
