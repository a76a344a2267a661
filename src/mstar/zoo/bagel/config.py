"""BAGEL configs: the MoT language model, the SigLIP NaViT, the FLUX VAE, and the sampling defaults.

One paged cache holds a request's contexts. Text runs through the understanding weights
(causal); an image enters as ``[<|vision_start|>, tokens..., <|vision_end|>]`` at one shared
RoPE position with a full mask, its ViT tokens through the understanding weights and its VAE
latent tokens through the generation weights. A latent token is a ``p x p`` patch of the VAE
latent (``p = latent_patch_size``), so an image of ``H x W`` pixels has
``(H / latent_downsample) * (W / latent_downsample)`` of them::

    pixels  H x W x 3  --VAE /8-->  H/8 x W/8 x z  --patch 2-->  (H/16 * W/16) tokens of 4z
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from mstar.errors import UnsupportedModelError

__all__ = [
    "BAGEL_CONFIGS",
    "BagelConfig",
    "GenDefaults",
    "ImageSizing",
    "LLMConfig",
    "SpecialTokens",
    "VAEConfig",
    "ViTConfig",
    "get_bagel_config",
    "toy_tokens",
]

RenormType = Literal["global", "channel", "text_channel"]


@dataclass(frozen=True, slots=True)
class LLMConfig:
    """The Qwen2.5 decoder with two weight sets per layer (``llm_config.json``)."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6
    max_position: int = 32_768
    # the checkpoint's own dtype (``llm_config.json``), for dtype "auto"
    torch_dtype: str | None = None

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads or self.num_heads % self.num_kv_heads:
            raise UnsupportedModelError(
                f"hidden_size {self.hidden_size}, num_heads {self.num_heads} and "
                f"num_kv_heads {self.num_kv_heads} "
                "must divide evenly"
            )

    @property
    def head_dim(self) -> int:
        """Width of one attention head."""
        return self.hidden_size // self.num_heads


@dataclass(frozen=True, slots=True)
class ViTConfig:
    """The SigLIP NaViT (``vit_config.json`` with its last layer dropped, as upstream runs it).

    Attributes:
        num_layers: Layers that run (the checkpoint's ``num_hidden_layers`` minus one).
        max_patches_per_side: Side of the learned position table (``image_size / patch_size``);
            a patch at row ``r``, column ``c`` takes position ``r * max_patches_per_side + c``.
    """

    hidden_size: int = 1152
    intermediate_size: int = 4304
    num_layers: int = 26
    num_heads: int = 16
    patch_size: int = 14
    max_patches_per_side: int = 70
    layer_norm_eps: float = 1e-6

    @property
    def image_size(self) -> int:
        """The largest side the position table covers (``vit_config.json``'s ``image_size``)."""
        return self.patch_size * self.max_patches_per_side


@dataclass(frozen=True, slots=True)
class VAEConfig:
    """The FLUX autoencoder (``ae.safetensors``)."""

    ch: int = 128
    ch_mult: tuple[int, ...] = (1, 2, 4, 4)
    num_res_blocks: int = 2
    z_channels: int = 16
    scale_factor: float = 0.3611
    shift_factor: float = 0.1159
    norm_groups: int = 32

    def __post_init__(self) -> None:
        if any((self.ch * m) % self.norm_groups for m in self.ch_mult):
            raise UnsupportedModelError(
                f"VAE widths {[self.ch * m for m in self.ch_mult]} must be multiples of "
                f"{self.norm_groups}"
            )

    @property
    def downsample(self) -> int:
        """Pixels per latent cell along a side."""
        return 2 ** (len(self.ch_mult) - 1)


@dataclass(frozen=True, slots=True)
class ImageSizing:
    """Upstream's ``ImageTransform(max_size, min_size, stride)``: how an input image is resized."""

    max_size: int
    min_size: int
    stride: int
    max_pixels: int = 14 * 14 * 9 * 1024


@dataclass(frozen=True, slots=True)
class SpecialTokens:
    """The ids BAGEL adds around text and images (``data_utils.add_special_tokens``)."""

    bos: int  # <|im_start|>
    eos: int  # <|im_end|>
    start_of_image: int  # <|vision_start|>
    end_of_image: int  # <|vision_end|>


@dataclass(frozen=True, slots=True)
class GenDefaults:
    """Sampling defaults of a task (the official inference notebook's values)."""

    num_timesteps: int = 50
    timestep_shift: float = 3.0
    cfg_text_scale: float = 4.0
    cfg_img_scale: float = 1.0
    cfg_interval: tuple[float, float] = (0.4, 1.0)
    cfg_renorm_type: RenormType = "global"
    cfg_renorm_min: float = 0.0


T2I_DEFAULTS = GenDefaults()
EDIT_DEFAULTS = GenDefaults(
    cfg_img_scale=2.0, cfg_interval=(0.0, 1.0), cfg_renorm_type="text_channel"
)


@dataclass(frozen=True, slots=True)
class BagelConfig:
    """A BAGEL model and its serving defaults.

    Attributes:
        latent_patch_size: Latent cells per token along a side.
        max_latent_size: Side of the latent position table (tokens), so the largest
            generated image is ``max_latent_size * latent_downsample`` pixels a side.
        image_size: Default output ``(height, width)`` of text-to-image.
        vae_image / vit_image: How an input image is resized for each path.
        timestep_frequencies: Width of the timestep embedder's sinusoid.
    """

    name: str
    llm: LLMConfig
    vit: ViTConfig
    vae: VAEConfig
    tokens: SpecialTokens
    latent_patch_size: int = 2
    max_latent_size: int = 64
    image_size: tuple[int, int] = (1024, 1024)
    vae_image: ImageSizing = ImageSizing(1024, 512, 16)
    vit_image: ImageSizing = ImageSizing(980, 224, 14)
    timestep_frequencies: int = 256
    t2i: GenDefaults = T2I_DEFAULTS
    edit: GenDefaults = EDIT_DEFAULTS
    max_text_tokens: int = 1024
    extra: dict[str, str] = field(default_factory=dict, hash=False, compare=False)

    def __post_init__(self) -> None:
        if self.vit_image.stride != self.vit.patch_size:
            raise UnsupportedModelError(
                "the ViT's images must be resized to multiples of its patch size"
            )
        if self.vae_image.stride % self.latent_downsample:
            raise UnsupportedModelError(
                f"VAE images must be resized to multiples of {self.latent_downsample}"
            )
        for side in self.image_size:
            if (
                side % self.latent_downsample
                or side // self.latent_downsample > self.max_latent_size
            ):
                raise UnsupportedModelError(
                    f"default image side {side} does not fit the latent grid"
                )

    @property
    def latent_downsample(self) -> int:
        """Pixels per latent token along a side."""
        return self.vae.downsample * self.latent_patch_size

    @property
    def patch_latent_dim(self) -> int:
        """Width of a latent token (``p * p * z``)."""
        return self.latent_patch_size**2 * self.vae.z_channels

    @property
    def max_image_side(self) -> int:
        """The largest generated side, in pixels."""
        return self.max_latent_size * self.latent_downsample


# Qwen2.5's ids of the four tokens (all already in its vocabulary).
_QWEN_TOKENS = SpecialTokens(bos=151_644, eos=151_645, start_of_image=151_652, end_of_image=151_653)


def toy_tokens(vocab: int) -> SpecialTokens:
    """The four specials at the top of a toy vocabulary (its first ``vocab - 4`` ids are bytes +
    text)."""
    return SpecialTokens(
        bos=vocab - 4, eos=vocab - 3, start_of_image=vocab - 2, end_of_image=vocab - 1
    )


BAGEL_CONFIGS: dict[str, BagelConfig] = {
    "bagel-7b-mot": BagelConfig(
        name="bagel-7b-mot",
        llm=LLMConfig(
            hidden_size=3584,
            num_layers=28,
            num_heads=28,
            num_kv_heads=4,
            intermediate_size=18_944,
            vocab_size=152_064,
        ),
        vit=ViTConfig(),
        vae=VAEConfig(),
        tokens=_QWEN_TOKENS,
    ),
    # Meaningful on a CPU: 256 px images are 16 x 16 latent tokens; hidden 256, 4 layers.
    "bagel-small": BagelConfig(
        name="bagel-small",
        llm=LLMConfig(
            hidden_size=256,
            num_layers=4,
            num_heads=8,
            num_kv_heads=2,
            intermediate_size=1024,
            vocab_size=1024,
            max_position=4096,
        ),
        vit=ViTConfig(
            hidden_size=128,
            intermediate_size=512,
            num_layers=4,
            num_heads=4,
            patch_size=14,
            max_patches_per_side=16,
        ),
        vae=VAEConfig(ch=32, ch_mult=(1, 2, 4, 4), num_res_blocks=1, norm_groups=32),
        tokens=toy_tokens(1024),
        max_latent_size=32,
        image_size=(256, 256),
        vae_image=ImageSizing(512, 128, 16),
        vit_image=ImageSizing(224, 56, 14),
        max_text_tokens=256,
    ),
    # Tests: 64 px images are 4 x 4 latent tokens of 16 values.
    "bagel-tiny": BagelConfig(
        name="bagel-tiny",
        llm=LLMConfig(
            hidden_size=64,
            num_layers=2,
            num_heads=4,
            num_kv_heads=2,
            intermediate_size=128,
            vocab_size=520,
            max_position=1024,
        ),
        vit=ViTConfig(
            hidden_size=32,
            intermediate_size=64,
            num_layers=2,
            num_heads=4,
            patch_size=8,
            max_patches_per_side=16,
        ),
        vae=VAEConfig(ch=8, ch_mult=(1, 2, 2, 2), num_res_blocks=1, z_channels=4, norm_groups=4),
        tokens=toy_tokens(520),
        max_latent_size=8,
        image_size=(64, 64),
        vae_image=ImageSizing(128, 32, 16),
        vit_image=ImageSizing(64, 16, 8),
        max_text_tokens=64,
    ),
}


def get_bagel_config(name: str) -> BagelConfig:
    """Return a named config.

    Raises:
        UnsupportedModelError: Unknown name.
    """
    try:
        return BAGEL_CONFIGS[name]
    except KeyError:
        raise UnsupportedModelError(
            f"unknown BAGEL config {name!r} (known: {', '.join(BAGEL_CONFIGS)})"
        ) from None
