"""pi0.5 configs: the SigLIP vision tower, the two Gemma experts, the action head, the prompt.

The prefix (every camera's image tokens, then the prompt's tokens) runs through the VLM
expert with full bidirectional attention and stays in the paged KV cache; each of the
``num_steps`` flow-matching steps runs the ``action_horizon`` action tokens through the action
expert, attending to the cached prefix read-only and to each other::

    prefix (written once)   [ cam 0 patches | cam 1 patches | ... | BOS Task: ..., State: ...;\\nAction: ]
    step k (read-only)      [ action 0 ... action H-1 ]   sees the whole prefix and all H actions

Both experts share depth, head count, KV heads and head size (joint attention per layer);
their widths differ.
"""  # noqa: E501 (a table or diagram)

from __future__ import annotations

from dataclasses import dataclass, field

from mstar.errors import UnsupportedModelError

__all__ = [
    "GEMMA_VARIANTS",
    "PI05_CONFIGS",
    "ROBOTS",
    "GemmaConfig",
    "Pi05Config",
    "VisionConfig",
    "get_pi05_config",
    "known_vision_heads",
]

ROBOTS = ("droid", "libero", "aloha")
"""The robots whose observations pi0.5 parses (openpi's ``*_policy.py``; see
`mstar.zoo.pi05.robots`)."""


@dataclass(frozen=True, slots=True)
class GemmaConfig:
    """One Gemma expert (openpi's ``gemma.get_config`` variants)."""

    width: int
    depth: int
    mlp_dim: int
    num_heads: int
    num_kv_heads: int
    head_dim: int

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise UnsupportedModelError(
                f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}"
            )


GEMMA_VARIANTS: dict[str, GemmaConfig] = {
    "dummy": GemmaConfig(width=64, depth=4, mlp_dim=128, num_heads=8, num_kv_heads=1, head_dim=16),
    "gemma_300m": GemmaConfig(
        width=1024, depth=18, mlp_dim=4096, num_heads=8, num_kv_heads=1, head_dim=256
    ),
    "gemma_2b": GemmaConfig(
        width=2048, depth=18, mlp_dim=16384, num_heads=8, num_kv_heads=1, head_dim=256
    ),
}


@dataclass(frozen=True, slots=True)
class VisionConfig:
    """The SigLIP tower (``So400m/14`` in the real model), without its pooling head."""

    image_size: int = 224
    patch_size: int = 14
    width: int = 1152
    depth: int = 27
    mlp_dim: int = 4304
    num_heads: int = 16
    layer_norm_eps: float = 1e-6

    def __post_init__(self) -> None:
        if self.image_size % self.patch_size:
            raise UnsupportedModelError(
                f"image_size {self.image_size} is not a multiple of patch_size {self.patch_size}"
            )

    @property
    def num_patches(self) -> int:
        """Tokens per image."""
        return (self.image_size // self.patch_size) ** 2


@dataclass(frozen=True, slots=True)
class Pi05Config:
    """A pi0.5 model (openpi ``Pi0Config(pi05=True)``) and its serving defaults.

    Attributes:
        name: The config's name.
        vision: The SigLIP tower.
        vlm: The PaliGemma expert (the prefix).
        expert: The action expert (the flow-matching suffix).
        vocab_size: Token vocabulary of the VLM.
        action_dim: Width of the model's actions (robots use a prefix of it).
        action_horizon: Actions per chunk.
        num_steps: Euler steps of flow matching (t from 1 to 0).
        max_token_len: Longest prompt, BOS and padding included.
        cameras: The model's camera slots, in prefix order.
        robot_dof: Action dimensions a robot receives (DROID: 7 joints + gripper).
        robot: Whose observations requests carry (one of `ROBOTS`; its keys:
            `mstar.zoo.pi05.robots`).
        discrete_state_input: Whether the state is binned into the prompt (openpi's flag;
            ``pi05_libero`` turns it off: the prompt is then the task alone).
        prompt_state_dim: Width the normalized state is zero-padded to before it is binned;
            None bins the robot's own dims (openpi), LeRobot pads to its ``max_state_dim``.
        max_position: Longest prefix + suffix the rotary tables cover.
    """

    name: str
    vision: VisionConfig
    vlm: GemmaConfig
    expert: GemmaConfig
    vocab_size: int = 257_152
    action_dim: int = 32
    action_horizon: int = 15
    num_steps: int = 10
    max_token_len: int = 200
    cameras: tuple[str, ...] = ("base_0_rgb", "left_wrist_0_rgb", "right_wrist_0_rgb")
    robot_dof: int = 8
    robot: str = "droid"
    discrete_state_input: bool = True
    prompt_state_dim: int | None = None
    rms_norm_eps: float = 1e-6
    min_period: float = 4e-3
    max_period: float = 4.0
    rope_theta: float = 10_000.0
    max_position: int = 2048
    extra: dict[str, str] = field(default_factory=dict, hash=False, compare=False)

    def __post_init__(self) -> None:
        vlm, expert = self.vlm, self.expert
        if (vlm.depth, vlm.num_heads, vlm.num_kv_heads, vlm.head_dim) != (
            expert.depth,
            expert.num_heads,
            expert.num_kv_heads,
            expert.head_dim,
        ):
            raise UnsupportedModelError(
                "the VLM and the action expert attend jointly: they need the same depth, "
                "heads, KV heads and head size"
            )
        if not 0 < self.robot_dof <= self.action_dim:
            raise UnsupportedModelError(
                f"robot_dof must be in 1..{self.action_dim}, got {self.robot_dof}"
            )
        if self.robot not in ROBOTS:
            raise UnsupportedModelError(
                f"unknown robot {self.robot!r}: pi0.5 serves {', '.join(ROBOTS)}"
            )
        if not self.cameras:
            raise UnsupportedModelError("a pi0.5 model needs at least one camera slot")
        if self.prompt_state_dim is not None and self.prompt_state_dim < 1:
            raise UnsupportedModelError(
                f"prompt_state_dim must be positive, got {self.prompt_state_dim}"
            )

    @property
    def prefix_len(self) -> int:
        """Longest prefix: every camera's patches and the longest prompt."""
        return len(self.cameras) * self.vision.num_patches + self.max_token_len


PI05_CONFIGS: dict[str, Pi05Config] = {
    "pi05-droid": Pi05Config(
        name="pi05-droid",
        vision=VisionConfig(),
        vlm=GEMMA_VARIANTS["gemma_2b"],
        expert=GEMMA_VARIANTS["gemma_300m"],
    ),
    # Meaningful on a CPU: real prompt length and camera count, narrow and shallow experts.
    "pi05-small": Pi05Config(
        name="pi05-small",
        vision=VisionConfig(
            image_size=112, patch_size=14, width=192, depth=4, mlp_dim=768, num_heads=4
        ),
        vlm=GemmaConfig(width=256, depth=6, mlp_dim=1024, num_heads=8, num_kv_heads=1, head_dim=32),
        expert=GemmaConfig(
            width=128, depth=6, mlp_dim=512, num_heads=8, num_kv_heads=1, head_dim=32
        ),
        vocab_size=1024,
        max_token_len=64,
    ),
    # openpi's ``dummy`` Gemma for both experts, a tiny SigLIP, a toy vocabulary (tests).
    "pi05-tiny": Pi05Config(
        name="pi05-tiny",
        vision=VisionConfig(
            image_size=32, patch_size=8, width=32, depth=2, mlp_dim=64, num_heads=4
        ),
        vlm=GEMMA_VARIANTS["dummy"],
        expert=GEMMA_VARIANTS["dummy"],
        vocab_size=512,
        action_horizon=10,
        max_token_len=48,
    ),
}


def get_pi05_config(name: str) -> Pi05Config:
    """Return a named config.

    Raises:
        UnsupportedModelError: Unknown name.
    """
    try:
        return PI05_CONFIGS[name]
    except KeyError:
        raise UnsupportedModelError(
            f"unknown pi0.5 config {name!r} (known: {', '.join(PI05_CONFIGS)})"
        ) from None


def known_vision_heads(width: int, depth: int, mlp_dim: int) -> int | None:
    """Return the head count of a known SigLIP tower of these sizes (So400m/14, the presets'), else
    None.

    No tensor's shape holds it, so a checkpoint of another tower must name it.
    """
    for vision in (VisionConfig(), *(c.vision for c in PI05_CONFIGS.values())):
        if (vision.width, vision.depth, vision.mlp_dim) == (width, depth, mlp_dim):
            return vision.num_heads
    return None
