"""Every form a model may emit an image in reaches the wire as the same PNG, and `/generate`
lines never carry Python reprs: bytes go as base64, other values as JSON."""

from __future__ import annotations

import base64
import io
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from mstar.client import ImageOutput, ValueOutput, parse_output
from mstar.errors import MStarError
from mstar.runtime.model import Output
from mstar.server.encoding import output_line
from mstar.server.images import encode_image

RGB = np.random.default_rng(0).integers(0, 256, (5, 7, 3), dtype=np.uint8)


def _png(array: np.ndarray, fmt: str = "PNG") -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(array).save(buffer, format=fmt)
    return buffer.getvalue()


def _decoded(png: bytes) -> np.ndarray:
    with Image.open(io.BytesIO(png), formats=("PNG",)) as picture:
        return np.array(picture)


@pytest.mark.parametrize(
    "form",
    [
        pytest.param(RGB, id="uint8-hwc-array"),
        pytest.param(torch.from_numpy(RGB), id="uint8-hwc-tensor"),
        pytest.param(torch.from_numpy(RGB).permute(2, 0, 1), id="uint8-chw-tensor"),
        pytest.param(torch.from_numpy(RGB)[None], id="uint8-batch-of-one"),
        pytest.param(RGB.astype(np.float32) / 255.0, id="float-hwc-array"),
        pytest.param(
            torch.from_numpy(RGB).permute(2, 0, 1).to(torch.bfloat16) / 255.0,
            id="bfloat16-chw-tensor",
        ),
        pytest.param(RGB.astype(np.int64), id="int64-array"),
        pytest.param(Image.fromarray(RGB), id="pil"),
        pytest.param(_png(RGB), id="png-bytes"),
        pytest.param(bytearray(_png(RGB)), id="png-bytearray"),
    ],
)
def test_every_form_encodes_to_the_same_png(form: Any) -> None:
    image = encode_image(form)
    assert (image.width, image.height) == (7, 5)
    pixels = _decoded(image.png)
    if isinstance(form, torch.Tensor) and form.dtype == torch.bfloat16:
        assert np.abs(pixels.astype(int) - RGB).max() <= 1  # bfloat16 holds 8 bits of mantissa
    else:
        np.testing.assert_array_equal(pixels, RGB)


def test_png_bytes_pass_through_and_other_formats_are_re_encoded() -> None:
    png = _png(RGB)
    assert encode_image(png).png == png
    grey = RGB[:, :, 0]
    np.testing.assert_array_equal(_decoded(encode_image(_png(grey, "BMP")).png), grey)
    assert _decoded(encode_image(np.ones((4, 6), bool)).png).max() == 255
    floats = encode_image(np.array([[-1.0, 0.5, 2.0, np.nan]], np.float32))
    np.testing.assert_array_equal(_decoded(floats.png), [[0, 128, 255, 0]])  # clipped to [0, 1]


@pytest.mark.parametrize(
    ("bad", "match"),
    [
        (b"\x89PNG but not really", "no image"),
        (_png(RGB)[:40], "no image"),
        (np.zeros((5, 5, 2), np.uint8), "shape"),
        (np.zeros((2, 4, 4, 3), np.uint8), "shape"),
        (np.full((3, 3), 300), "0..255"),
    ],
)
def test_what_is_no_image_is_refused(bad: Any, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        encode_image(bad)


def _line(modality: str, data: Any) -> dict[str, Any]:
    return output_line(Output("r", modality, "x", data, "node", "walk"), sample_rate=None)


def test_png_bytes_of_an_image_output_reach_the_client_as_an_image() -> None:
    line = _line("image", _png(RGB))
    assert (line["format"], line["width"], line["height"]) == ("png", 7, 5) and "value" not in line
    out = parse_output(line)
    assert isinstance(out, ImageOutput) and out.image.dtype == np.uint8
    np.testing.assert_array_equal(out.image, RGB)
    grey = parse_output(_line("image", torch.from_numpy(RGB[:, :, 0])))
    assert isinstance(grey, ImageOutput) and grey.image.shape == (5, 7, 3)  # expanded to RGB
    with pytest.raises(MStarError, match="no image"):
        _line("image", b"not an image")


def test_no_output_falls_back_to_a_repr() -> None:
    raw = b"\x00\x01binary"
    for modality in ("latent", "audio", "action", "text-ish"):
        line = _line(modality, raw)
        assert (line["encoding"], line["num_bytes"]) == ("base64", len(raw)) and base64.b64decode(
            line["data"]
        ) == raw
        out = parse_output(line)
        assert isinstance(out, ValueOutput) and out.value == raw
    nested = _line(
        "latent", {"steps": (np.int64(3), torch.tensor([1.5])), "blob": b"ab", "ok": None}
    )
    assert nested["value"] == {"steps": [3, [1.5]], "blob": "YWI=", "ok": None}
