"""openpi's policy transforms for pi0.5: normalize the state, unnormalize and cut the actions.

A request runs, as in openpi's server (the robot's keys: `mstar.zoo.pi05.robots`)::

    obs dict --RobotLayout.parse--> RobotObservation --quantile_normalize(state)--> bins in the
    prompt
                                                     --prepare_image(each camera)--> [cams, 3, S, S]
                                                     in [-1, 1]
    model actions [H, 32] --quantile_unnormalize--> [:, :robot dims] --> {"actions": [H, 8]} (DROID)

`DroidObservation` is DROID's request with named fields. Everything here is plain numpy/torch on
the CPU: no model, no IO besides the stats file.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mstar.errors import CheckpointError
from mstar.zoo.pi05.images import absent_image, prepare_image, resize_with_pad
from mstar.zoo.pi05.robots import (
    DROID,
    DROID_CAMERA_KEYS,
    EXTERIOR_IMAGE_KEY,
    GRIPPER_POSITION_KEY,
    JOINT_POSITION_KEY,
    NUM_JOINTS,
    PROMPT_KEY,
    WRIST_IMAGE_KEY,
    RobotLayout,
    RobotObservation,
)

__all__ = [
    "DROID_CAMERA_KEYS",
    "EXTERIOR_IMAGE_KEY",
    "GRIPPER_POSITION_KEY",
    "JOINT_POSITION_KEY",
    "NORM_STATS_FILE",
    "NUM_JOINTS",
    "PROMPT_KEY",
    "WRIST_IMAGE_KEY",
    "DroidObservation",
    "NormStats",
    "QuantileStats",
    "absent_image",
    "droid_actions",
    "prepare_image",
    "prompt_state",
    "quantile_normalize",
    "quantile_shift",
    "quantile_unnormalize",
    "resize_with_pad",
    "robot_actions",
    "write_norm_stats",
]

NORM_STATS_FILE = "norm_stats.json"
# openpi adds it to the quantile range, so a constant dimension (q01 == q99) does not divide by 0.
_EPS = 1e-6


# -- normalization ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class QuantileStats:
    """One key's statistics: the 1st and 99th percentiles (mean and std kept for the file).

    Raises:
        ValueError: The vectors are not 1-D of one length, or hold non-finite values.
    """

    q01: np.ndarray
    q99: np.ndarray
    mean: np.ndarray | None = None
    std: np.ndarray | None = None

    def __post_init__(self) -> None:
        for name in ("q01", "q99", "mean", "std"):
            value = getattr(self, name)
            if value is None:
                continue
            array = np.asarray(value, dtype=np.float64)
            if array.ndim != 1 or array.shape != np.shape(self.q01):
                raise ValueError(
                    f"{name} must be 1-D like q01 {np.shape(self.q01)}, got shape {array.shape}"
                )
            if not np.isfinite(array).all():
                raise ValueError(f"{name} holds non-finite values")
            # Frozen: bypass __setattr__ to store the validated float64 copy.
            object.__setattr__(self, name, array)

    @property
    def num_dims(self) -> int:
        """Dimensions the stats cover."""
        return int(self.q01.shape[0])


@dataclass(frozen=True, slots=True)
class NormStats:
    """The stats pi0.5 normalizes with: the state's (input) and the actions' (output)."""

    state: QuantileStats
    actions: QuantileStats

    @classmethod
    def load(cls, path: str | Path) -> NormStats:
        """Read openpi's ``norm_stats.json``: ``{"norm_stats": {key: {mean, std, q01, q99}}}``.

        Args:
            path: The file, in openpi checkpoints ``<checkpoint>/assets/<asset_id>/norm_stats.json``
                (asset id ``droid`` for pi05_droid).

        Raises:
            CheckpointError: The file is missing or malformed, or lacks the state's or the
                actions' quantiles.
        """
        file = Path(path)
        if not file.is_file():
            raise CheckpointError(
                f"norm stats {str(file)!r} not found: openpi checkpoints keep them in "
                f"assets/<asset_id>/{NORM_STATS_FILE} (asset id 'droid' for pi05_droid)"
            )
        try:
            document = json.loads(file.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise CheckpointError(
                f"norm stats {str(file)!r} are not readable JSON: {exc}"
            ) from None
        stats = document.get("norm_stats") if isinstance(document, dict) else None
        if not isinstance(stats, dict):
            raise CheckpointError(f"norm stats {str(file)!r} have no top-level 'norm_stats' object")
        return cls(
            state=_key_stats(stats, "state", file), actions=_key_stats(stats, "actions", file)
        )

    def to_json(self) -> dict[str, Any]:
        """Return the stats in openpi's ``norm_stats.json`` layout."""
        return {
            "norm_stats": {"state": _stats_json(self.state), "actions": _stats_json(self.actions)}
        }


def _key_stats(stats: dict[str, Any], key: str, file: Path) -> QuantileStats:
    entry = stats.get(key)
    if not isinstance(entry, dict):
        raise CheckpointError(f"norm stats {str(file)!r} have no 'norm_stats.{key}' entry")
    for name in ("q01", "q99"):
        if name not in entry:
            # openpi's schema makes them optional, but pi0.5 normalizes with quantiles only.
            raise CheckpointError(
                f"norm stats {str(file)!r} have no 'norm_stats.{key}.{name}': pi0.5 needs quantile "
                "stats (recompute them with openpi's compute_norm_stats)"
            )

    def vector(name: str) -> np.ndarray | None:
        if name not in entry:
            return None
        try:
            return np.asarray(entry[name], dtype=np.float64)
        except (TypeError, ValueError):
            raise CheckpointError(
                f"norm stats {str(file)!r}: 'norm_stats.{key}.{name}' is not a list of numbers"
            ) from None

    try:
        q01, q99 = vector("q01"), vector("q99")
        assert q01 is not None and q99 is not None  # checked above
        return QuantileStats(q01=q01, q99=q99, mean=vector("mean"), std=vector("std"))
    except ValueError as exc:
        raise CheckpointError(f"norm stats {str(file)!r}: 'norm_stats.{key}': {exc}") from None


def _stats_json(stats: QuantileStats) -> dict[str, list[float]]:
    fields = {"mean": stats.mean, "std": stats.std, "q01": stats.q01, "q99": stats.q99}
    return {name: value.tolist() for name, value in fields.items() if value is not None}


def write_norm_stats(path: str | Path, stats: NormStats) -> Path:
    """Write ``norm_stats.json`` (for generated checkpoints), atomically; return its path.

    openpi's own loader also wants ``mean`` and ``std``: give them in the stats for a file
    openpi can read too.
    """
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, scratch = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as file:
            json.dump(stats.to_json(), file, indent=2)
        os.replace(scratch, target)
    except BaseException:
        Path(scratch).unlink(missing_ok=True)
        raise
    return target


def quantile_normalize(x: np.ndarray | Sequence[float], stats: QuantileStats) -> np.ndarray:
    """Map ``x`` to about [-1, 1] by its quantiles: ``(x - q01) / (q99 - q01 + 1e-6) * 2 - 1``.

    The stats are cut to ``x``'s last dimension, as openpi does for an unpadded state.

    Returns:
        float64, the shape of ``x`` (openpi's stats are float64, so its arithmetic is too).

    Raises:
        ValueError: ``x`` has more dimensions than the stats.
    """
    values = np.asarray(x, dtype=np.float64)
    num_dims = values.shape[-1] if values.ndim else 1
    if num_dims > stats.num_dims:
        raise ValueError(f"cannot normalize {num_dims} dims with stats of {stats.num_dims}")
    q01, q99 = stats.q01[:num_dims], stats.q99[:num_dims]
    return (values - q01) / (q99 - q01 + _EPS) * 2.0 - 1.0


def quantile_unnormalize(x: np.ndarray | Sequence[float], stats: QuantileStats) -> np.ndarray:
    """Invert `quantile_normalize`: ``(x + 1) / 2 * (q99 - q01 + 1e-6) + q01``.

    Only the first ``len(q01)`` dims are unnormalized; the rest (the model's padding past the
    robot's dims) pass through unchanged. Stats longer than ``x`` are cut to it.

    Returns:
        float64, the shape of ``x``.
    """
    # a copy: the tail passes through, the head is overwritten
    values = np.array(x, dtype=np.float64)
    num_dims = min(values.shape[-1], stats.num_dims)
    q01, q99 = stats.q01[:num_dims], stats.q99[:num_dims]
    values[..., :num_dims] = (values[..., :num_dims] + 1.0) / 2.0 * (q99 - q01 + _EPS) + q01
    return values


def quantile_shift(delta: np.ndarray | Sequence[float], stats: QuantileStats) -> np.ndarray:
    """Return the shift in normalized units that moves `quantile_unnormalize`'s result by ``delta``.

    Unnormalizing is affine per dim, so ``quantile_unnormalize(x + quantile_shift(d)) ==
    quantile_unnormalize(x) + d`` (up to rounding); dims past the stats pass through as they are.
    """
    values = np.array(delta, dtype=np.float64)
    num_dims = min(values.shape[-1], stats.num_dims)
    values[..., :num_dims] *= 2.0 / (stats.q99[:num_dims] - stats.q01[:num_dims] + _EPS)
    return values


def droid_actions(
    actions: np.ndarray | torch.Tensor, stats: NormStats, robot_dof: int = 8
) -> np.ndarray:
    """Turn the model's actions ``[H, action_dim]`` into DROID's ``[H, robot_dof]`` (float64).

    openpi unnormalizes all of them, then keeps the robot's dims (7 joint velocities, gripper).
    """
    if isinstance(actions, torch.Tensor):
        actions = actions.detach().to(device="cpu", dtype=torch.float32).numpy()
    return quantile_unnormalize(actions, stats.actions)[..., :robot_dof]


def robot_actions(
    actions: np.ndarray | torch.Tensor, stats: NormStats, layout: RobotLayout
) -> np.ndarray:
    """Turn the model's (absolute) actions ``[H, action_dim]`` into the robot's ``[H,
    layout.action_dim]`` (float64).

    openpi's output transforms: unnormalize, keep the robot's dims, map them to its convention.
    """
    return layout.encode_actions(droid_actions(actions, stats, layout.action_dim))


def prompt_state(
    observation: RobotObservation, stats: NormStats, width: int | None = None
) -> np.ndarray:
    """Return the state the prompt bins: quantile-normalized, zero-padded to ``width`` if given.

    openpi bins the robot's own dims (``width`` None); LeRobot pads to its ``max_state_dim``
    first.

    Raises:
        ValueError: The stats cover fewer dims than the state, or ``width`` is smaller than it.
    """
    state = quantile_normalize(observation.state, stats.state)
    if width is None:
        return state
    if width < state.shape[0]:
        raise ValueError(f"cannot pad a state of {state.shape[0]} dims to {width}")
    return np.concatenate([state, np.zeros(width - state.shape[0])])


# -- DROID's observation ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class DroidObservation:
    """One validated DROID request, as openpi's ``DroidInputs`` reads it (`DROID`'s layout, named).

    Attributes:
        exterior_image: The exterior camera, uint8 ``[H, W, 3]``.
        wrist_image: The wrist camera, uint8 ``[H, W, 3]``.
        state: Joint positions then the gripper, float64 ``[8]``, not normalized.
        prompt: The instruction, non-empty.
    """

    exterior_image: np.ndarray
    wrist_image: np.ndarray
    state: np.ndarray
    prompt: str

    @classmethod
    def parse(cls, obs: Mapping[str, Any]) -> DroidObservation:
        """Validate an openpi DROID observation dict.

        Keys: ``observation/exterior_image_1_left`` and ``observation/wrist_image_left``
        (uint8 HxWx3, or float in [0, 1], or channels first), ``observation/joint_position``
        (7), ``observation/gripper_position`` (1 or a scalar), ``prompt`` (str or UTF-8 bytes).
        Other keys are ignored.

        Raises:
            ValueError: A key is missing or its value is malformed; the message names the key
                and what was expected.
        """
        parsed = DROID.parse(obs)
        return cls(
            exterior_image=parsed.images["base_0_rgb"],
            wrist_image=parsed.images["left_wrist_0_rgb"],
            state=parsed.state,
            prompt=parsed.prompt,
        )

    def robot_observation(self) -> RobotObservation:
        """Return the same request as any robot's."""
        images = {"base_0_rgb": self.exterior_image, "left_wrist_0_rgb": self.wrist_image}
        return RobotObservation(images=images, state=self.state, prompt=self.prompt)

    def normalized_state(self, stats: NormStats) -> np.ndarray:
        """Return the state quantile-normalized, the values the prompt bins."""
        return quantile_normalize(self.state, stats.state)

    def camera_images(self, cameras: Sequence[str], size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Prepare an image for every camera slot of the model, in order.

        Args:
            cameras: The model's slots (``Pi05Config.cameras``); those DROID does not fill
                (see `DROID_CAMERA_KEYS`) are absent.
            size: Side of the model's square images.

        Returns:
            ``(images, mask)``: float32 ``[len(cameras), 3, size, size]`` in [-1, 1] and bool
            ``[len(cameras)]``, False for absent cameras.
        """
        return self.robot_observation().camera_images(cameras, size)
