"""The FLUX autoencoder as diffusers' `AutoencoderKL`, fed from ``ae.safetensors`` (BFL names).

FLUX's AE is diffusers' KL autoencoder without quant convs; ``ae.safetensors`` keeps Black
Forest Labs' names (``encoder.down.0.block.0.norm1.weight``, ``decoder.up.3.upsample.conv``,
``encoder.mid.attn_1.q`` as 1x1 convs), which diffusers' single-file converter maps to its own.

Latents are scaled as FLUX does: ``z = scale * (x - shift)`` on the way in, and
``z / scale + shift`` before decoding. ``x`` is a sample of the encoder's diagonal Gaussian,
``mean + exp(logvar / 2) * noise``, as upstream's ``DiagonalGaussian(sample=True)`` draws it;
the caller hands in the noise (seeded per request), or none for the posterior's mean.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any, cast

import torch
from diffusers import AutoencoderKL
from diffusers.loaders.single_file_utils import convert_ldm_vae_checkpoint

from mstar.errors import CheckpointError
from mstar.zoo.bagel.config import VAEConfig

__all__ = ["FluxVAE", "bfl_vae_shapes", "make_vae"]


def _diffusers_config(cfg: VAEConfig) -> dict[str, Any]:
    levels = len(cfg.ch_mult)
    return {
        "in_channels": 3,
        "out_channels": 3,
        "down_block_types": ["DownEncoderBlock2D"] * levels,
        "up_block_types": ["UpDecoderBlock2D"] * levels,
        "block_out_channels": [cfg.ch * m for m in cfg.ch_mult],
        "layers_per_block": cfg.num_res_blocks,
        "latent_channels": cfg.z_channels,
        "norm_num_groups": cfg.norm_groups,
        "act_fn": "silu",
        "use_quant_conv": False,
        "use_post_quant_conv": False,
        "mid_block_add_attention": True,
        "scaling_factor": cfg.scale_factor,
        "shift_factor": cfg.shift_factor,
    }


def make_vae(cfg: VAEConfig) -> FluxVAE:
    """Return an (uninitialised) FLUX VAE of this config."""
    return FluxVAE(cfg)


class FluxVAE(torch.nn.Module):
    """Encode pixels to scaled latents and back."""

    def __init__(self, cfg: VAEConfig) -> None:
        super().__init__()
        self.config = cfg
        # Typed loosely: diffusers' lazy imports hide the class's nn.Module side from type checkers.
        self.ae: Any = AutoencoderKL(**_diffusers_config(cfg))

    def load_bfl(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Load an ``ae.safetensors`` state dict (BFL names).

        Raises:
            CheckpointError: Tensors missing, left over, or of the wrong shape.
        """
        expected = bfl_vae_shapes(self.config)
        missing = sorted(set(expected) - set(tensors))
        extra = sorted(set(tensors) - set(expected))
        if missing or extra:
            raise CheckpointError(
                "ae.safetensors does not match the FLUX VAE of this config: missing "
                f"{missing[:6]}, unexpected {extra[:6]}"
            )
        for name, shape in expected.items():
            if tuple(tensors[name].shape) != shape:
                raise CheckpointError(
                    f"ae.safetensors: {name} has shape {list(tensors[name].shape)}, expected "
                    f"{list(shape)}"
                )
        converted = convert_ldm_vae_checkpoint(dict(tensors), self.ae.config)
        result = self.ae.load_state_dict(converted, strict=False)
        if result.missing_keys or result.unexpected_keys:
            raise CheckpointError(
                f"ae.safetensors did not fill the VAE: missing {result.missing_keys[:6]}, "
                f"unexpected {result.unexpected_keys[:6]}"
            )

    @torch.inference_mode()
    def encode(self, pixels: torch.Tensor, noise: torch.Tensor | None = None) -> torch.Tensor:
        """Return scaled latents ``[B, z, H/8, W/8]`` of images ``[B, 3, H, W]`` in [-1, 1].

        Args:
            pixels: The images.
            noise: Standard normal noise of the latents' shape: the posterior's sample
                ``mean + std * noise``; None: its mean.
        """
        weight = next(self.ae.parameters())
        posterior = self.ae.encode(pixels.to(weight.device, weight.dtype)).latent_dist
        x = posterior.mean
        if noise is not None:
            if tuple(noise.shape) != tuple(x.shape):
                raise ValueError(
                    f"posterior noise has shape {list(noise.shape)}, the latents {list(x.shape)}"
                )
            x = x + posterior.std * noise.to(x.device, x.dtype)
        cfg = self.config
        return cast(torch.Tensor, (x - cfg.shift_factor) * cfg.scale_factor)

    @torch.inference_mode()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Return images ``[B, 3, H, W]`` (about [-1, 1]) of scaled latents."""
        weight = next(self.ae.parameters())
        cfg = self.config
        z = latents.to(weight.device, weight.dtype) / cfg.scale_factor + cfg.shift_factor
        return cast(torch.Tensor, self.ae.decode(z).sample)


def bfl_vae_shapes(cfg: VAEConfig) -> dict[str, tuple[int, ...]]:
    """Return every tensor of ``ae.safetensors`` for this config, by BFL name, with its shape."""
    shapes: dict[str, tuple[int, ...]] = {}

    def conv(name: str, cin: int, cout: int, k: int) -> None:
        shapes[f"{name}.weight"] = (cout, cin, k, k)
        shapes[f"{name}.bias"] = (cout,)

    def norm(name: str, c: int) -> None:
        shapes[f"{name}.weight"] = (c,)
        shapes[f"{name}.bias"] = (c,)

    def resnet(name: str, cin: int, cout: int) -> None:
        norm(f"{name}.norm1", cin)
        conv(f"{name}.conv1", cin, cout, 3)
        norm(f"{name}.norm2", cout)
        conv(f"{name}.conv2", cout, cout, 3)
        if cin != cout:
            conv(f"{name}.nin_shortcut", cin, cout, 1)

    def middle(prefix: str, c: int) -> None:
        resnet(f"{prefix}.mid.block_1", c, c)
        norm(f"{prefix}.mid.attn_1.norm", c)
        for part in ("q", "k", "v", "proj_out"):
            conv(f"{prefix}.mid.attn_1.{part}", c, c, 1)
        resnet(f"{prefix}.mid.block_2", c, c)

    widths = [cfg.ch * m for m in cfg.ch_mult]
    levels = len(widths)
    conv("encoder.conv_in", 3, cfg.ch, 3)
    block_in = cfg.ch
    for i, width in enumerate(widths):
        for j in range(cfg.num_res_blocks):
            resnet(f"encoder.down.{i}.block.{j}", block_in, width)
            block_in = width
        if i != levels - 1:
            conv(f"encoder.down.{i}.downsample.conv", block_in, block_in, 3)
    middle("encoder", block_in)
    norm("encoder.norm_out", block_in)
    conv("encoder.conv_out", block_in, 2 * cfg.z_channels, 3)
    block_in = widths[-1]
    conv("decoder.conv_in", cfg.z_channels, block_in, 3)
    middle("decoder", block_in)
    for i in reversed(range(levels)):
        for j in range(cfg.num_res_blocks + 1):
            resnet(f"decoder.up.{i}.block.{j}", block_in, widths[i])
            block_in = widths[i]
        if i != 0:
            conv(f"decoder.up.{i}.upsample.conv", block_in, block_in, 3)
    norm("decoder.norm_out", block_in)
    conv("decoder.conv_out", block_in, 3, 3)
    return shapes


def iter_bfl_names(cfg: VAEConfig) -> Iterator[str]:
    """Yield the BFL names of ``ae.safetensors`` in a stable order."""
    yield from bfl_vae_shapes(cfg)
