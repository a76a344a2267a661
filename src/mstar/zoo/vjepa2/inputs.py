"""Request fields to tensors: images, latents, poses and actions, with clear errors.

Images may be a ``uint8`` ``[H, W, 3]`` tensor (what ``mstar run --image`` sends), a float
``[3, H, W]`` tensor in [0, 1], or a path to an image file. They are resized (shorter side
to the model's size, antialiased), center-cropped and normalised with the ImageNet mean and
std, as the V-JEPA 2 evaluation transforms do.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from mstar.zoo.vjepa2.config import VJepa2Config

__all__ = ["as_actions", "as_latent", "as_pose", "prepare_image"]


def _load(value: Any, field: str) -> torch.Tensor:
    if isinstance(value, str | Path):
        from PIL import Image, UnidentifiedImageError

        path = Path(value).expanduser()
        if not path.is_file():
            raise ValueError(f"{field}: image file {str(path)!r} does not exist")
        try:
            with Image.open(path) as picture:
                return torch.from_numpy(np.array(picture.convert("RGB")))
        except (OSError, UnidentifiedImageError) as exc:
            raise ValueError(f"{field}: cannot read image {str(path)!r}: {exc}") from None
    if isinstance(value, np.ndarray):
        return torch.from_numpy(value)
    if isinstance(value, torch.Tensor):
        return value
    raise ValueError(
        f"{field} must be an image tensor ([H, W, 3] uint8 or [3, H, W] float) or a file path"
    )


def prepare_image(value: Any, config: VJepa2Config, field: str = "image") -> torch.Tensor:
    """Return a normalised ``[3, S, S]`` float image (``S`` the encoder's size).

    Raises:
        ValueError: Not an image, or an unreadable file.
    """
    image = _load(value, field)
    if image.dim() == 3 and image.shape[-1] == 3 and image.dtype == torch.uint8:
        image = image.permute(2, 0, 1).float() / 255.0
    elif image.dim() == 3 and image.shape[0] == 3 and image.is_floating_point():
        image = image.float()
    else:
        raise ValueError(
            f"{field} must be [H, W, 3] uint8 or [3, H, W] float in [0, 1], got "
            f"{list(image.shape)} {image.dtype}"
        )
    size = config.encoder.img_size
    h, w = image.shape[1:]
    if min(h, w) < 1:
        raise ValueError(f"{field} is empty")
    if (h, w) != (size, size):
        scale = size / min(h, w)
        new = (max(size, round(h * scale)), max(size, round(w * scale)))
        image = F.interpolate(
            image[None], size=new, mode="bilinear", antialias=True, align_corners=False
        )[0]
        top, left = (new[0] - size) // 2, (new[1] - size) // 2
        image = image[:, top : top + size, left : left + size]
    mean = torch.tensor(config.image_mean)[:, None, None]
    std = torch.tensor(config.image_std)[:, None, None]
    return ((image - mean) / std).contiguous()


def _floats(value: Any, field: str) -> torch.Tensor:
    try:
        tensor = (
            torch.as_tensor(value, dtype=torch.float32)
            if not isinstance(value, torch.Tensor)
            else value.float()
        )
    except (TypeError, ValueError, RuntimeError):
        raise ValueError(f"{field} must be numbers (a tensor or nested lists)") from None
    if not bool(torch.isfinite(tensor).all()):
        raise ValueError(f"{field} has non-finite values")
    return tensor


def as_pose(value: Any, config: VJepa2Config, field: str = "pose") -> torch.Tensor:
    """Return a ``[7]`` pose (zeros when ``value`` is None)."""
    dim = config.predictor.action_dim
    if value is None:
        return torch.zeros(dim)
    pose = _floats(value, field)
    if tuple(pose.shape) != (dim,):
        raise ValueError(
            f"{field} must be {dim} numbers (xyz, roll-pitch-yaw, gripper), got shape "
            f"{list(pose.shape)}"
        )
    return pose


def as_actions(value: Any, config: VJepa2Config, field: str = "actions") -> torch.Tensor:
    """Return ``[H, 7]`` actions, ``1 <= H <=`` the longest rollout."""
    if value is None:
        raise ValueError(f"{field} is required: one 7-vector per predicted frame")
    dim, limit = config.predictor.action_dim, config.predictor.max_horizon
    actions = _floats(value, field)
    if actions.dim() != 2 or actions.shape[1] != dim:
        raise ValueError(f"{field} must be [H, {dim}], got shape {list(actions.shape)}")
    if not 1 <= actions.shape[0] <= limit:
        raise ValueError(f"{field}: a rollout predicts 1 to {limit} frames, got {actions.shape[0]}")
    return actions


def as_latent(value: Any, config: VJepa2Config, field: str = "latent") -> torch.Tensor:
    """Return a ``[N, D]`` frame latent (as the encoder makes it, normalised)."""
    shape = (config.predictor.num_patches, config.predictor.embed_dim)
    latent = _floats(value, field)
    if latent.dim() == 3 and latent.shape[0] == 1:
        latent = latent[0]
    if tuple(latent.shape) != shape:
        raise ValueError(
            f"{field} must be {list(shape)} (patches x encoder width), got {list(latent.shape)}"
        )
    return latent
