"""openpi's DROID policy transforms for pi0.5: parse, normalize, prepare images, unnormalize.

A request runs, as in openpi's server::

    obs dict --parse--> DroidObservation --quantile_normalize(state)--> bins in the prompt
                                         --prepare_image(each camera)--> [cams, 3, S, S] in [-1, 1]
    model actions [H, 32] --quantile_unnormalize--> [:, :robot_dof] --> {"actions": [H, 8]}

Everything here is plain numpy/torch on the CPU: no model, no IO besides the stats file.
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
from PIL import Image

from mstar.errors import CheckpointError

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
    "quantile_normalize",
    "quantile_unnormalize",
    "resize_with_pad",
    "write_norm_stats",
]

NORM_STATS_FILE = "norm_stats.json"
# openpi adds it to the quantile range, so a constant dimension (q01 == q99) does not divide by 0.
_EPS = 1e-6

EXTERIOR_IMAGE_KEY = "observation/exterior_image_1_left"
WRIST_IMAGE_KEY = "observation/wrist_image_left"
JOINT_POSITION_KEY = "observation/joint_position"
GRIPPER_POSITION_KEY = "observation/gripper_position"
PROMPT_KEY = "prompt"
NUM_JOINTS = 7

# The model's camera slots DROID fills; every other slot (right_wrist_0_rgb) is absent.
DROID_CAMERA_KEYS: dict[str, str] = {"base_0_rgb": EXTERIOR_IMAGE_KEY, "left_wrist_0_rgb": WRIST_IMAGE_KEY}


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
                raise ValueError(f"{name} must be 1-D like q01 {np.shape(self.q01)}, got shape {array.shape}")
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
            raise CheckpointError(f"norm stats {str(file)!r} are not readable JSON: {exc}") from None
        stats = document.get("norm_stats") if isinstance(document, dict) else None
        if not isinstance(stats, dict):
            raise CheckpointError(f"norm stats {str(file)!r} have no top-level 'norm_stats' object")
        return cls(state=_key_stats(stats, "state", file), actions=_key_stats(stats, "actions", file))

    def to_json(self) -> dict[str, Any]:
        """Return the stats in openpi's ``norm_stats.json`` layout."""
        return {"norm_stats": {"state": _stats_json(self.state), "actions": _stats_json(self.actions)}}


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
            raise CheckpointError(f"norm stats {str(file)!r}: 'norm_stats.{key}.{name}' is not a list of numbers") from None

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
    values = np.array(x, dtype=np.float64)  # a copy: the tail passes through, the head is overwritten
    num_dims = min(values.shape[-1], stats.num_dims)
    q01, q99 = stats.q01[:num_dims], stats.q99[:num_dims]
    values[..., :num_dims] = (values[..., :num_dims] + 1.0) / 2.0 * (q99 - q01 + _EPS) + q01
    return values


def droid_actions(actions: np.ndarray | torch.Tensor, stats: NormStats, robot_dof: int = 8) -> np.ndarray:
    """Turn the model's actions ``[H, action_dim]`` into DROID's ``[H, robot_dof]`` (float64).

    openpi unnormalizes all of them, then keeps the robot's dims (7 joint velocities, gripper).
    """
    if isinstance(actions, torch.Tensor):
        actions = actions.detach().to(device="cpu", dtype=torch.float32).numpy()
    return quantile_unnormalize(actions, stats.actions)[..., :robot_dof]


# -- observations ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class DroidObservation:
    """One validated DROID request, as openpi's ``DroidInputs`` reads it.

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
        if not isinstance(obs, Mapping):
            raise ValueError(f"a DROID observation is a mapping of keys to values, got {type(obs).__name__}")
        joints = _parse_vector(obs, JOINT_POSITION_KEY, NUM_JOINTS)
        gripper = _parse_vector(obs, GRIPPER_POSITION_KEY, 1, allow_scalar=True)
        return cls(
            exterior_image=_parse_image(obs, EXTERIOR_IMAGE_KEY),
            wrist_image=_parse_image(obs, WRIST_IMAGE_KEY),
            state=np.concatenate([joints, gripper]),
            prompt=_parse_prompt(obs),
        )

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
        by_key = {EXTERIOR_IMAGE_KEY: self.exterior_image, WRIST_IMAGE_KEY: self.wrist_image}
        images, present = [], []
        for camera in cameras:
            key = DROID_CAMERA_KEYS.get(camera)
            images.append(absent_image(size) if key is None else prepare_image(by_key[key], size))
            present.append(key is not None)
        return torch.stack(images), torch.tensor(present, dtype=torch.bool)


def _missing(key: str, expected: str) -> ValueError:
    return ValueError(f"DROID observation has no {key!r} ({expected})")


def _parse_image(obs: Mapping[str, Any], key: str) -> np.ndarray:
    expected = "a uint8 HxWx3 image"
    if key not in obs:
        raise _missing(key, expected)
    try:
        image = np.asarray(obs[key])
    except (TypeError, ValueError):
        raise ValueError(f"{key!r} must be {expected}, got a {type(obs[key]).__name__}") from None
    if image.ndim == 3 and image.shape[0] == 3 and image.shape[-1] != 3:
        image = image.transpose(1, 2, 0)  # channels first -> HWC, as openpi accepts both
    if image.ndim != 3 or image.shape[-1] != 3 or 0 in image.shape:
        raise ValueError(f"{key!r} must be {expected} (or 3xHxW), got shape {image.shape}")
    if image.dtype == np.uint8:
        return np.ascontiguousarray(image)
    if np.issubdtype(image.dtype, np.integer) and image.min() >= 0 and image.max() <= 255:
        # Integer pixels (a JSON body's nested lists) are uint8 values.
        return np.ascontiguousarray(image.astype(np.uint8))
    if np.issubdtype(image.dtype, np.floating):
        if not np.isfinite(image).all() or image.min() < 0.0 or image.max() > 1.0:
            raise ValueError(f"{key!r} is a float image, so its values must be finite and in [0, 1]")
        # openpi's conversion: scale and truncate (no rounding).
        return np.ascontiguousarray((image * 255).astype(np.uint8))
    raise ValueError(f"{key!r} must be uint8 (or float in [0, 1]), got dtype {image.dtype}")


def _parse_vector(obs: Mapping[str, Any], key: str, size: int, *, allow_scalar: bool = False) -> np.ndarray:
    expected = f"{size} numbers" + (" or a number" if allow_scalar else "")
    if key not in obs:
        raise _missing(key, expected)
    try:
        vector = np.asarray(obs[key])
    except (TypeError, ValueError):
        raise ValueError(f"{key!r} must be {expected}, got a {type(obs[key]).__name__}") from None
    # Booleans are numbers to numpy; a boolean joint angle is a client bug.
    if vector.dtype.kind not in "iuf":
        raise ValueError(f"{key!r} must be {expected}, got dtype {vector.dtype}")
    if allow_scalar and vector.ndim == 0:
        vector = vector.reshape(1)
    if vector.shape != (size,):
        raise ValueError(f"{key!r} must be {expected}, got shape {vector.shape}")
    vector = vector.astype(np.float64)
    if not np.isfinite(vector).all():
        raise ValueError(f"{key!r} must be finite, got {vector.tolist()}")
    return vector


def _parse_prompt(obs: Mapping[str, Any]) -> str:
    if PROMPT_KEY not in obs:
        raise _missing(PROMPT_KEY, "the task instruction, a string")
    prompt = obs[PROMPT_KEY]
    if isinstance(prompt, bytes):
        try:
            prompt = prompt.decode("utf-8")
        except UnicodeDecodeError:
            raise ValueError(f"{PROMPT_KEY!r} bytes must be UTF-8 text") from None
    if not isinstance(prompt, str):
        raise ValueError(f"{PROMPT_KEY!r} must be a string, got a {type(prompt).__name__}")
    if not prompt.strip():
        raise ValueError(f"{PROMPT_KEY!r} must be a non-empty instruction")
    return str(prompt)


# -- images ----------------------------------------------------------------------------------


def resize_with_pad(image: np.ndarray, size: int) -> np.ndarray:
    """Fit a uint8 HWC image into ``size x size``, keeping its aspect ratio, padding with black.

    openpi's geometry: ``ratio = max(w, h) / size``, resized to ``int(h / ratio) x int(w / ratio)``
    (which can be ``size - 1`` on the long side), centred with ``floor(diff / 2)`` pixels before.
    The resize is PIL's BILINEAR, the one openpi's DROID client runs before sending 224x224
    images (the server's own resize is then the identity); openpi's server-side JAX bilinear
    resize differs from it by rounding only for images of another size.

    ::

        100x200 -> 224:  ratio 200/224, resized 112x224
        +--------------------+
        |  56 rows of 0      |
        |  image 112 x 224   |
        |  56 rows of 0      |
        +--------------------+
    """
    height, width = image.shape[:2]
    if (height, width) == (size, size):
        return image
    ratio = max(width / size, height / size)
    # At least one pixel: openpi would fail on a 1000:1 strip; nothing else changes.
    new_height, new_width = max(1, int(height / ratio)), max(1, int(width / ratio))
    resized = Image.fromarray(image).resize((new_width, new_height), resample=Image.Resampling.BILINEAR)
    padded = np.zeros((size, size, 3), dtype=np.uint8)
    top, left = (size - new_height) // 2, (size - new_width) // 2
    padded[top : top + new_height, left : left + new_width] = np.asarray(resized)
    return padded


def prepare_image(image: np.ndarray, size: int) -> torch.Tensor:
    """Resize-with-pad a uint8 HWC image and map it to float32 ``[3, size, size]`` in [-1, 1].

    Padding is 0 in uint8, so -1 (black) after ``x / 255 * 2 - 1``.

    Raises:
        ValueError: The image is not uint8 ``[H, W, 3]``.
    """
    if image.dtype != np.uint8 or image.ndim != 3 or image.shape[-1] != 3 or 0 in image.shape:
        raise ValueError(f"expected a uint8 HxWx3 image, got {image.dtype} {image.shape}")
    if size < 1:
        raise ValueError(f"image size must be positive, got {size}")
    fitted = np.ascontiguousarray(resize_with_pad(image, size))
    pixels = torch.from_numpy(fitted).permute(2, 0, 1).to(torch.float32)
    return pixels / 255.0 * 2.0 - 1.0


def absent_image(size: int) -> torch.Tensor:
    """Return the image of a camera the robot lacks: black, -1 everywhere (its mask is False)."""
    return torch.full((3, size, size), -1.0, dtype=torch.float32)
