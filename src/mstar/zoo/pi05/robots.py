"""The robots pi0.5 serves: each one's observation keys, state and action width, in one table.

openpi's ``src/openpi/policies/{droid,libero,aloha}_policy.py`` read these observations; every
robot here is one `RobotLayout` row of `ROBOT_LAYOUTS`, and one parser reads them all::

    robot   cameras (model slot <- key)                            state (dims)
    actions  asset id
    droid   base_0_rgb       <- observation/exterior_image_1_left  observation/joint_position (7)  8
    droid
            left_wrist_0_rgb <- observation/wrist_image_left       + observation/gripper_position
            (1)
    libero  base_0_rgb       <- observation/image                  observation/state (8)           7
    physical-intelligence/libero
            left_wrist_0_rgb <- observation/wrist_image
    aloha   images: {cam_high -> base_0_rgb, cam_left_wrist ->     state (14)
    14       trossen
            left_wrist_0_rgb, cam_right_wrist -> right_wrist_0_rgb; cam_low is accepted, unused}

Every robot also sends ``prompt``. Slots a robot does not fill are absent (black, masked). ALOHA
follows openpi's ``pi05_aloha``: joints are sign-flipped and grippers mapped to pi's angular
range on the way in and out (``adapt_to_pi``), and the model's joint actions are deltas to the
current state (``delta_action_mask``; `mstar.zoo.pi05.policy` adds the state back).

Everything here is plain numpy on the CPU: no model, no IO.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from mstar.errors import UnsupportedModelError
from mstar.zoo.pi05.config import ROBOTS
from mstar.zoo.pi05.images import absent_image, prepare_image

__all__ = [
    "ALOHA",
    "DROID",
    "DROID_CAMERA_KEYS",
    "EXTERIOR_IMAGE_KEY",
    "GRIPPER_POSITION_KEY",
    "JOINT_POSITION_KEY",
    "LIBERO",
    "NUM_JOINTS",
    "OPENPI_CAMERAS",
    "PROMPT_KEY",
    "ROBOT_LAYOUTS",
    "WRIST_IMAGE_KEY",
    "CameraField",
    "RobotLayout",
    "RobotObservation",
    "StateField",
    "aloha_actions_from_pi",
    "aloha_state_to_pi",
    "camera_slots",
    "get_robot_layout",
    "missing_key",
    "parse_image",
    "parse_prompt",
    "parse_vector",
]

PROMPT_KEY = "prompt"
EXTERIOR_IMAGE_KEY = "observation/exterior_image_1_left"
WRIST_IMAGE_KEY = "observation/wrist_image_left"
JOINT_POSITION_KEY = "observation/joint_position"
GRIPPER_POSITION_KEY = "observation/gripper_position"
NUM_JOINTS = 7

# openpi's camera slots, in prefix order. A config naming other cameras (a LeRobot config.json's
# image features) gets the robot's cameras by position instead.
OPENPI_CAMERAS = ("base_0_rgb", "left_wrist_0_rgb", "right_wrist_0_rgb")


@dataclass(frozen=True, slots=True)
class CameraField:
    """One camera of a robot: the model slot it fills and its key in the observation."""

    slot: str
    key: str
    is_required: bool = True


@dataclass(frozen=True, slots=True)
class StateField:
    """One vector of a robot's state (the state is the fields concatenated in order)."""

    key: str
    size: int
    allow_scalar: bool = False


@dataclass(frozen=True, slots=True)
class RobotLayout:
    """What one robot sends and receives (a row of `ROBOT_LAYOUTS`).

    Attributes:
        name: The robot (one of `mstar.zoo.pi05.config.ROBOTS`).
        label: Its name in error messages.
        cameras: Its cameras, in model slot order.
        state: Its state vectors.
        action_dim: Action dims the robot gets (a prefix of the model's).
        asset_id: openpi's folder of its norm stats under ``assets/``.
        action_horizon: openpi's chunk length for the robot (when the checkpoint names none).
        discrete_state_input: Whether openpi's config for it bins the state into the prompt.
        images_key: The key of a mapping holding the cameras (ALOHA's ``images``), else None:
            cameras are top-level keys.
        ignored_cameras: Camera keys accepted in ``images_key`` but unused.
        adapt_to_pi: Map joints and grippers between the robot's convention and pi's (ALOHA).
        delta_action_mask: Action dims the model predicts relative to the state (ALOHA's joints).
    """

    name: str
    label: str
    cameras: tuple[CameraField, ...]
    state: tuple[StateField, ...]
    action_dim: int
    asset_id: str
    action_horizon: int
    discrete_state_input: bool = True
    images_key: str | None = None
    ignored_cameras: tuple[str, ...] = ()
    adapt_to_pi: bool = False
    delta_action_mask: tuple[bool, ...] = ()

    @property
    def state_dim(self) -> int:
        """Width of the robot's state."""
        return sum(f.size for f in self.state)

    def parse(self, obs: Mapping[str, Any]) -> RobotObservation:
        """Validate an observation dict of this robot; other keys are ignored.

        Images are uint8 HxWx3, float in [0, 1] or channels first; vectors are numbers; the
        prompt is a non-empty string (or UTF-8 bytes).

        Raises:
            ValueError: A key is missing or its value is malformed; the message names the key
                and what was expected.
        """
        if not isinstance(obs, Mapping):
            raise ValueError(
                f"a {self.label} observation is a mapping of keys to values, got "
                f"{type(obs).__name__}"
            )
        vectors = [
            parse_vector(obs, f.key, f.size, self.label, allow_scalar=f.allow_scalar)
            for f in self.state
        ]
        state = np.concatenate(vectors)
        if self.adapt_to_pi:
            state = aloha_state_to_pi(state)
        return RobotObservation(
            images=self._parse_images(obs), state=state, prompt=parse_prompt(obs, self.label)
        )

    def _parse_images(self, obs: Mapping[str, Any]) -> dict[str, np.ndarray]:
        source: Mapping[str, Any] = obs
        if self.images_key is not None:
            key = self.images_key
            if key not in obs:
                raise missing_key(self.label, key, "a mapping of camera names to images")
            source = obs[key]
            if not isinstance(source, Mapping):
                raise ValueError(
                    f"{key!r} must be a mapping of camera names to images, got "
                    f"{type(source).__name__}"
                )
            known = [c.key for c in self.cameras] + list(self.ignored_cameras)
            unknown = sorted(str(name) for name in source if name not in known)
            if unknown:
                raise ValueError(
                    f"{key!r} has unknown cameras {unknown}: {self.label} sends some of {known}"
                )
        return {
            camera.slot: parse_image(source, camera.key, self.label, within=self.images_key)
            for camera in self.cameras
            if camera.is_required or camera.key in source
        }

    def delta_offset(self, state: np.ndarray, width: int) -> np.ndarray | None:
        """Return what the model's delta actions are relative to, ``[width]`` (None: all absolute).

        ``state`` is in the model's space (after `parse`); dims outside the mask get 0.
        """
        if not any(self.delta_action_mask):
            return None
        offset = np.zeros(width, dtype=np.float64)
        dims = len(self.delta_action_mask)
        offset[:dims] = np.where(self.delta_action_mask, state[:dims], 0.0)
        return offset

    def encode_actions(self, actions: np.ndarray) -> np.ndarray:
        """Map absolute actions ``[..., action_dim]`` from the model's convention to the robot's."""
        return aloha_actions_from_pi(actions) if self.adapt_to_pi else actions


@dataclass(frozen=True, slots=True)
class RobotObservation:
    """One validated request of any robot.

    Attributes:
        images: The cameras present, by model slot (uint8 ``[H, W, 3]``).
        state: The state in the model's convention (ALOHA's mapped to pi's), float64, not
            normalized.
        prompt: The instruction, non-empty.
    """

    images: Mapping[str, np.ndarray]
    state: np.ndarray
    prompt: str

    def camera_images(self, cameras: Sequence[str], size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Prepare an image for every camera slot of the model, in order (see `camera_slots`).

        Returns:
            ``(images, mask)``: float32 ``[len(cameras), 3, size, size]`` in [-1, 1] and bool
            ``[len(cameras)]``, False for the slots the robot does not fill.
        """
        images, present = [], []
        for slot in camera_slots(cameras):
            image = self.images.get(slot) if slot is not None else None
            images.append(absent_image(size) if image is None else prepare_image(image, size))
            present.append(image is not None)
        return torch.stack(images), torch.tensor(present, dtype=torch.bool)


def camera_slots(cameras: Sequence[str]) -> list[str | None]:
    """Return the openpi slot each of a model's cameras shows (None: no robot fills it).

    A config with openpi's slot names gets them by name; one naming none of them (a LeRobot
    checkpoint's own camera names) gets openpi's slots by position.
    """
    if any(camera in OPENPI_CAMERAS for camera in cameras):
        return [camera if camera in OPENPI_CAMERAS else None for camera in cameras]
    return [OPENPI_CAMERAS[i] if i < len(OPENPI_CAMERAS) else None for i in range(len(cameras))]


# -- ALOHA's conventions (openpi's aloha_policy.py, adapt_to_pi) ------------------------------

_ALOHA_JOINT_SIGNS = np.array([1, -1, -1, 1, 1, 1, 1] * 2, dtype=np.float64)
_ALOHA_GRIPPERS = [6, 13]
# The puppet gripper's linear range (m), and the horn and arm of the linkage that turns it.
_GRIPPER_LINEAR = (0.01844, 0.05800)
_HORN_RADIUS, _ARM_LENGTH = 0.022, 0.036
# pi's gripper: angles (rad) normalized to [0, 1] over this range; ALOHA's joint range.
_PI_GRIPPER_ANGLE = (0.5476, 1.6296)
_ALOHA_GRIPPER_JOINT = (-0.6213, 1.4910)


def aloha_state_to_pi(state: np.ndarray) -> np.ndarray:
    """Map an ALOHA state ``[14]`` to pi's convention: flipped joints, grippers as normalized
    angles."""
    out = np.asarray(state, dtype=np.float64) * _ALOHA_JOINT_SIGNS
    low, high = _GRIPPER_LINEAR
    linear = low + out[_ALOHA_GRIPPERS] * (high - low)
    with np.errstate(divide="ignore", invalid="ignore"):
        cosine = (_HORN_RADIUS**2 + linear**2 - _ARM_LENGTH**2) / (2 * _HORN_RADIUS * linear)
    angle = np.arcsin(np.clip(cosine, -1.0, 1.0))
    lo, hi = _PI_GRIPPER_ANGLE
    out[_ALOHA_GRIPPERS] = (angle - lo) / (hi - lo)
    return out


def aloha_actions_from_pi(actions: np.ndarray) -> np.ndarray:
    """Map actions ``[..., 14]`` from pi's convention back to ALOHA's (joints flipped, gripper joint
    range)."""
    out = np.asarray(actions, dtype=np.float64) * _ALOHA_JOINT_SIGNS
    lo, hi = _ALOHA_GRIPPER_JOINT
    out[..., _ALOHA_GRIPPERS] = (out[..., _ALOHA_GRIPPERS] + _PI_GRIPPER_ANGLE[0] - lo) / (hi - lo)
    return out


# -- the table --------------------------------------------------------------------------------

DROID = RobotLayout(
    name="droid",
    label="DROID",
    cameras=(
        CameraField("base_0_rgb", EXTERIOR_IMAGE_KEY),
        CameraField("left_wrist_0_rgb", WRIST_IMAGE_KEY),
    ),
    state=(
        StateField(JOINT_POSITION_KEY, NUM_JOINTS),
        StateField(GRIPPER_POSITION_KEY, 1, allow_scalar=True),
    ),
    action_dim=8,  # 7 joint velocities, the gripper
    asset_id="droid",
    action_horizon=15,
)
LIBERO = RobotLayout(
    name="libero",
    label="LIBERO",
    cameras=(
        CameraField("base_0_rgb", "observation/image"),
        CameraField("left_wrist_0_rgb", "observation/wrist_image"),
    ),
    state=(StateField("observation/state", 8),),
    action_dim=7,
    asset_id="physical-intelligence/libero",  # openpi's asset id is the dataset's repo id
    action_horizon=10,
    discrete_state_input=False,  # pi05_libero
)
ALOHA = RobotLayout(
    name="aloha",
    label="ALOHA",
    cameras=(
        CameraField("base_0_rgb", "cam_high"),
        CameraField("left_wrist_0_rgb", "cam_left_wrist", is_required=False),
        CameraField("right_wrist_0_rgb", "cam_right_wrist", is_required=False),
    ),
    state=(StateField("state", 14),),  # per arm: 6 joints, the gripper
    action_dim=14,
    asset_id="trossen",
    action_horizon=50,
    images_key="images",
    ignored_cameras=("cam_low",),
    adapt_to_pi=True,
    delta_action_mask=(True,) * 6 + (False,) + (True,) * 6 + (False,),
)

ROBOT_LAYOUTS: dict[str, RobotLayout] = {layout.name: layout for layout in (DROID, LIBERO, ALOHA)}
assert tuple(ROBOT_LAYOUTS) == ROBOTS

# The model's camera slots DROID fills; every other slot (right_wrist_0_rgb) is absent.
DROID_CAMERA_KEYS: dict[str, str] = {camera.slot: camera.key for camera in DROID.cameras}


def get_robot_layout(name: str) -> RobotLayout:
    """Return a robot's layout.

    Raises:
        UnsupportedModelError: Unknown robot (the message lists the known ones).
    """
    try:
        return ROBOT_LAYOUTS[name]
    except KeyError:
        raise UnsupportedModelError(
            f"unknown robot {name!r}: pi0.5 serves {', '.join(ROBOT_LAYOUTS)}"
        ) from None


# -- parsing one value --------------------------------------------------------------------------


def missing_key(label: str, key: str, expected: str, within: str | None = None) -> ValueError:
    """Return the error for an observation without ``key``."""
    where = f" in {within!r}" if within is not None else ""
    return ValueError(f"{label} observation has no {key!r}{where} ({expected})")


def parse_image(
    obs: Mapping[str, Any], key: str, label: str, *, within: str | None = None
) -> np.ndarray:
    """Return ``obs[key]`` as a uint8 ``[H, W, 3]`` image (from HWC or CHW, uint8, ints or [0, 1]
    floats).

    Raises:
        ValueError: The key is missing or not an image; the message names it.
    """
    expected = "a uint8 HxWx3 image"
    if key not in obs:
        raise missing_key(label, key, expected, within)
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
            raise ValueError(
                f"{key!r} is a float image, so its values must be finite and in [0, 1]"
            )
        # openpi's conversion: scale and truncate (no rounding).
        return np.ascontiguousarray((image * 255).astype(np.uint8))
    raise ValueError(f"{key!r} must be uint8 (or float in [0, 1]), got dtype {image.dtype}")


def parse_vector(
    obs: Mapping[str, Any], key: str, size: int, label: str, *, allow_scalar: bool = False
) -> np.ndarray:
    """Return ``obs[key]`` as ``size`` finite float64 numbers.

    Raises:
        ValueError: The key is missing, or not ``size`` finite numbers; the message names it.
    """
    expected = f"{size} numbers" + (" or a number" if allow_scalar else "")
    if key not in obs:
        raise missing_key(label, key, expected)
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


def parse_prompt(obs: Mapping[str, Any], label: str) -> str:
    """Return the instruction ``obs["prompt"]`` (a string or UTF-8 bytes, non-empty).

    Raises:
        ValueError: It is missing, empty or not text.
    """
    if PROMPT_KEY not in obs:
        raise missing_key(label, PROMPT_KEY, "the task instruction, a string")
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
