"""What a BAGEL checkpoint's files say: fields of its JSON configs, tensor shapes of its safetensors
headers.

Parsed once, at the edge: each reader returns typed config parts or raises `CheckpointError`
naming the file and the field (or tensor). Optional fields absent from a JSON config take
the defaults of the transformers config class upstream reads it with (``Qwen2Config``,
``SiglipVisionConfig``); the model's sizes are never defaulted.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from mstar.errors import CheckpointError, UnsupportedModelError
from mstar.zoo.bagel.config import LLMConfig, VAEConfig, ViTConfig
from mstar.zoo.bagel.vae import bfl_vae_shapes
from mstar.zoo.hf_checkpoint import read_json_object

__all__ = [
    "NORM_GROUPS_KEY",
    "llm_config_of",
    "read_header",
    "read_json",
    "shape_of",
    "side_of",
    "vae_config_of",
    "vit_config_of",
]

# FLUX's autoencoder normalises in 32 groups; a random checkpoint too narrow for that notes its
# own count in ae.safetensors' metadata (upstream's files have no such key).
NORM_GROUPS_KEY = "norm_groups"
_MAX_HEADER = 100 * 2**20  # safetensors' own limit on a header


def llm_config_of(raw: Mapping[str, Any], path: Path) -> LLMConfig:
    """The MoT LLM of ``llm_config.json``; absent optional fields take Qwen2Config's defaults, as
    upstream reads it."""
    _require(raw, path, "hidden_act", "silu")
    _require(raw, path, "use_sliding_window", False)
    scaling = raw.get("rope_scaling")
    if scaling is not None and not (
        isinstance(scaling, Mapping) and scaling.get("rope_type", scaling.get("type")) == "default"
    ):
        raise CheckpointError(
            f"{path}: rope_scaling {scaling!r} is not supported (BAGEL's Qwen2.5 runs plain RoPE)"
        )
    parameters = raw.get("rope_parameters")
    theta_source = (
        parameters if isinstance(parameters, Mapping) and "rope_theta" in parameters else raw
    )
    heads = _int(raw, "num_attention_heads", path)
    hidden = _int(raw, "hidden_size", path)
    if (
        "head_dim" in raw
        and raw["head_dim"] is not None
        and raw["head_dim"] != hidden // max(heads, 1)
    ):
        raise CheckpointError(
            f"{path}: head_dim {raw['head_dim']!r} is not hidden_size / num_attention_heads "
            f"= {hidden // heads}"
        )
    dtype = raw.get("torch_dtype", raw.get("dtype"))
    if dtype is not None and not isinstance(dtype, str):
        raise CheckpointError(
            f"{path}: torch_dtype must be a string such as 'bfloat16', got {dtype!r}"
        )
    try:
        return LLMConfig(
            hidden_size=hidden,
            num_layers=_int(raw, "num_hidden_layers", path),
            num_heads=heads,
            num_kv_heads=_int(raw, "num_key_value_heads", path, default=heads),
            intermediate_size=_int(raw, "intermediate_size", path),
            vocab_size=_int(raw, "vocab_size", path),
            rope_theta=_float(theta_source, "rope_theta", path, 10_000.0),
            rms_norm_eps=_float(raw, "rms_norm_eps", path, 1e-6),
            max_position=_int(raw, "max_position_embeddings", path, default=32_768),
            torch_dtype=dtype,
        )
    except UnsupportedModelError as exc:
        raise CheckpointError(f"{path}: {exc}") from None


def vit_config_of(
    raw: Mapping[str, Any], path: Path, ema: Mapping[str, tuple[int, ...]], ema_path: Path
) -> ViTConfig:
    """The SigLIP NaViT of ``vit_config.json`` (upstream drops its last layer) and
    ``vit_pos_embed``'s grid."""
    _require(raw, path, "hidden_act", "gelu_pytorch_tanh")
    _require(raw, path, "num_channels", 3)
    layers = _int(raw, "num_hidden_layers", path)
    if layers < 2:
        raise CheckpointError(
            f"{path}: num_hidden_layers is {layers}; BAGEL drops the last layer, so it needs "
            "at least 2"
        )
    hidden, heads = _int(raw, "hidden_size", path), _int(raw, "num_attention_heads", path)
    if hidden % heads:
        raise CheckpointError(
            f"{path}: hidden_size {hidden} is not a multiple of num_attention_heads {heads}"
        )
    patch, image_size = _int(raw, "patch_size", path), _int(raw, "image_size", path)
    if image_size % patch:
        raise CheckpointError(
            f"{path}: image_size {image_size} is not a multiple of patch_size {patch}"
        )
    side = side_of(ema, "vit_pos_embed.pos_embed", ema_path)
    if side != image_size // patch:
        raise CheckpointError(
            f"{ema_path}: vit_pos_embed.pos_embed covers {side} x {side} patches "
            "(vit_max_num_patch_per_side), but "
            f"{path.name}'s image_size / patch_size is {image_size // patch}: the two grids "
            "must agree"
        )
    return ViTConfig(
        hidden_size=hidden,
        intermediate_size=_int(raw, "intermediate_size", path),
        num_layers=layers - 1,
        num_heads=heads,
        patch_size=patch,
        max_patches_per_side=side,
        layer_norm_eps=_float(raw, "layer_norm_eps", path, 1e-6),
    )


def vae_config_of(
    ae: Mapping[str, tuple[int, ...]], metadata: Mapping[str, str], path: Path
) -> VAEConfig:
    """The FLUX autoencoder's sizes, read off its encoder; every tensor is then checked against
    them."""
    ch = shape_of(ae, "encoder.conv_in.weight", path, 4)[0]
    shape_of(ae, "encoder.down.0.block.0.conv1.weight", path, 4)
    levels = next(
        i for i in range(len(ae) + 1) if f"encoder.down.{i}.block.0.conv1.weight" not in ae
    )
    blocks = next(
        j for j in range(len(ae) + 1) if f"encoder.down.0.block.{j}.conv1.weight" not in ae
    )
    widths = [
        shape_of(ae, f"encoder.down.{i}.block.0.conv1.weight", path, 4)[0] for i in range(levels)
    ]
    if any(w % ch for w in widths):
        raise CheckpointError(
            f"{path}: the encoder's widths {widths} are not multiples of encoder.conv_in's "
            f"{ch} channels"
        )
    groups_text = metadata.get(NORM_GROUPS_KEY, "32")
    if not groups_text.isdigit() or int(groups_text) < 1:
        raise CheckpointError(
            f"{path}: metadata {NORM_GROUPS_KEY} must be a positive integer, got {groups_text!r}"
        )
    try:
        config = VAEConfig(
            ch=ch,
            ch_mult=tuple(w // ch for w in widths),
            num_res_blocks=blocks,
            z_channels=shape_of(ae, "decoder.conv_in.weight", path, 4)[1],
            norm_groups=int(groups_text),
        )
    except UnsupportedModelError as exc:
        raise CheckpointError(f"{path}: {exc} (FLUX's GroupNorm)") from None
    expected = bfl_vae_shapes(config)
    missing = sorted(set(expected) - set(ae))
    unexpected = sorted(set(ae) - set(expected))
    wrong = [
        f"{n} has shape {list(ae[n])}, expected {list(s)}"
        for n, s in expected.items()
        if n in ae and ae[n] != s
    ]
    if missing or unexpected or wrong:
        raise CheckpointError(
            f"{path} is not a FLUX autoencoder of {len(widths)} levels x {blocks} blocks, "
            f"widths {widths}, "
            f"z_channels {config.z_channels}: missing {missing[:6]}, unexpected {unexpected[:6]}, "
            f"misshapen {wrong[:6]}"
        )
    return config


def read_json(directory: Path, filename: str) -> dict[str, Any]:
    path = directory / filename
    if not path.is_file():
        raise CheckpointError(f"BAGEL checkpoint {str(directory)!r} has no {filename}")
    return read_json_object(path)


def _int(raw: Mapping[str, Any], key: str, path: Path, *, default: int | None = None) -> int:
    if key not in raw or raw[key] is None:
        if default is None:
            raise CheckpointError(
                f"{path}: field {key!r} is missing (BAGEL reads the model's size from it)"
            )
        return default
    value = raw[key]
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise CheckpointError(f"{path}: {key} must be a positive integer, got {value!r}")
    return value


def _float(raw: Mapping[str, Any], key: str, path: Path, default: float) -> float:
    value = raw.get(key, default)
    if value is None:
        return default
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or value <= 0
    ):
        raise CheckpointError(f"{path}: {key} must be a positive number, got {value!r}")
    return float(value)


def _require(raw: Mapping[str, Any], path: Path, key: str, supported: object) -> None:
    if key in raw and raw[key] is not None and raw[key] != supported:
        raise CheckpointError(
            f"{path}: {key} {raw[key]!r} is not supported (BAGEL runs {supported!r})"
        )


def read_header(path: Path) -> tuple[dict[str, tuple[int, ...]], dict[str, str]]:
    """Return a safetensors file's tensor shapes and metadata, reading its header only.

    The header is parsed here (an 8-byte little-endian length, then JSON) because
    `safe_open` maps the whole file first, and mapping a 29 GB ``ema.safetensors`` fails
    where the address space is limited; the tensors themselves are read by `safe_open`.
    """
    try:
        with path.open("rb") as f:
            size = path.stat().st_size
            length = int.from_bytes(f.read(8), "little")
            if size < 8 or not 2 <= length <= min(size - 8, _MAX_HEADER):
                raise ValueError(f"a header of {length} bytes in a file of {size}")
            header = json.loads(f.read(length))
        if not isinstance(header, dict):
            raise ValueError("the header is not a JSON object")
        metadata = header.pop("__metadata__", None) or {}
        shapes: dict[str, tuple[int, ...]] = {}
        end = 0
        for name, entry in header.items():
            shape, (start, stop) = entry["shape"], entry["data_offsets"]
            if not all(isinstance(d, int) and d >= 0 for d in shape) or not 0 <= start <= stop:
                raise ValueError(f"{name} has shape {shape!r} and offsets {[start, stop]!r}")
            shapes[name] = tuple(shape)
            end = max(end, stop)
        if 8 + length + end != size:
            raise ValueError(f"the tensors take {end} bytes but the file holds {size - 8 - length}")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{path} is not a readable safetensors file: {exc}") from None
    return shapes, {str(k): str(v) for k, v in metadata.items()}


def shape_of(
    shapes: Mapping[str, tuple[int, ...]], name: str, path: Path, ndim: int
) -> tuple[int, ...]:
    if name not in shapes:
        raise CheckpointError(f"{path} has no tensor {name}")
    shape = shapes[name]
    if len(shape) != ndim:
        raise CheckpointError(f"{path}: {name} has shape {list(shape)}, expected {ndim} dimensions")
    return shape


def side_of(shapes: Mapping[str, tuple[int, ...]], name: str, path: Path) -> int:
    """The side of a square position table ``[side^2, hidden]``."""
    rows = shape_of(shapes, name, path, 2)[0]
    side = math.isqrt(rows)
    if side * side != rows:
        raise CheckpointError(
            f"{path}: {name} has {rows} rows, not a square grid of positions (side^2)"
        )
    return side
