"""pi0.5's camera images: openpi's resize-with-pad to the model's square, then [-1, 1] floats.

Plain numpy/torch/PIL on the CPU; every robot's cameras go through these.
"""

from __future__ import annotations

import numpy as np
import torch
from PIL import Image

__all__ = ["absent_image", "prepare_image", "resize_with_pad"]


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
    resized = Image.fromarray(image).resize(
        (new_width, new_height), resample=Image.Resampling.BILINEAR
    )
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
