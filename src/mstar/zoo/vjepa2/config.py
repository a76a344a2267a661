"""V-JEPA 2-AC configs: the ViT encoder, the action-conditioned predictor, planning defaults.

A frame is one tubelet of ``tubelet_size`` video frames (a single image is repeated to fill
it) cut into ``grid x grid`` patches. The predictor sees each frame as one block of
``cond_tokens + grid**2`` tokens::

    frame t block:  [ action_t | state_t | patch (0,0) ... patch (grid-1, grid-1) ]

attending to every token of blocks ``0..t`` (block-causal across frames, full within one).
The predictor's mask covers ``num_frames // tubelet_size`` frames, so a rollout from one
context frame predicts at most ``max_frames - 1`` frames.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mstar.errors import UnsupportedModelError

__all__ = [
    "VJEPA2_CONFIGS",
    "CEMConfig",
    "EncoderConfig",
    "PredictorConfig",
    "VJepa2Config",
    "get_vjepa2_config",
]

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


def _rope_dim(head_dim: int) -> int:
    """Return the per-axis RoPE width (depth, height and width each get this many channels)."""
    return 2 * ((head_dim // 3) // 2)


@dataclass(frozen=True, slots=True)
class EncoderConfig:
    """The ViT encoder (``vit_giant_xformers`` for the real model) with 3D RoPE."""

    img_size: int = 256
    patch_size: int = 16
    tubelet_size: int = 2
    in_chans: int = 3
    embed_dim: int = 1408
    depth: int = 40
    num_heads: int = 22
    mlp_ratio: float = 48 / 11
    norm_eps: float = 1e-6

    def __post_init__(self) -> None:
        if self.img_size % self.patch_size:
            raise UnsupportedModelError(
                f"img_size {self.img_size} is not a multiple of patch_size {self.patch_size}"
            )
        if self.embed_dim % self.num_heads:
            raise UnsupportedModelError(
                f"embed_dim {self.embed_dim} is not a multiple of num_heads {self.num_heads}"
            )
        if _rope_dim(self.head_dim) < 2:
            raise UnsupportedModelError(
                f"head_dim {self.head_dim} is too small for 3D RoPE (need >= 6)"
            )

    @property
    def grid_size(self) -> int:
        """Patches per side."""
        return self.img_size // self.patch_size

    @property
    def num_patches(self) -> int:
        """Tokens per frame (one tubelet)."""
        return self.grid_size**2

    @property
    def head_dim(self) -> int:
        """Channels per attention head."""
        return self.embed_dim // self.num_heads

    @property
    def mlp_hidden(self) -> int:
        """Hidden width of each block's MLP (upstream: ``int(embed_dim * mlp_ratio)``)."""
        return int(self.embed_dim * self.mlp_ratio)


@dataclass(frozen=True, slots=True)
class PredictorConfig:
    """The action-conditioned predictor (``VisionTransformerPredictorAC``)."""

    embed_dim: int = 1408  # the encoder's width (input and output of the predictor)
    pred_dim: int = 1024
    depth: int = 24
    num_heads: int = 16
    mlp_ratio: float = 4.0
    action_dim: int = 7
    grid_size: int = 16
    num_frames: int = 64
    tubelet_size: int = 2
    norm_eps: float = 1e-6

    def __post_init__(self) -> None:
        if self.pred_dim % self.num_heads:
            raise UnsupportedModelError(
                f"pred_dim {self.pred_dim} is not a multiple of num_heads {self.num_heads}"
            )
        if _rope_dim(self.head_dim) < 2:
            raise UnsupportedModelError(
                f"head_dim {self.head_dim} is too small for 3D RoPE (need >= 6)"
            )
        if self.max_frames < 2:
            raise UnsupportedModelError(
                f"num_frames {self.num_frames} leaves no room for a predicted frame"
            )

    @property
    def cond_tokens(self) -> int:
        """Conditioning tokens per frame block: the action and the state."""
        return 2

    @property
    def num_patches(self) -> int:
        """Patch tokens per frame."""
        return self.grid_size**2

    @property
    def frame_tokens(self) -> int:
        """Tokens per frame block: ``cond_tokens + num_patches`` (258 for the real model)."""
        return self.cond_tokens + self.num_patches

    @property
    def max_frames(self) -> int:
        """Frames the block-causal mask covers (32 for the real model)."""
        return self.num_frames // self.tubelet_size

    @property
    def max_horizon(self) -> int:
        """Longest rollout from one context frame (31 for the real model)."""
        return self.max_frames - 1

    @property
    def head_dim(self) -> int:
        """Channels per attention head."""
        return self.pred_dim // self.num_heads

    @property
    def mlp_hidden(self) -> int:
        """Hidden width of each block's MLP."""
        return int(self.pred_dim * self.mlp_ratio)


@dataclass(frozen=True, slots=True)
class CEMConfig:
    """Cross-entropy-method planning defaults (upstream ``WorldModel`` MPC arguments)."""

    rollout: int = 2
    samples: int = 400
    topk: int = 10
    cem_steps: int = 10
    momentum_mean: float = 0.15
    momentum_std: float = 0.15
    momentum_mean_gripper: float = 0.15
    momentum_std_gripper: float = 0.15
    maxnorm: float = 0.05
    gripper_clip: float = 0.75


@dataclass(frozen=True, slots=True)
class VJepa2Config:
    """One V-JEPA 2-AC model: encoder, predictor and planning defaults."""

    name: str
    encoder: EncoderConfig
    predictor: PredictorConfig
    cem: CEMConfig = field(default_factory=CEMConfig)
    normalize_reps: bool = True
    image_mean: tuple[float, float, float] = IMAGENET_MEAN
    image_std: tuple[float, float, float] = IMAGENET_STD

    def __post_init__(self) -> None:
        enc, pred = self.encoder, self.predictor
        if pred.embed_dim != enc.embed_dim:
            raise UnsupportedModelError(
                f"predictor embed_dim {pred.embed_dim} != encoder embed_dim {enc.embed_dim}"
            )
        if pred.grid_size != enc.grid_size:
            raise UnsupportedModelError(
                f"predictor grid {pred.grid_size} != encoder grid {enc.grid_size}"
            )
        if pred.tubelet_size != enc.tubelet_size:
            raise UnsupportedModelError("encoder and predictor must use the same tubelet size")


def _vitg() -> VJepa2Config:
    return VJepa2Config("vjepa2-ac-vitg", EncoderConfig(), PredictorConfig())


def _small() -> VJepa2Config:
    # Meaningful on a CPU: a 6-layer, 256-wide predictor over 64 patches (66 tokens) per frame.
    encoder = EncoderConfig(
        img_size=128, patch_size=16, embed_dim=384, depth=6, num_heads=6, mlp_ratio=4.0
    )
    predictor = PredictorConfig(embed_dim=384, pred_dim=256, depth=6, num_heads=4, grid_size=8)
    return VJepa2Config(
        "vjepa2-small", encoder, predictor, CEMConfig(samples=64, topk=8, cem_steps=3)
    )


def _tiny() -> VJepa2Config:
    encoder = EncoderConfig(
        img_size=32, patch_size=8, embed_dim=64, depth=2, num_heads=4, mlp_ratio=4.0
    )
    predictor = PredictorConfig(embed_dim=64, pred_dim=64, depth=2, num_heads=4, grid_size=4)
    return VJepa2Config(
        "vjepa2-tiny", encoder, predictor, CEMConfig(samples=16, topk=4, cem_steps=3)
    )


VJEPA2_CONFIGS = {"vjepa2-ac-vitg": _vitg, "vjepa2-small": _small, "vjepa2-tiny": _tiny}
"""Config name to a function building it."""


def get_vjepa2_config(name: str) -> VJepa2Config:
    """Return a named config.

    Raises:
        UnsupportedModelError: Unknown name (the message lists the known ones).
    """
    make = VJEPA2_CONFIGS.get(name)
    if make is None:
        raise UnsupportedModelError(
            f"unknown V-JEPA 2 config {name!r}: use one of {', '.join(VJEPA2_CONFIGS)}"
        )
    return make()
