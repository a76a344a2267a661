"""Wire encodings shared by the routes: OpenAI error bodies, server-sent events, NDJSON
lines of native outputs."""

from __future__ import annotations

import base64
import json
from typing import Any

import numpy as np
import torch

from mstar.engines.sampler import TokenLogprobs
from mstar.errors import MStarError
from mstar.runtime.model import Output
from mstar.server.audio import pcm16_bytes
from mstar.server.images import encode_image

__all__ = ["error_body", "ndjson", "output_line", "sse", "token_ids", "token_logprobs"]

SSE_DONE = b"data: [DONE]\n\n"


def error_body(
    message: str,
    error_type: str,
    *,
    param: str | None = None,
    code: str | int | None = None,
    exc: BaseException | None = None,
) -> dict[str, Any]:
    """Return an OpenAI-style error object.

    With ``exc`` (an `MStarError`), ``mstar_error`` names its class, so that `mstar.client`
    raises the same type.
    """
    error: dict[str, Any] = {"message": message, "type": error_type, "param": param, "code": code}
    if isinstance(exc, MStarError):
        error["mstar_error"] = type(exc).__name__
    return {"error": error}


def sse(obj: Any) -> bytes:
    """Return one server-sent event carrying ``obj`` as JSON."""
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def ndjson(obj: Any) -> bytes:
    """Return one NDJSON line carrying ``obj``."""
    return json.dumps(obj, separators=(",", ":")).encode() + b"\n"


def token_ids(data: Any) -> list[int]:
    """Return the token ids of a text output: one id (an int), a tensor, array or list of them, or
    a sampled token with its log-probabilities (`TokenLogprobs.to_dict`)."""
    if isinstance(data, int):
        return [data]
    if isinstance(data, dict):
        return [int(data["token_id"])]
    if isinstance(data, torch.Tensor):
        return [int(i) for i in data.reshape(-1).tolist()]
    return [int(i) for i in np.ravel(data)]


def token_logprobs(data: Any) -> TokenLogprobs | None:
    """Return the log-probabilities a text output carries (None: a bare token id)."""
    return TokenLogprobs.from_dict(data) if isinstance(data, dict) else None


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _array(value: torch.Tensor) -> np.ndarray:
    value = value.detach().cpu()
    if value.dtype in (torch.bfloat16, torch.float16):
        value = value.float()  # not every client reads half floats: widen them
    return np.ascontiguousarray(value.numpy())


def output_line(
    out: Output, *, sample_rate: int | None, with_audio: bool = True, text: str | None = None
) -> dict[str, Any]:
    """Return the NDJSON object of one output (the native `/generate` format).

    - text: ``token_ids``, ``num_tokens`` and, when the model detokenizes, ``text`` (the
      complete characters these tokens add); with log-probabilities asked for, ``logprobs``:
      ``{"token_id", "logprob", "top_token_ids", "top_logprobs"}`` of the token;
    - audio: ``num_samples``, ``sample_rate`` and base64 PCM16 ``data`` (mono);
    - image: ``num_images`` 1, ``width``, ``height``, ``format`` "png" and base64 PNG ``data``,
      whatever the model emitted (encoded bytes, a PIL image, a uint8 or float tensor; see
      `encode_image`);
    - any other tensor (latents, actions, frames): ``shape``, ``dtype`` and base64 ``data``
      of its little-endian bytes in row-major order;
    - bytes: ``encoding`` "base64", ``num_bytes`` and ``data``;
    - anything else: ``value``, as JSON (tuples as lists, numpy scalars as numbers, nested
      arrays as nested lists).

    Raises:
        MStarError: An image output that is no image (the model's fault, not the request's).
    """
    line: dict[str, Any] = {
        "modality": out.modality,
        "name": out.name,
        "node": out.node,
        "walk": out.walk,
    }
    data = out.data
    if out.modality == "text":
        ids = token_ids(data)
        line.update(token_ids=ids, num_tokens=len(ids))
        if isinstance(data, dict):
            line["logprobs"] = data
        if text is not None:
            line["text"] = text
        return line
    if out.modality == "audio" and isinstance(data, torch.Tensor | np.ndarray):
        pcm = pcm16_bytes(data)
        line.update(num_samples=len(pcm) // 2, sample_rate=sample_rate)
        if with_audio:
            line["data"] = _b64(pcm)
        return line
    if out.modality == "image":
        try:
            image = encode_image(data)
        except ValueError as exc:
            raise MStarError(
                f"node {out.node!r} emitted an image {out.name!r} that is no image: {exc}"
            ) from None
        line.update(
            num_images=1, width=image.width, height=image.height, format="png", data=_b64(image.png)
        )
        return line
    if isinstance(data, torch.Tensor | np.ndarray):
        array = _array(data) if isinstance(data, torch.Tensor) else np.ascontiguousarray(data)
        little = array.astype(array.dtype.newbyteorder("<"), copy=False)
        line.update(shape=list(array.shape), dtype=str(array.dtype), data=_b64(little.tobytes()))
        return line
    if isinstance(data, bytes | bytearray | memoryview):
        raw = bytes(data)
        line.update(encoding="base64", num_bytes=len(raw), data=_b64(raw))
        return line
    line["value"] = _json_value(data)
    return line


def _json_value(value: Any) -> Any:
    """Return ``value`` as JSON data: tuples as lists, numpy and torch values as numbers or lists.

    Bytes nested in a value become base64 text; what has no JSON form becomes its ``repr``.
    """
    if value is None or isinstance(value, str | int | float | bool):
        return value
    if isinstance(value, dict):
        return {str(k): _json_value(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_value(v) for v in value]
    if isinstance(value, torch.Tensor):
        return _array(value).tolist()
    if isinstance(value, np.ndarray | np.generic):
        return value.tolist()
    if isinstance(value, bytes | bytearray | memoryview):
        return _b64(bytes(value))
    return repr(value)
