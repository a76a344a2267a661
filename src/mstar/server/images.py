"""Images for the wire: what models emit to PNG bytes, and uploaded PNG/JPEG files to arrays."""

from __future__ import annotations

import io
import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from PIL import Image, ImageOps, UnidentifiedImageError

__all__ = ["MAX_IMAGE_PIXELS", "EncodedImage", "decode_image", "encode_image", "png_bytes"]

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
        raise ValueError(
            f"images must be [H, W], [H, W, 3] or [H, W, 4], got shape {list(array.shape)}"
        )
    buffer = io.BytesIO()
    Image.fromarray(np.ascontiguousarray(array)).save(buffer, format="PNG")
    return buffer.getvalue()


@dataclass(frozen=True)
class EncodedImage:
    """An image as PNG bytes, with its size."""

    png: bytes
    width: int
    height: int


def encode_image(image: Any) -> EncodedImage:
    """Return the PNG of an image a model emitted, whatever form it takes.

    Args:
        image: One of:

            - encoded bytes (PNG passes through unchanged; any other format Pillow reads is
              re-encoded);
            - a PIL image;
            - a tensor or array, ``[H, W]``, ``[H, W, C]`` or ``[C, H, W]`` with C in 1, 3, 4
              (the channels-last reading wins where both fit), with leading batch axes of
              size 1; uint8 (or integers in 0..255) as is, booleans as black and white,
              floats as intensities in [0, 1] (clipped; NaN is black).

    Raises:
        ValueError: Bytes that are no image, or an array of none of those shapes or types.
    """
    if isinstance(image, bytes | bytearray | memoryview):
        return _from_encoded(bytes(image))
    if isinstance(image, Image.Image):
        return _from_pil(image)
    array = _pixels(image)
    png = png_bytes(array)
    return EncodedImage(png, width=array.shape[1], height=array.shape[0])


def _from_encoded(data: bytes) -> EncodedImage:
    try:
        with Image.open(io.BytesIO(data)) as opened:
            opened.load()  # a truncated or corrupt file fails here, not in the client
            if opened.format == "PNG":
                return EncodedImage(data, width=opened.width, height=opened.height)
            return _from_pil(opened)
    except (UnidentifiedImageError, OSError, SyntaxError) as exc:
        raise ValueError(f"the model emitted {len(data)} bytes that are no image: {exc}") from None


def _from_pil(picture: Image.Image) -> EncodedImage:
    if picture.mode not in ("1", "L", "RGB", "RGBA"):
        has_alpha = "A" in picture.getbands() or "transparency" in picture.info
        picture = picture.convert("RGBA" if has_alpha else "RGB")
    buffer = io.BytesIO()
    picture.save(buffer, format="PNG")
    return EncodedImage(buffer.getvalue(), width=picture.width, height=picture.height)


def _pixels(image: Any) -> np.ndarray:
    """Return an image tensor or array as uint8 ``[H, W]`` or ``[H, W, C]``."""
    if isinstance(image, torch.Tensor):
        tensor = image.detach().cpu()
        array = (tensor.float() if tensor.is_floating_point() else tensor).numpy()
    else:
        array = np.asarray(image)
    shape = list(array.shape)
    while array.ndim > 3 and array.shape[0] == 1:
        array = array[0]
    if array.ndim == 3 and array.shape[2] not in _CHANNELS and array.shape[0] in _CHANNELS:
        array = np.moveaxis(array, 0, 2)  # [C, H, W] -> [H, W, C]
    if (
        not (array.ndim == 2 or (array.ndim == 3 and array.shape[2] in _CHANNELS))
        or 0 in array.shape
    ):
        raise ValueError(
            f"an image must be [H, W], [H, W, C] or [C, H, W] with C in 1, 3, 4; got shape {shape}"
        )
    if array.dtype == np.uint8:
        return array
    if array.dtype == np.bool_:
        return array.astype(np.uint8) * 255
    if np.issubdtype(array.dtype, np.floating):
        scaled = np.nan_to_num(array.astype(np.float32), nan=0.0).clip(0.0, 1.0) * 255.0
        return np.rint(scaled).astype(np.uint8)
    if np.issubdtype(array.dtype, np.integer):
        if array.min() < 0 or array.max() > 255:
            raise ValueError(f"integer pixels must lie in 0..255, got {array.min()}..{array.max()}")
        return array.astype(np.uint8)
    raise ValueError(
        f"an image must hold uint8, integer, boolean or float pixels, got {array.dtype}"
    )


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
                    raise ValueError(
                        f"the image is {width}x{height}, more than {max_pixels} pixels"
                    )
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
    except (
        OSError,
        SyntaxError,
        Image.DecompressionBombError,
        Image.DecompressionBombWarning,
    ) as exc:
        raise ValueError(f"the image cannot be decoded: {exc}") from None
