"""Images for the wire: uint8 tensors to PNG bytes."""

from __future__ import annotations

import io
from typing import Any

import numpy as np
import torch
from PIL import Image

__all__ = ["png_bytes"]

_CHANNELS = (1, 3, 4)  # grey, RGB, RGBA: Pillow infers the mode from the shape


def png_bytes(image: Any) -> bytes:
    """Return the PNG encoding of a uint8 image.

    Args:
        image: A tensor or array, [H, W] (grey), [H, W, 3] (RGB) or [H, W, 4] (RGBA).

    Raises:
        ValueError: Not a uint8 image of one of those shapes.
    """
    if isinstance(image, torch.Tensor):
        array = image.detach().cpu().numpy()
    else:
        array = np.asarray(image)
    if array.dtype != np.uint8:
        raise ValueError(f"images must be uint8, got {array.dtype}")
    if array.ndim == 3 and array.shape[2] == 1:
        array = array[:, :, 0]
    channels = 1 if array.ndim == 2 else array.shape[2] if array.ndim == 3 else 0
    if channels not in _CHANNELS:
        raise ValueError(f"images must be [H, W], [H, W, 3] or [H, W, 4], got shape {list(array.shape)}")
    buffer = io.BytesIO()
    Image.fromarray(np.ascontiguousarray(array)).save(buffer, format="PNG")
    return buffer.getvalue()
