"""Images for the wire: uint8 tensors to PNG bytes, and uploaded PNG/JPEG files to arrays."""

from __future__ import annotations

import io
import warnings
from typing import Any

import numpy as np
import torch
from PIL import Image, ImageOps, UnidentifiedImageError

__all__ = ["MAX_IMAGE_PIXELS", "decode_image", "png_bytes"]

UPLOAD_FORMATS = ("PNG", "JPEG")
MAX_IMAGE_PIXELS = 4096 * 4096
"""Largest upload decoded (width x height): bigger ones are refused before any pixel is read."""

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


def decode_image(data: bytes, *, max_pixels: int = MAX_IMAGE_PIXELS) -> np.ndarray:
    """Decode an uploaded PNG or JPEG file to a uint8 array.

    Returns:
        ``[H, W]`` for grey images, ``[H, W, 3]`` for RGB, ``[H, W, 4]`` when the image has
        transparency (palette and grey-alpha images are expanded to these).

    Raises:
        ValueError: Not a PNG or JPEG file, corrupt or truncated, or over ``max_pixels``.
    """
    if not data:
        raise ValueError("the file is empty")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(data), formats=UPLOAD_FORMATS) as opened:
                width, height = opened.size
                if width * height > max_pixels:
                    raise ValueError(f"the image is {width}x{height}, more than {max_pixels} pixels")
                opened.load()  # reads and checks every byte (a truncated file fails here)
                picture: Image.Image = ImageOps.exif_transpose(opened)  # photos: upright as shown
                if picture.mode in ("I;16", "I;16B", "I;16L"):  # 16-bit grey: keep the high byte
                    return (np.asarray(picture).astype(np.uint16) >> 8).astype(np.uint8)
                if picture.mode == "1":
                    picture = picture.convert("L")
                elif picture.mode not in ("L", "RGB", "RGBA"):
                    has_alpha = "A" in picture.getbands() or "transparency" in picture.info
                    picture = picture.convert("RGBA" if has_alpha else "RGB")
                return np.asarray(picture, dtype=np.uint8).copy()
    except UnidentifiedImageError:
        raise ValueError("the file is not a PNG or JPEG image") from None
    except (OSError, SyntaxError, Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise ValueError(f"the image cannot be decoded: {exc}") from None
